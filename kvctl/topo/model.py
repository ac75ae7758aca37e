"""The topology model: GPUs, NICs, switches, NUMA nodes and where each fact came from."""

from __future__ import annotations

import dataclasses
import enum

from kvctl.probe.host import GidEntry, PciLink


class LinkClass(enum.StrEnum):
    """How far apart two PCI devices are, in ``nvidia-smi topo -m`` terms (best first)."""

    X = "X"
    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"

    @property
    def order(self) -> int:
        """0 for the same device, then 1 (PIX) .. 5 (SYS): lower is closer."""
        return list(LinkClass).index(self)


#: The legend printed under the matrix (wording of ``nvidia-smi topo -m``).
LEGEND: tuple[tuple[str, str], ...] = (
    ("X", "Self"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes "
            "(e.g., QPI/UPI); an unknown NUMA node counts as SYS, except on a host with "
            "a single NUMA node"),
    ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host "
             "Bridges within a NUMA node"),
    ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
    ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host "
            "Bridge)"),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
    ("NV#", "Connection traversing a bonded set of # NVLinks"),
)


class GpuOrigin(enum.StrEnum):
    """Where a GPU was found: placed in the sysfs PCI tree, listed by sysfs without a path
    topo can read, or reported by NVML only (no sysfs function at its address)."""

    SYSFS = "sysfs"
    SYSFS_UNPLACED = "sysfs-unplaced"
    NVML_ONLY = "nvml-only"


class NicKind(enum.StrEnum):
    """An RDMA device (verbs name) or an Ethernet NIC without RDMA (netdev name)."""

    RDMA = "rdma"
    ETHERNET = "ethernet"


class PortState(enum.StrEnum):
    """Whether a port can carry traffic now."""

    ACTIVE = "ACTIVE"
    DOWN = "DOWN"
    UNKNOWN = "UNKNOWN"


