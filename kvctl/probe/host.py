"""What sysfs says about PCI devices, RDMA ports, netdevs, NUMA nodes, modules and IOMMU.

:func:`scan_sysfs` reads only what ``kvctl topo`` needs, through a
:class:`~kvctl.probe.sysfs.SysfsReader`, so a live host and a recorded tree go through the
same code. It reads ``class`` and ``vendor`` of every PCI function, and details (link,
NUMA, CPUs, IOMMU) only for GPUs, NVSwitches, NIC functions and the bridges above them.

PCI functions sit below a host bridge directory ``pciDDDD:BB``: directly under
``/sys/devices`` on bare metal and most VMs, deeper on Hyper-V (Azure), where every virtual
PCI bus hangs off its VMBus device:
``/sys/devices/LNXSYSTM:00/.../VMBUS:01/<guid>/pci0001:00/0001:00:00.0``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import PurePosixPath

from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable, is_bdf

_log = logging.getLogger("kvctl.probe.host")

NVIDIA_VENDOR = 0x10DE
#: PCI base class of display controllers (GPUs are 0x0300 VGA or 0x0302 3D).
CLASS_DISPLAY = 0x03
#: PCI class 0x0680 "other bridge": what NVSwitches report.
CLASS_OTHER_BRIDGE = 0x0680
#: Kernel modules whose presence topo reports (``/sys/module/<name>``).
WATCHED_MODULES = (
    "nvidia",
    "nvidia_peermem",
    "nv_peer_mem",
    "ib_core",
    "ib_uverbs",
    "mlx5_core",
    "mlx5_ib",
)
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_RATE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*Gb/sec")
#: A host bridge directory: ``pci0000:00``, ``pci10000:e0`` (VMD), ``pci0001:00`` (Hyper-V).
_HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
#: Where host bridges live when nothing says otherwise.
SYS_DEVICES = PurePosixPath("/sys/devices")
_SPEED_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*GT/s")


@dataclasses.dataclass(frozen=True)
class PciLink:
    """PCIe link of one function (``lspci -vv`` LnkSta/LnkCap).

    Attributes:
        current_speed_gts: trained speed in GT/s per lane (``current_link_speed``).
        current_width: trained lanes (``current_link_width``).
        max_speed_gts: capable speed in GT/s (``max_link_speed``).
        max_width: capable lanes (``max_link_width``).
    """

    current_speed_gts: float | None = None
    current_width: int | None = None
    max_speed_gts: float | None = None
    max_width: int | None = None


@dataclasses.dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs shows it.

    Attributes:
        address: ``0000:18:00.0``.
        path: canonical components under ``/sys/devices``, host bridge first:
            ``("pci0000:17", "0000:17:01.0", "0000:18:00.0")``.
        vendor, device, class_code: IDs (``class_code`` is the 24-bit class).
        numa_node: NUMA node, ``None`` when the kernel says ``-1`` (unknown).
        local_cpulist: CPUs close to the device (``local_cpulist``), ``None`` when absent.
        link: this function's PCIe link.
        iommu_group: IOMMU group number, ``None`` when the device has none.
        iommu_type: the group's ``type`` (``DMA``, ``DMA-FQ``, ``identity``), or ``None``.
    """

    address: str
    path: tuple[str, ...]
    vendor: int | None
    device: int | None
    class_code: int | None
    numa_node: int | None = None
    local_cpulist: str | None = None
    link: PciLink = PciLink()
    iommu_group: int | None = None
    iommu_type: str | None = None

    @property
    def host_bridge(self) -> str:
        """The root-complex component (``pci0000:17``)."""
        return self.path[0]

    @property
    def bridges(self) -> tuple[str, ...]:
        """PCI addresses of the bridges above this function, root port first."""
        return self.path[1:-1]

    @property
    def upstream(self) -> str | None:
        """Address of the bridge port directly above (the link partner), or ``None``."""
        return self.path[-2] if len(self.path) > 2 else None


