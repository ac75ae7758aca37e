"""``kvctl topo doctor``: findings about the host's GPU/NIC wiring and settings.

Every check is a function ``(topology) -> list[Finding]`` in :data:`CHECKS`; a finding has
a severity, the device it is about, what is wrong and how to fix it. The command exits 1
when any finding is an error.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from kvctl.topo.model import (
    Gpu,
    GpuOrigin,
    LinkClass,
    Nic,
    NicKind,
    PciPlace,
    PortState,
    Topology,
)
from kvctl.topo.rank import rank_nics

#: Bytes of RoCE headers between the netdev MTU and the RDMA MTU (GRH, BTH, XRC and
#: AtomicETH extensions, ICRC), as the kernel's ``iboe_get_mtu`` subtracts them.
ROCE_OVERHEAD_BYTES = 88
IB_MTUS = (256, 512, 1024, 2048, 4096)
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")


class Severity(enum.StrEnum):
    """How bad a finding is; only errors make the doctor exit 1."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One doctor finding.

    Attributes:
        check: the check's id (``rdma-port-state``, ``pcie-link``...).
        severity: error, warning or info.
        subject: the device (``mlx5_0``, ``GPU3``) or ``host``.
        message: what is wrong.
        hint: how to fix it.
    """

    check: str
    severity: Severity
    subject: str
    message: str
    hint: str


def check_sources(topology: Topology) -> list[Finding]:
    """A source that did not answer is an info finding (topo works with what is left)."""
    return [
        Finding("source", Severity.INFO, s.name, f"{s.name} unavailable: {s.detail}",
                s.hint or "nothing to do if this host has no such hardware")
        for s in topology.sources if not s.available
    ]


def check_rdma_ports(topology: Topology) -> list[Finding]:
    """RDMA ports that are not ACTIVE / LinkUp."""
    out: list[Finding] = []
    for nic in topology.nics:
        if nic.kind is not NicKind.RDMA:
            continue
        for port in nic.ports:
            phys_ok = port.phys_state in (None, "LinkUp")
            if port.state is PortState.ACTIVE and phys_ok:
                continue
            state = port.raw_state or "unknown"
            phys = f", physical state {port.phys_state}" if port.phys_state else ""
            severity = Severity.WARNING if port.state is PortState.UNKNOWN else Severity.ERROR
            netdev = f" (netdev {port.netdev})" if port.netdev else ""
            out.append(Finding(
                "rdma-port-state", severity, nic.name,
                f"port {port.port}{netdev} is {state}{phys}, not ACTIVE/LinkUp",
                f"check cable and switch port (ibstat {nic.name}); for RoCE bring the netdev "
                "up (ip link set DEV up); a port that stays INIT on InfiniBand needs a subnet "
                "manager",
            ))
    return out


def _degraded(subject: str, place: PciPlace, *, speed_severity: Severity | None
              ) -> list[Finding]:
    """Width below what both ends can do; speed too unless ``speed_severity`` is ``None``."""
    link, up = place.link, place.upstream_link
    out: list[Finding] = []
    exp_width = link.max_width
    if exp_width is not None and up is not None and up.max_width:
        exp_width = min(exp_width, up.max_width)
    exp_speed = link.max_speed_gts
    if exp_speed is not None and up is not None and up.max_speed_gts:
        exp_speed = min(exp_speed, up.max_speed_gts)
    where = f" (upstream port {place.upstream_pci})" if place.upstream_pci else ""
    if link.current_width and exp_width and link.current_width < exp_width:
        out.append(Finding(
            "pcie-link", Severity.ERROR, subject,
            f"PCIe link {place.pci} trained at x{link.current_width}, both ends can do "
            f"x{exp_width}{where}",
            "reseat the card or riser, check the slot's lane wiring in the BIOS "
            "(bifurcation), then check lspci -vv LnkSta",
        ))
    if (speed_severity is not None and link.current_speed_gts and exp_speed
            and link.current_speed_gts < exp_speed):
        out.append(Finding(
            "pcie-link", speed_severity, subject,
            f"PCIe link {place.pci} runs at {link.current_speed_gts:g} GT/s, both ends can "
            f"do {exp_speed:g} GT/s{where}",
            "check BIOS PCIe speed settings and the riser/retimer; compare lspci -vv "
            "LnkSta with LnkCap",
        ))
    return out


def check_pcie_links(topology: Topology) -> list[Finding]:
    """Links trained below what the device and its upstream port can both do.

    Width is checked everywhere: lanes lost to a bad seat, riser or bifurcation setting stay
    lost. Speed is checked for NICs only: an idle GPU lowers its link speed to save power
    (2.5 GT/s at P8 is normal) and raises it under load, so a GPU's speed at rest says
    nothing.
    """
    out: list[Finding] = []
    for gpu in topology.gpus:
        out += _degraded(gpu.name, gpu.place, speed_severity=None)
    for nic in topology.nics:
        if nic.place is not None:
            out += _degraded(nic.name, nic.place, speed_severity=Severity.ERROR)
    return out


def check_gpu_nic_distance(topology: Topology) -> list[Finding]:
    """GPUs whose best ACTIVE NIC is across the host (NODE) or another socket (SYS)."""
    out: list[Finding] = []
    if not topology.nics:
        return out
    kind = NicKind.RDMA if any(n.kind is NicKind.RDMA for n in topology.nics) else None
    for gpu in topology.gpus:
        ranked = [r for r in rank_nics(topology, gpu, kind=kind)
                  if r.state is PortState.ACTIVE]
        if not ranked:
            out.append(Finding(
                "gpu-nic-distance", Severity.WARNING, gpu.name, "no ACTIVE NIC for this GPU",
                "bring a NIC port up (see rdma-port-state findings)",
            ))
            continue
        best = ranked[0]
        if best.link_class in (LinkClass.NODE, LinkClass.SYS):
            # SYS on a one-node host only means a device without a PCI path: no socket
            # interconnect to cross, so no error about one
            crosses = (best.link_class is LinkClass.SYS
                       and topology.single_numa_node is None)
            severity = Severity.ERROR if crosses else Severity.WARNING
            out.append(Finding(
                "gpu-nic-distance", severity, gpu.name,
                f"closest ACTIVE NIC {best.name} is {best.link_class.value}: GPUDirect "
                "traffic crosses the CPU" + (" and the socket interconnect" if crosses else
                                             " (no PCI path known for one of them)"
                                             if best.link_class is LinkClass.SYS else ""),
                "put a NIC on the GPU's PCIe switch or NUMA node, or run this GPU's "
                "transfers through host memory on its NUMA node",
            ))
    return out


def check_roce_gids(topology: Topology) -> list[Finding]:
    """RoCE ports without a RoCE v2 GID (no IP address on the netdev, or v1 only)."""
    out: list[Finding] = []
    for nic in topology.nics:
        if nic.kind is not NicKind.RDMA:
            continue
        for port in nic.ports:
            if not port.is_roce or any(g.type == "RoCE v2" for g in port.gids):
                continue
            dev = port.netdev or "its netdev"
            out.append(Finding(
                "roce-gid", Severity.ERROR, nic.name,
                f"RoCE port {port.port} has no RoCE v2 GID "
                f"({len(port.gids)} GID(s) populated)",
                f"give {dev} an IP address (RoCE v2 GIDs come from it) and check "
                "show_gids; NCCL_IB_GID_INDEX/MC_GID_INDEX must name a RoCE v2 entry",
            ))
    return out


def _rdma_mtu_for(netdev_mtu: int) -> int | None:
    fitting = [m for m in IB_MTUS if m <= netdev_mtu - ROCE_OVERHEAD_BYTES]
    return fitting[-1] if fitting else None


def check_mtu(topology: Topology) -> list[Finding]:
    """RoCE netdev MTU too small for the RDMA MTU (in use, or the 4096 maximum)."""
    out: list[Finding] = []
    for nic in topology.nics:
        if nic.kind is not NicKind.RDMA:
            continue
        for port in nic.ports:
            if not port.is_roce or port.netdev_mtu is None:
                continue
            need = (port.active_mtu_bytes or 0) + ROCE_OVERHEAD_BYTES
            fits = _rdma_mtu_for(port.netdev_mtu)
            if port.active_mtu_bytes and port.netdev_mtu < need:
                out.append(Finding(
                    "mtu", Severity.ERROR, nic.name,
                    f"netdev {port.netdev} MTU {port.netdev_mtu} is below what RDMA MTU "
                    f"{port.active_mtu_bytes} needs ({need} bytes)",
                    f"ip link set {port.netdev} mtu 9000 (and on the switch ports)",
                ))
            elif fits is None or fits < IB_MTUS[-1]:
                out.append(Finding(
                    "mtu", Severity.WARNING, nic.name,
                    f"netdev {port.netdev} MTU {port.netdev_mtu} limits the RDMA MTU to "
                    f"{fits or 0} bytes (4096 needs {IB_MTUS[-1] + ROCE_OVERHEAD_BYTES}+)",
                    f"ip link set {port.netdev} mtu 9000 on every host and switch port",
                ))
    return out


def check_peermem(topology: Topology) -> list[Finding]:
    """GPUs and RDMA NICs both present, but no GPUDirect peer-memory module loaded."""
    has_rdma = any(n.kind is NicKind.RDMA for n in topology.nics)
    if not topology.gpus or not has_rdma or not topology.modules_known:
        return []
    if topology.modules & set(PEERMEM_MODULES):
        return []
    return [Finding(
        "peermem", Severity.WARNING, "host",
        "neither nvidia_peermem nor nv_peer_mem is loaded: GPUDirect RDMA through "
        "peer memory is off",
        "modprobe nvidia_peermem (persist it in /etc/modules-load.d), or make sure the "
        "stack uses DMA-BUF (open kernel driver, kernel 5.12+)",
    )]


def check_iommu(topology: Topology) -> list[Finding]:
    """GPU/NIC IOMMU groups in DMA translation mode (P2P and RDMA go through the IOMMU)."""
    out: list[Finding] = []
    devices: list[tuple[str, PciPlace]] = [(g.name, g.place) for g in topology.gpus]
    devices += [(n.name, n.place) for n in topology.nics if n.place is not None]
    for name, place in devices:
        if place.iommu_type in ("DMA", "DMA-FQ"):
            out.append(Finding(
                "iommu", Severity.WARNING, name,
                f"IOMMU group {place.iommu_group} of {place.pci} translates DMA "
                f"(type {place.iommu_type}): GPUDirect P2P/RDMA pays for IOMMU lookups or "
                "fails",
                "boot with iommu=pt (e.g. intel_iommu=on iommu=pt) or write identity to "
                f"/sys/kernel/iommu_groups/{place.iommu_group}/type with the device unbound",
            ))
    return out


def check_numa(topology: Topology) -> list[Finding]:
    """GPUs and NICs whose NUMA node is unknown (kernel ``-1``)."""
    out: list[Finding] = []
    only = topology.single_numa_node
    devices: list[Gpu | Nic] = [*topology.gpus, *topology.nics]
    for dev in devices:
        if dev.numa_node is not None:
            continue
        if isinstance(dev, Nic) and dev.place is None:
            continue
        if isinstance(dev, Gpu) and dev.origin is not GpuOrigin.SYSFS:
            continue  # gpu-discovery says why this GPU has no sysfs facts
        out.append(Finding(
            "numa", Severity.WARNING if only is None else Severity.INFO, dev.name,
            "NUMA node unknown (numa_node is -1): ranking treats it as SYS to everything "
            "on another node" if only is None else
            f"NUMA node unknown (numa_node is -1); harmless with a single NUMA node: "
            f"counted as node {only}",
            "enable NUMA/SRAT in the BIOS (VMs: give the guest a NUMA topology with "
            "PCIe expander bridges per node)",
        ))
    return out


def check_gpu_discovery(topology: Topology) -> list[Finding]:
    """GPUs that sysfs lists but topo cannot place, GPUs only NVML sees, and a loaded NVIDIA
    driver with no GPU at all: never an empty or SYS-only matrix without a word."""
    out: list[Finding] = []
    for gpu in topology.gpus:
        if gpu.origin is GpuOrigin.SYSFS_UNPLACED:
            out.append(Finding(
                "gpu-discovery", Severity.WARNING, gpu.name,
                f"GPU {gpu.pci} is in /sys/bus/pci/devices but its directory is under no PCI "
                "host bridge topo can read: its cells are SYS",
                "send the output of readlink -f /sys/bus/pci/devices/" + gpu.pci
                + " with a kvctl topo snapshot to the kvctl maintainers",
            ))
        elif gpu.origin is GpuOrigin.NVML_ONLY:
            out.append(Finding(
                "gpu-discovery", Severity.WARNING, gpu.name,
                f"NVML reports GPU {gpu.pci} ({gpu.model}) but sysfs has no NVIDIA GPU that "
                "matches its address: its cells are SYS",
                "compare nvidia-smi --query-gpu=pci.bus_id --format=csv with "
                "ls /sys/bus/pci/devices; in a container, mount the host's /sys",
            ))
        elif gpu.nvml_pci is not None:
            out.append(Finding(
                "gpu-discovery", Severity.INFO, gpu.name,
                f"NVML names this GPU {gpu.nvml_pci}, sysfs {gpu.pci}: matched on "
                "bus/device/function (PCI domains differ, as in Hyper-V guests)",
                "nothing to do; use the sysfs address with lspci",
            ))
    nvml = topology.source("nvml")
    if not topology.gpus and topology.modules_known and "nvidia" in topology.modules:
        detail = f" (NVML: {nvml.detail})" if nvml is not None else ""
        out.append(Finding(
            "gpu-discovery", Severity.WARNING, "host",
            "the nvidia kernel module is loaded but no NVIDIA GPU was found in sysfs"
            + detail,
            "check lspci -d 10de: and nvidia-smi; in a container or chroot, point "
            "--sysfs-root at the host's root",
        ))
    return out


def check_nvlink(topology: Topology) -> list[Finding]:
    """NVSwitch hosts: NVLink unknown without NVML, or a GPU whose NVLinks are all down."""
    if not topology.nvswitches or not topology.gpus:
        return []
    nvml = topology.source("nvml")
    if nvml is None or not nvml.available:
        return [Finding(
            "nvlink", Severity.WARNING, "host",
            f"{len(topology.nvswitches)} NVSwitch(es) but NVML is unavailable: GPU x GPU "
            "cells show the PCIe path, where nvidia-smi topo -m prints NV# (NVLink)",
            "run topo where NVML works (driver loaded, pip install nvidia-ml-py), or read "
            "a snapshot recorded there (kvctl topo snapshot records NVML's answer)",
        )]
    return [Finding(
        "nvlink", Severity.WARNING, gpu.name,
        "no active NVLink although the host has NVSwitches: GPU peer traffic falls back "
        "to PCIe",
        "check nvidia-smi nvlink -s and that nvidia-fabricmanager is running "
        "(systemctl status nvidia-fabricmanager)",
    ) for gpu in topology.gpus if gpu.nvlinks_active == 0]


CHECKS: tuple[Callable[[Topology], list[Finding]], ...] = (
    check_sources,
    check_gpu_discovery,
    check_nvlink,
    check_rdma_ports,
    check_pcie_links,
    check_gpu_nic_distance,
    check_roce_gids,
    check_mtu,
    check_peermem,
    check_iommu,
    check_numa,
)

_ORDER = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}


def run_doctor(topology: Topology) -> list[Finding]:
    """Run every check; findings sorted errors first."""
    findings = [f for check in CHECKS for f in check(topology)]
    return sorted(findings, key=lambda f: _ORDER[f.severity])


def has_errors(findings: list[Finding]) -> bool:
    """Whether any finding is an error (the doctor then exits 1)."""
    return any(f.severity is Severity.ERROR for f in findings)
