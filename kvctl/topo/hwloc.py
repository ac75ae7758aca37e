"""An hwloc XML (``lstopo --of xml``, hwloc 1.x and 2.x) read into the sysfs model.

hwloc keeps the PCI tree as nested objects: host bridges (``Bridge`` with
``bridge_type="0-1"`` and a bus range ``bridge_pci="0000:[10-1f]"``), PCI bridges and
devices (``pci_busid``, ``pci_type="CCCC [VVVV:DDDD] [SSSS:SSSS] RR"``), and OS devices below
them (``network`` netdevs, ``openfabrics`` RDMA devices with ``PortNState`` infos). I/O
objects hang below the CPU-side object they are local to, whose ``nodeset`` and
``cpuset`` give their NUMA node and CPUs. :func:`hwloc_facts` turns that into the
:class:`~kvctl.probe.host.SysfsFacts` a sysfs scan would give, so the same classification,
ranking and doctor run on it.

What an hwloc XML does not hold, and so topo does not report from one: link speed and width
(hwloc keeps one GB/s figure per link), IOMMU groups, kernel modules, NVLinks, RDMA port
rates, netdev states and MTUs.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.probe.host import (
    CLASS_DISPLAY,
    CLASS_OTHER_BRIDGE,
    NVIDIA_VENDOR,
    IbDevice,
    IbPort,
    NetDev,
    NumaNode,
    PciFunction,
    SysfsFacts,
    pci_sort_key,
)
from kvctl.probe.types import is_bdf, normalize_bdf
from kvctl.topo.xmlfile import cpulist, mask_bits

HINT = "write one with: lstopo --of xml --whole-io topology.xml"
_PCI_TYPE = re.compile(r"^\s*([0-9a-fA-F]{4})\s*\[([0-9a-fA-F]{4}):([0-9a-fA-F]{4})\]")
_BRIDGE_PCI = re.compile(r"^\s*([0-9a-fA-F]{4,8}):\[([0-9a-fA-F]{2})")
_PORT_STATE = re.compile(r"^Port(\d+)State$")
#: ``enum ibv_port_state`` numbers, as hwloc copies them from sysfs
PORT_STATES = {"0": "NOP", "1": "DOWN", "2": "INIT", "3": "ARMED", "4": "ACTIVE",
               "5": "ACTIVE_DEFER"}
OSDEV_NETWORK = "2"
OSDEV_OPENFABRICS = "3"


class _Walk:
    def __init__(self) -> None:
        self.functions: dict[str, PciFunction] = {}
        self.ib: list[IbDevice] = []
        self.netdevs: list[NetDev] = []
        self.numa: dict[int, str | None] = {}

    def objects(self, elem: ET.Element, path: tuple[str, ...], node: int | None,
                cpus: str | None) -> None:
        for child in elem.findall("object"):
            kind = child.get("type")
            here_node, here_cpus = node, cpus
            nodeset = child.get("nodeset")
            if nodeset is not None and kind not in ("Bridge", "PCIDev", "OSDev"):
                nodes = mask_bits(nodeset)
                here_node = nodes[0] if len(nodes) == 1 else None
                here_cpus = cpulist(mask_bits(child.get("cpuset", "")))
            if kind == "NUMANode" and child.get("os_index") is not None:
                self.numa[int(child.get("os_index", "0"))] = cpulist(
                    mask_bits(child.get("cpuset", "")))
            if kind == "Bridge" and child.get("pci_busid") is None:
                self.objects(child, (self.host_bridge(child),), here_node, here_cpus)
            elif kind in ("Bridge", "PCIDev"):
                self.pci(child, path, here_node, here_cpus)
            else:
                self.objects(child, path, here_node, here_cpus)

    @staticmethod
    def host_bridge(elem: ET.Element) -> str:
        match = _BRIDGE_PCI.match(elem.get("bridge_pci", ""))
        if match is None:
            return f"pci-host-bridge-{elem.get('gp_index', '?')}"
        return f"pci{int(match[1], 16):04x}:{match[2].lower()}"

    def pci(self, elem: ET.Element, path: tuple[str, ...], node: int | None,
            cpus: str | None) -> None:
        busid = elem.get("pci_busid", "")
        try:
            address = normalize_bdf(busid)
        except UsageError:
            address = busid
        if not is_bdf(address):
            self.objects(elem, path, node, cpus)
            return
        if not path:  # no host bridge above it in the file: its own bus's
            dom, bus, _ = address.split(":")
            path = (f"pci{dom}:{bus}",)
        here = (*path, address)
        klass = vendor = device = None
        match = _PCI_TYPE.match(elem.get("pci_type", ""))
        if match is not None:
            klass = int(match[1], 16) << 8
            vendor, device = int(match[2], 16), int(match[3], 16)
        self.functions[address] = PciFunction(
            address=address, path=here, vendor=vendor, device=device, class_code=klass,
            numa_node=node, local_cpulist=cpus)
        for osdev in elem.findall("object[@type='OSDev']"):
            self.osdev(osdev, address)
        self.objects(elem, here, node, cpus)

    def osdev(self, elem: ET.Element, address: str) -> None:
        name = elem.get("name")
        if not name:
            return
        kind = elem.get("osdev_type")
        infos = {i.get("name", ""): i.get("value", "") for i in elem.findall("info")}
        if kind == OSDEV_OPENFABRICS:
            ports = []
            for key, value in sorted(infos.items()):
                match = _PORT_STATE.match(key)
                if match is None:
                    continue
                number = int(match[1])
                ports.append(IbPort(
                    port=number, state=PORT_STATES.get(value, value or None), phys_state=None,
                    rate_gbps=None, rate_text=None,
                    link_layer=infos.get(f"Port{number}LinkLayer") or None, gids=()))
            self.ib.append(IbDevice(name, address, tuple(sorted(ports, key=lambda p: p.port))))
        elif kind == OSDEV_NETWORK:
            self.netdevs.append(NetDev(name, address, None, None, None, None, 0))


def hwloc_facts(root: ET.Element) -> SysfsFacts:
    """The sysfs facts an hwloc XML document (its ``<topology>`` element) holds."""
    walk = _Walk()
    walk.objects(root, (), None, None)
    distances = _distances(root)
    numa = tuple(NumaNode(n, walk.numa[n], distances.get(n, ())) for n in sorted(walk.numa))
    gpus = [a for a, f in walk.functions.items() if f.vendor == NVIDIA_VENDOR
            and f.class_code is not None and f.class_code >> 16 == CLASS_DISPLAY]
    switches = [a for a, f in walk.functions.items() if f.vendor == NVIDIA_VENDOR
                and f.class_code is not None and f.class_code >> 8 == CLASS_OTHER_BRIDGE]
    return SysfsFacts(
        functions=walk.functions,
        gpus=tuple(sorted(gpus, key=pci_sort_key)),
        nvswitches=tuple(sorted(switches, key=pci_sort_key)),
        ib_devices=tuple(sorted(walk.ib, key=lambda d: d.name)),
        netdevs=tuple(sorted(walk.netdevs, key=lambda n: n.name)),
        numa_nodes=numa,
        modules=frozenset(),
        modules_known=False,
    )


def _distances(root: ET.Element) -> dict[int, tuple[int, ...]]:
    """NUMA latencies: hwloc 2 ``distances2`` (NUMALatency), hwloc 1 ``distances``."""
    for dist in root.iter("distances2"):
        if dist.get("type") != "NUMANode" or dist.get("name", "NUMALatency") != "NUMALatency":
            continue
        try:
            indexes = [int(x) for x in " ".join(dist.findtext("indexes") or "").split()]
            values = [int(x) for e in dist.findall("u64values") for x in (e.text or "").split()]
        except ValueError:
            return {}
        count = len(indexes)
        if count and len(values) == count * count:
            return {node: tuple(values[i * count:(i + 1) * count])
                    for i, node in enumerate(indexes)}
    for dist in root.iter("distances"):  # hwloc 1.x: latency values relative to 1.0
        try:
            count = int(dist.get("nbobjs", "0"))
            lat = [float(e.get("value", "0")) for e in dist.findall("latency")]
        except ValueError:
            return {}
        if count and len(lat) == count * count:
            return {i: tuple(round(v * 10) for v in lat[i * count:(i + 1) * count])
                    for i in range(count)}
    return {}


def is_hwloc(root_name: str) -> bool:
    """Whether a document element named ``root_name`` is an hwloc topology."""
    return root_name == "topology"


def describe(path: Path, root: ET.Element) -> str:
    """How the sysfs source reads for this file: ``hwloc XML FILE (format 2.0)``."""
    version = root.get("version")
    return f"hwloc XML {path}" + (f" (format {version})" if version else "")