@dataclasses.dataclass(frozen=True)
class GidEntry:
    """One populated GID table entry of an RDMA port.

    Attributes:
        index: GID index (what ``NCCL_IB_GID_INDEX`` / ``MC_GID_INDEX`` take).
        gid: the GID as sysfs spells it.
        type: ``"RoCE v2"``, ``"IB/RoCE v1"``, or ``None`` when not readable.
        netdev: the netdev the GID belongs to (RoCE), or ``None``.
    """

    index: int
    gid: str
    type: str | None
    netdev: str | None


@dataclasses.dataclass(frozen=True)
class IbPort:
    """One port of an RDMA device (``/sys/class/infiniband/<dev>/ports/<n>``).

    Attributes:
        port: port number (1-based).
        state: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``... or ``None`` when unreadable.
        phys_state: ``LinkUp``, ``Disabled``, ``Polling``... or ``None``.
        rate_gbps: link rate in Gb/s (decimal), ``None`` when unknown.
        rate_text: ``rate`` as sysfs spells it (``200 Gb/sec (4X HDR)``).
        link_layer: ``InfiniBand`` or ``Ethernet`` (RoCE).
        gids: populated GID entries.
    """

    port: int
    state: str | None
    phys_state: str | None
    rate_gbps: float | None
    rate_text: str | None
    link_layer: str | None
    gids: tuple[GidEntry, ...]


@dataclasses.dataclass(frozen=True)
class IbDevice:
    """An RDMA device (verbs name, e.g. ``mlx5_0``) and its PCI function."""

    name: str
    pci: str | None
    ports: tuple[IbPort, ...]


@dataclasses.dataclass(frozen=True)
class NetDev:
    """A netdev backed by a PCI function (virtual netdevs are not listed).

    Attributes:
        speed_mbps: ``speed`` in Mb/s; ``None`` when the link is down or unknown.
        arp_type: ``type`` (1 Ethernet, 32 InfiniBand/IPoIB).
        dev_port: port index on its PCI function (0-based), 0 when absent.
    """

    name: str
    pci: str
    mtu: int | None
    operstate: str | None
    speed_mbps: int | None
    arp_type: int | None
    dev_port: int


@dataclasses.dataclass(frozen=True)
class NumaNode:
    """A NUMA node: its CPUs (``cpulist``) and SLIT distances to every node."""

    node: int
    cpulist: str | None
    distances: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SysfsFacts:
    """Everything topo reads from sysfs.

    Attributes:
        functions: PCI functions read in detail, by address (GPUs, NVSwitches, NIC functions
            and every bridge above them).
        gpus: addresses of NVIDIA display-class functions, in PCI order.
        nvswitches: addresses of NVSwitch functions, in PCI order.
        ib_devices: RDMA devices by name order.
        netdevs: netdevs backed by PCI functions, by name order.
        numa_nodes: NUMA nodes, by number.
        modules: which of :data:`WATCHED_MODULES` are loaded.
        unavailable: why PCI enumeration failed (no ``/sys/bus/pci``), else ``None``.
        unplaced_gpus: NVIDIA display functions listed in ``/sys/bus/pci/devices`` whose
            directory is under no host bridge topo can read: ``(address, where it
            resolves)``. Such a GPU still counts; it just has no PCI path.
        modules_known: whether :attr:`modules` was read (``False`` for sources that do not
            record kernel modules, such as an hwloc XML).
    """

    functions: dict[str, PciFunction]
    gpus: tuple[str, ...]
    nvswitches: tuple[str, ...]
    ib_devices: tuple[IbDevice, ...]
    netdevs: tuple[NetDev, ...]
    numa_nodes: tuple[NumaNode, ...]
    modules: frozenset[str]
    unavailable: Unavailable | None = None
    unplaced_gpus: tuple[tuple[str, str], ...] = ()
    modules_known: bool = True