@dataclasses.dataclass(frozen=True)
class PciPlace:
    """Where a device sits: its PCI function and the link to its upstream port.

    Attributes:
        pci: address (``0000:18:00.0``).
        path: components under ``/sys/devices`` from the host bridge to the device.
        link: the device's own link (current and max speed/width).
        upstream_pci: the bridge port above, ``None`` for root-complex devices.
        upstream_link: that port's link capabilities.
        iommu_group: IOMMU group number or ``None``.
        iommu_type: ``DMA``, ``DMA-FQ``, ``identity``... or ``None``.
    """

    pci: str
    path: tuple[str, ...]
    link: PciLink
    upstream_pci: str | None = None
    upstream_link: PciLink | None = None
    iommu_group: int | None = None
    iommu_type: str | None = None


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU, numbered ``GPU<index>`` in PCI bus order over every GPU of the host
    (as ``nvidia-smi`` numbers them), and located as ``cuda:<cuda_ordinal>``.

    Attributes:
        cuda_ordinal: the CUDA device ordinal of this GPU in the process that reads the
            topology (torch's ``cuda:N``, Mooncake's ``cuda:N``, kvctl's GPU buffers):
            PCI order among the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible
            (:func:`~kvctl.probe.nvml.cuda_ordinals`); ``None`` when it hides this GPU.
        model: product name (NVML), else a name from the PCI device ID.
        memory_total_bytes: framebuffer in bytes (NVML), ``None`` without NVML.
        numa_node: NUMA node, ``None`` when unknown (kernel ``-1``).
        cpu_affinity: CPUs local to the GPU (``local_cpulist``).
        pcie_gen_current, pcie_gen_max, pcie_width_current, pcie_width_max: from NVML.
        origin: where the GPU was found (:class:`GpuOrigin`).
        nvml_pci: the address NVML reports when it differs from sysfs (Hyper-V guests
            can see a 32-bit PCI domain in NVML), else ``None``.
        nvlinks_active: active NVLinks NVML reports, ``None`` without NVML.
    """

    index: int
    name: str
    place: PciPlace
    model: str
    uuid: str | None
    memory_total_bytes: int | None
    numa_node: int | None
    cpu_affinity: str | None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    origin: GpuOrigin = GpuOrigin.SYSFS
    nvml_pci: str | None = None
    nvlinks_active: int | None = None
    cuda_ordinal: int | None = None

    @property
    def pci(self) -> str:
        """PCI address."""
        return self.place.pci

    @property
    def location(self) -> str | None:
        """The buffer location this GPU serves, ``cuda:<cuda_ordinal>``; ``None`` when
        ``CUDA_VISIBLE_DEVICES`` hides it from this process."""
        return None if self.cuda_ordinal is None else f"cuda:{self.cuda_ordinal}"


@dataclasses.dataclass(frozen=True)
class NicPort:
    """One port of a NIC.

    Attributes:
        state: :class:`PortState` (RDMA: verbs or sysfs port state; Ethernet: operstate).
        raw_state: the state as the source spelled it (``ACTIVE``, ``DOWN``, ``up``...).
        phys_state: ``LinkUp``, ``Disabled``, ``Polling``... (RDMA only).
        rate_gbps: link rate in Gb/s (decimal).
        link_layer: ``InfiniBand`` or ``Ethernet``.
        netdev: the netdev of this port, if any.
        netdev_mtu: its MTU in bytes.
        active_mtu_bytes: RDMA path MTU in use (verbs), bytes.
        lanes: active link width in lanes (verbs).
        gids: populated GIDs.
    """

    port: int
    state: PortState
    raw_state: str | None
    phys_state: str | None
    rate_gbps: float | None
    link_layer: str | None
    netdev: str | None = None
    netdev_mtu: int | None = None
    active_mtu_bytes: int | None = None
    lanes: int | None = None
    gids: tuple[GidEntry, ...] = ()

    @property
    def is_roce(self) -> bool:
        """Whether this is an RDMA port over Ethernet."""
        return self.link_layer == "Ethernet"


@dataclasses.dataclass(frozen=True)
class Nic:
    """A NIC: an RDMA device (``mlx5_0``) or an Ethernet NIC without RDMA (``eth0``).

    A dual-port card shows up as two NICs when each port has its own PCI function (mlx5),
    or as one NIC with two ports when one function serves both (mlx4-style).
    """

    name: str
    kind: NicKind
    place: PciPlace | None
    numa_node: int | None
    cpu_affinity: str | None
    ports: tuple[NicPort, ...]

    @property
    def pci(self) -> str | None:
        """PCI address, ``None`` when the device has no PCI function in sysfs."""
        return self.place.pci if self.place is not None else None

    @property
    def state(self) -> PortState:
        """ACTIVE when any port is, DOWN when every port is known down, else UNKNOWN."""
        states = {p.state for p in self.ports}
        if PortState.ACTIVE in states:
            return PortState.ACTIVE
        if states and states <= {PortState.DOWN}:
            return PortState.DOWN
        return PortState.UNKNOWN

    @property
    def rate_gbps(self) -> float | None:
        """Best rate of the active ports (of any port when none is active), Gb/s."""
        active = [p.rate_gbps for p in self.ports if p.state is PortState.ACTIVE and p.rate_gbps]
        rates = active or [p.rate_gbps for p in self.ports if p.rate_gbps]
        return max(rates) if rates else None

    @property
    def active_ports(self) -> tuple[NicPort, ...]:
        """Ports that are ACTIVE."""
        return tuple(p for p in self.ports if p.state is PortState.ACTIVE)


@dataclasses.dataclass(frozen=True)
class PcieSwitch:
    """A PCIe switch, named by its upstream port, and the devices of interest below it."""

    pci: str
    vendor: int | None
    device: int | None
    host_bridge: str
    level: int
    below: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NvSwitch:
    """An NVSwitch PCI function (NVLink switch of HGX/DGX baseboards)."""

    pci: str
    numa_node: int | None


@dataclasses.dataclass(frozen=True)
class Numa:
    """A NUMA node, its CPUs and its SLIT distances."""

    node: int
    cpulist: str | None
    distances: tuple[int, ...]

    @property
    def location(self) -> str:
        """The buffer location this node serves: ``cpu:<node>``."""
        return f"cpu:{self.node}"


@dataclasses.dataclass(frozen=True)
class SourceStatus:
    """Whether a source answered: ``available`` with a detail, or why not and a fix."""

    name: str
    available: bool
    detail: str
    hint: str | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
    """The host as topo sees it.

    Attributes:
        gpu_nic: ``{gpu name: {nic name: class}}``.
        gpu_gpu: ``{gpu name: {gpu name: class}}``; ``NV#`` when NVML reports NVLinks.
        modules: loaded kernel modules among those topo watches.
        sources: one status per source (sysfs, nvml, verbs).
        modules_known: whether the source recorded kernel modules at all (an hwloc XML or
            NCCL dump does not: then :attr:`modules` is empty and means nothing).
    """

    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    pcie_switches: tuple[PcieSwitch, ...]
    nvswitches: tuple[NvSwitch, ...]
    numa_nodes: tuple[Numa, ...]
    modules: frozenset[str]
    sources: tuple[SourceStatus, ...]
    gpu_nic: dict[str, dict[str, LinkClass]]
    gpu_gpu: dict[str, dict[str, str]]
    modules_known: bool = True

    @property
    def single_numa_node(self) -> int | None:
        """The host's only NUMA node (0 when sysfs lists none), ``None`` with several."""
        if len(self.numa_nodes) > 1:
            return None
        return self.numa_nodes[0].node if self.numa_nodes else 0

    def effective_numa(self, node: int | None) -> int | None:
        """``node``, or the host's only NUMA node when ``node`` is unknown (kernel ``-1``).

        The kernel reports ``-1`` wherever firmware gives no proximity for a device, which
        on a one-socket host can only mean that socket (``nvidia-smi`` prints NODE there).
        With several nodes an unknown node stays unknown.
        """
        return node if node is not None else self.single_numa_node

    def gpu(self, name: str) -> Gpu | None:
        """The GPU called ``name`` (``GPU0``), or ``None``."""
        return next((g for g in self.gpus if g.name == name), None)

    def cuda_gpu(self, ordinal: int) -> Gpu | None:
        """The GPU at CUDA ordinal ``ordinal`` (``cuda:N``) in this process, or ``None``."""
        return next((g for g in self.gpus if g.cuda_ordinal == ordinal), None)

    def nic(self, name: str) -> Nic | None:
        """The NIC called ``name``, or ``None``."""
        return next((n for n in self.nics if n.name == name), None)

    def source(self, name: str) -> SourceStatus | None:
        """Status of source ``name`` (``sysfs``, ``nvml``, ``verbs``), or ``None``."""
        return next((s for s in self.sources if s.name == name), None)
