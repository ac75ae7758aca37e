"""An NCCL topology dump (``NCCL_TOPO_DUMP_FILE``) or topology file (``NCCL_TOPO_FILE``)
read into the sysfs model.

NCCL writes ``<system><cpu numaid affinity ...><pci busid class vendor device link_speed
link_width> ... </pci></cpu></system>``: a ``<pci>`` per PCIe switch (named by its upstream
port) and per endpoint, ``<gpu dev ...><nvlink target count tclass/></gpu>`` inside a GPU's
``<pci>``, ``<nic><net name dev speed port guid .../></nic>`` inside a NIC's. NCCL builds it by
walking each device's sysfs path two levels at a time, so the file keeps the switches but
drops their downstream ports, the root ports and the host bridges. :func:`nccl_facts` puts
those back as named stand-ins (``port-above-<busid>``, ``root-port-of-<busid>``,
``host-bridge-of-<busid>``) so that the same classification runs:

- devices under one switch tree keep their real PIX/PXB classes;
- devices in different top-level trees under one ``<cpu>`` meet at the CPU. NCCL does not
  record host bridges, so PHB (same host bridge) and NODE (different ones) cannot be told
  apart: topo reports NODE, the farther of the two, and never claims a shared host bridge.

NVLinks come from ``<nvlink>`` (``tclass 0x068000`` is an NVSwitch, as NVML reports it).
NCCL lists only usable network ports (ACTIVE), at ``speed`` Mb/s; a ``<net>`` with
``guid="0x0"`` is a socket (TCP) NIC. A static topology file's ``<pci>`` of a network class
with no ``<net>`` is a NIC named by its PCI address.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.probe.host import (
    IbDevice,
    IbPort,
    NetDev,
    NumaNode,
    PciFunction,
    PciLink,
    SysfsFacts,
    parse_link_speed,
    pci_sort_key,
)
from kvctl.probe.nvml import NvLink, NvmlGpu, NvmlReport
from kvctl.probe.types import is_bdf, normalize_bdf
from kvctl.topo.xmlfile import cpulist, mask_bits

HINT = ("write one with NCCL_TOPO_DUMP_FILE=topo.xml (any NCCL job, e.g. nccl-tests "
        "all_reduce_perf) on the host")
CLASS_NVSWITCH = 0x068000
CLASS_BRIDGE = 0x0604
CLASS_NETWORK = 0x02


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


class _Walk:
    def __init__(self) -> None:
        self.functions: dict[str, PciFunction] = {}
        self.gpus: list[str] = []
        self.nvml: list[NvmlGpu] = []
        self.ib: list[IbDevice] = []
        self.netdevs: list[NetDev] = []
        self.numa: dict[int, str | None] = {}

    def cpu(self, elem: ET.Element) -> None:
        numaid = _int(elem.get("numaid"))
        node = numaid if numaid is not None and numaid >= 0 else None
        try:
            cpus = cpulist(mask_bits(elem.get("affinity", "")))
        except ValueError:
            cpus = None
        if node is not None:
            self.numa[node] = cpus
        for child in elem:
            if child.tag == "pci":
                busid = self.address(child)
                top = busid or "?"
                base = (f"host-bridge-of-{top}", f"root-port-of-{top}")
                self.pci(child, base, node, cpus)
            elif child.tag == "nic":
                self.nic(child, None)

    @staticmethod
    def address(elem: ET.Element) -> str | None:
        try:
            address = normalize_bdf(elem.get("busid", ""))
        except UsageError:
            return None
        return address if is_bdf(address) else None

    def pci(self, elem: ET.Element, above: tuple[str, ...], node: int | None,
            cpus: str | None) -> None:
        address = self.address(elem)
        if address is None:
            return
        path = (*above, address)
        klass = _int(elem.get("class"), 16)
        width = _int(elem.get("link_width"))
        self.functions[address] = PciFunction(
            address=address, path=path, vendor=_int(elem.get("vendor"), 16),
            device=_int(elem.get("device"), 16), class_code=klass, numa_node=node,
            local_cpulist=cpus,
            link=PciLink(max_speed_gts=parse_link_speed(elem.get("link_speed")),
                         max_width=width or None))
        nets = 0
        for child in elem:
            if child.tag == "pci":  # a switch's downstream port stands between
                self.pci(child, (*path, f"port-above-{self.address(child)}"), node, cpus)
            elif child.tag == "gpu":
                self.gpu(child, address)
            elif child.tag == "nic":
                nets += self.nic(child, address)
        if klass is not None and klass >> 16 == 0x03 and address not in self.gpus:
            self.gpus.append(address)  # a static file lists GPUs without <gpu>
        if (klass is not None and klass >> 16 == CLASS_NETWORK and not nets
                and not any(c.tag == "pci" for c in elem)):
            self.ib.append(IbDevice(address, address, (
                IbPort(1, None, None, None, None, None, ()),)))

    def gpu(self, elem: ET.Element, address: str) -> None:
        if address not in self.gpus:
            self.gpus.append(address)
        links: list[NvLink] = []
        for link in elem.findall("nvlink"):
            count = _int(link.get("count")) or 0
            target = link.get("target", "")
            try:
                remote = normalize_bdf(target)
            except UsageError:
                remote = target
            to_switch = _int(link.get("tclass"), 16) == CLASS_NVSWITCH
            links += [NvLink(len(links) + k, remote, to_switch) for k in range(count)]
        self.nvml.append(NvmlGpu(index=_int(elem.get("dev")) or len(self.nvml), pci=address,
                                 nvlinks=tuple(links)))

    def nic(self, elem: ET.Element, address: str | None) -> int:
        count = 0
        for net in elem.findall("net"):
            name = net.get("name")
            if not name:
                continue
            count += 1
            speed = _int(net.get("speed"))
            rate = speed / 1000 if speed else None
            if _int(net.get("guid", "0x0"), 16) in (0, None):  # socket transport: a netdev
                self.netdevs.append(NetDev(name, address or "", None, "up",
                                           speed or None, 1, 0))
                continue
            port = _int(net.get("port")) or 1
            self.ib.append(IbDevice(name, address, (IbPort(
                port=port, state="ACTIVE", phys_state=None, rate_gbps=rate,
                rate_text=f"{speed} Mb/s (NCCL)" if speed else None, link_layer=None,
                gids=()),)))
        return count


def nccl_facts(root: ET.Element) -> tuple[SysfsFacts, NvmlReport]:
    """The sysfs facts and the NVLinks an NCCL topology (its ``<system>`` element) holds.

    The NVLink report lists the GPUs that have a ``<gpu>`` element (a dump always does; a
    hand-written static file may not, and then NVLink is unknown for that GPU).
    """
    walk = _Walk()
    for cpu in root.iter("cpu"):
        walk.cpu(cpu)
    facts = SysfsFacts(
        functions=walk.functions,
        gpus=tuple(sorted(walk.gpus, key=pci_sort_key)),
        nvswitches=(),
        ib_devices=tuple(sorted(walk.ib, key=lambda d: d.name)),
        netdevs=tuple(sorted(walk.netdevs, key=lambda n: n.name)),
        numa_nodes=tuple(NumaNode(n, walk.numa[n], ()) for n in sorted(walk.numa)),
        modules=frozenset(),
        modules_known=False,
    )
    return facts, NvmlReport(driver_version=None, gpus=tuple(walk.nvml))


def is_nccl(root_name: str) -> bool:
    """Whether a document element named ``root_name`` is an NCCL topology."""
    return root_name == "system"


def describe(path: Path, root: ET.Element) -> str:
    """How the sysfs source reads for this file."""
    version = root.get("version")
    return f"NCCL topology {path}" + (f" (version {version})" if version else "")