def parse_link_speed(text: str | None) -> float | None:
    """``"16.0 GT/s PCIe"`` → ``16.0``; ``"Unknown"`` or ``None`` → ``None``."""
    if text is None:
        return None
    match = _SPEED_RE.match(text)
    return float(match["num"]) if match else None


def parse_rate(text: str | None) -> float | None:
    """``"200 Gb/sec (4X HDR)"`` → ``200.0``; anything else → ``None``."""
    if text is None:
        return None
    match = _RATE_RE.match(text)
    return float(match["num"]) if match else None


def _strip_code(text: str | None) -> str | None:
    """``"4: ACTIVE"`` → ``"ACTIVE"``; ``"5: LinkUp"`` → ``"LinkUp"``."""
    if text is None:
        return None
    _, sep, rest = text.partition(":")
    return rest.strip() if sep else text.strip()


def pci_path_of(path: PurePosixPath) -> tuple[PurePosixPath, tuple[str, ...]] | None:
    """Where the PCI part of canonical sysfs path ``path`` starts, and its components.

    Returns ``(prefix, components)``: ``components`` run from the host bridge
    (``pci0000:17``) to the deepest PCI function in ``path``, ``prefix`` is the directory
    holding the host bridge (``/sys/devices``, or a Hyper-V VMBus device directory).
    ``None`` when ``path`` is under no host bridge or names no PCI function below it.
    """
    parts = path.parts
    if len(parts) < 4 or parts[1] != "sys" or parts[2] != "devices":
        return None
    start = next((i for i in range(3, len(parts)) if _HOST_BRIDGE_RE.match(parts[i])), None)
    if start is None:
        return None
    comps = parts[start:]
    last = 0
    for i, name in enumerate(comps):
        if i > 0 and is_bdf(name):
            last = i
    if last == 0:
        return None
    return PurePosixPath(*parts[:start]), tuple(comps[: last + 1])


def _pci_of(path: PurePosixPath) -> tuple[str, ...] | None:
    """Components from the host bridge to the deepest PCI function in ``path``."""
    found = pci_path_of(path)
    return found[1] if found is not None else None


class _Scan:
    def __init__(self, reader: SysfsReader) -> None:
        self.r = reader
        #: host bridge component → the directory that holds it (Hyper-V: not /sys/devices)
        self.bases: dict[str, PurePosixPath] = {}
        #: functions in /sys/bus/pci/devices under no readable host bridge → resolved path
        self.unplaced: dict[str, str] = {}

    def place(self, path: PurePosixPath) -> tuple[str, ...] | None:
        """The PCI components of canonical ``path``, remembering where its host bridge is."""
        found = pci_path_of(path)
        if found is None:
            return None
        prefix, comps = found
        self.bases.setdefault(comps[0], prefix)
        return comps

    def device_dir(self, path: tuple[str, ...]) -> PurePosixPath:
        return self.bases.get(path[0], SYS_DEVICES).joinpath(*path)

    def function(self, path: tuple[str, ...], *, detail: bool) -> PciFunction:
        base = self.device_dir(path)
        vendor = self.r.read_int(base / "vendor", base=16)
        device = self.r.read_int(base / "device", base=16) if detail else None
        klass = self.r.read_int(base / "class", base=16)
        if not detail:
            return PciFunction(path[-1], path, vendor, device, klass)
        numa = self.r.read_int(base / "numa_node")
        link = PciLink(
            current_speed_gts=parse_link_speed(self.r.read_optional(base / "current_link_speed")),
            current_width=self.r.read_int(base / "current_link_width"),
            max_speed_gts=parse_link_speed(self.r.read_optional(base / "max_link_speed")),
            max_width=self.r.read_int(base / "max_link_width"),
        )
        group_dir = self.r.link_target(base / "iommu_group")
        group: int | None = None
        group_type: str | None = None
        if group_dir is not None:
            try:
                group = int(group_dir.name)
            except ValueError:
                group = None
            group_type = self.r.read_optional(group_dir / "type")
        return PciFunction(
            address=path[-1],
            path=path,
            vendor=vendor,
            device=device,
            class_code=klass,
            numa_node=numa if numa is not None and numa >= 0 else None,
            local_cpulist=self.r.read_optional(base / "local_cpulist"),
            link=link,
            iommu_group=group,
            iommu_type=group_type,
        )

    def pci_devices(self) -> dict[str, tuple[str, ...]] | None:
        names = self.r.listdir("/sys/bus/pci/devices")
        if names is None:
            return None
        found: dict[str, tuple[str, ...]] = {}
        for name in names:
            target = self.r.resolve(PurePosixPath("/sys/bus/pci/devices") / name)
            path = self.place(target)
            if path is None or path[-1] != name:
                _log.debug("no PCI path for %s: resolves to %s", name, target)
                if is_bdf(name):
                    self.unplaced[name] = str(target)
                continue
            found[name] = path
        return found

    def unplaced_gpus(self) -> list[tuple[str, str]]:
        """NVIDIA display functions among the functions without a PCI path."""
        out: list[tuple[str, str]] = []
        for name, where in sorted(self.unplaced.items(), key=lambda kv: _pci_sort_key(kv[0])):
            base = PurePosixPath("/sys/bus/pci/devices") / name
            vendor = self.r.read_int(base / "vendor", base=16)
            klass = self.r.read_int(base / "class", base=16)
            if vendor == NVIDIA_VENDOR and klass is not None and klass >> 16 == CLASS_DISPLAY:
                out.append((name, where))
        return out

    def ib_devices(self) -> list[tuple[IbDevice, tuple[str, ...] | None]]:
        out: list[tuple[IbDevice, tuple[str, ...] | None]] = []
        for name in self.r.listdir("/sys/class/infiniband") or []:
            base = PurePosixPath("/sys/class/infiniband") / name
            canonical = self.r.resolve(base)
            path = self.place(canonical)
            ports: list[IbPort] = []
            for port_name in self.r.listdir(base / "ports") or []:
                if not (port_name.isascii() and port_name.isdigit()):
                    continue
                ports.append(self.ib_port(base / "ports" / port_name, int(port_name)))
            ports.sort(key=lambda p: p.port)
            out.append((IbDevice(name, path[-1] if path else None, tuple(ports)), path))
        return out

    def ib_port(self, base: PurePosixPath, number: int) -> IbPort:
        rate_text = self.r.read_optional(base / "rate")
        gids: list[GidEntry] = []
        indexes = sorted(int(n) for n in self.r.listdir(base / "gids") or []
                         if n.isascii() and n.isdigit())
        for index in indexes:
            gid = self.r.read_optional(base / "gids" / str(index))
            if gid is None or gid == _ZERO_GID:
                continue
            gid_type = self.r.read_optional(base / "gid_attrs" / "types" / str(index))
            netdev = self.r.read_optional(base / "gid_attrs" / "ndevs" / str(index))
            gids.append(GidEntry(index, gid, gid_type, netdev or None))
        return IbPort(
            port=number,
            state=_strip_code(self.r.read_optional(base / "state")),
            phys_state=_strip_code(self.r.read_optional(base / "phys_state")),
            rate_gbps=parse_rate(rate_text),
            rate_text=rate_text,
            link_layer=self.r.read_optional(base / "link_layer"),
            gids=tuple(gids),
        )

    def netdevs(self) -> list[tuple[NetDev, tuple[str, ...]]]:
        out: list[tuple[NetDev, tuple[str, ...]]] = []
        for name in self.r.listdir("/sys/class/net") or []:
            base = PurePosixPath("/sys/class/net") / name
            target = self.r.link_target(base / "device")
            path = self.place(target) if target is not None else None
            if path is None:
                continue
            speed = self.r.read_int(base / "speed")
            out.append(
                (
                    NetDev(
                        name=name,
                        pci=path[-1],
                        mtu=self.r.read_int(base / "mtu"),
                        operstate=self.r.read_optional(base / "operstate"),
                        speed_mbps=speed if speed is not None and speed > 0 else None,
                        arp_type=self.r.read_int(base / "type"),
                        dev_port=self.r.read_int(base / "dev_port") or 0,
                    ),
                    path,
                )
            )
        return out

    def numa_nodes(self) -> list[NumaNode]:
        nodes: list[NumaNode] = []
        for name in self.r.listdir("/sys/devices/system/node") or []:
            if not (name.startswith("node") and name[4:].isascii() and name[4:].isdigit()):
                continue
            base = PurePosixPath("/sys/devices/system/node") / name
            distance = self.r.read_optional(base / "distance") or ""
            try:
                distances = tuple(int(d) for d in distance.split())
            except ValueError:
                distances = ()
            nodes.append(NumaNode(int(name[4:]), self.r.read_optional(base / "cpulist"), distances))
        nodes.sort(key=lambda n: n.node)
        return nodes

    def modules(self) -> frozenset[str]:
        return frozenset(m for m in WATCHED_MODULES if self.r.is_dir(f"/sys/module/{m}"))


def _pci_sort_key(address: str) -> tuple[int, int, int, int]:
    dom, bus, rest = address.split(":")
    dev, _, fn = rest.partition(".")
    return int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16)


def scan_sysfs(reader: SysfsReader) -> SysfsFacts:
    """Read every sysfs fact topo uses from ``reader``.

    Missing parts (no InfiniBand class, no NUMA directory) are empty results; a tree with no
    ``/sys/bus/pci/devices`` yields facts with :attr:`SysfsFacts.unavailable` set.
    """
    scan = _Scan(reader)
    devices = scan.pci_devices()
    if devices is None:
        return SysfsFacts(
            functions={},
            gpus=(),
            nvswitches=(),
            ib_devices=(),
            netdevs=(),
            numa_nodes=tuple(scan.numa_nodes()),
            modules=scan.modules(),
            unavailable=Unavailable(
                "sysfs",
                f"no sys/bus/pci/devices under {reader.root}",
                "point --sysfs-root at a host root (or a recorded tree) that has /sys",
            ),
        )
    wanted: dict[str, tuple[str, ...]] = {}
    gpus: list[str] = []
    nvswitches: list[str] = []
    for address in sorted(devices, key=_pci_sort_key):
        brief = scan.function(devices[address], detail=False)
        klass = brief.class_code
        if brief.vendor != NVIDIA_VENDOR or klass is None:
            continue
        if klass >> 16 == CLASS_DISPLAY:
            gpus.append(address)
            wanted[address] = devices[address]
        elif klass >> 8 == CLASS_OTHER_BRIDGE:
            nvswitches.append(address)
            wanted[address] = devices[address]
    ib = scan.ib_devices()
    nets = scan.netdevs()
    for _, path in ib:
        if path is not None:
            wanted[path[-1]] = path
    for _, path in nets:
        wanted[path[-1]] = path
    # every bridge above a device of interest, for switch naming and link comparison
    for path in list(wanted.values()):
        for depth in range(2, len(path)):
            wanted.setdefault(path[depth - 1], path[:depth])
    functions = {addr: scan.function(path, detail=True) for addr, path in wanted.items()}
    return SysfsFacts(
        functions=functions,
        gpus=tuple(gpus),
        nvswitches=tuple(nvswitches),
        ib_devices=tuple(sorted((d for d, _ in ib), key=lambda d: d.name)),
        netdevs=tuple(sorted((n for n, _ in nets), key=lambda n: n.name)),
        numa_nodes=tuple(scan.numa_nodes()),
        modules=scan.modules(),
        unplaced_gpus=tuple(scan.unplaced_gpus()),
    )


def pci_sort_key(address: str) -> tuple[int, int, int, int]:
    """Sort key that orders PCI addresses as ``lspci`` and ``nvidia-smi`` do."""
    return _pci_sort_key(address)
