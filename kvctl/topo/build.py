"""Build a :class:`~kvctl.topo.model.Topology` from its sources.

:func:`discover` takes the sources as arguments (a sysfs reader, an NVML backend, a verbs
backend); the live host is just a reader rooted at ``/`` with the pynvml and pyverbs
backends (:func:`live_sources`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from kvctl.probe.host import (
    IbPort,
    NetDev,
    PciFunction,
    PciLink,
    SysfsFacts,
    pci_sort_key,
    scan_sysfs,
)
from kvctl.probe.nvml import NvmlBackend, NvmlGpu, NvmlReport, cuda_ordinals
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import VerbsBackend, VerbsPort, VerbsReport
from kvctl.topo.classify import classify
from kvctl.topo.model import (
    Gpu,
    GpuOrigin,
    LinkClass,
    Nic,
    NicKind,
    NicPort,
    Numa,
    NvSwitch,
    PcieSwitch,
    PciPlace,
    PortState,
    SourceStatus,
    Topology,
)

_log = logging.getLogger("kvctl.topo")

#: A few PCI device IDs, to name GPUs when NVML is not there (``lspci`` names).
GPU_NAMES = {
    0x102D: "Tesla K80",
    0x20B0: "NVIDIA A100-SXM4-40GB",
    0x20B2: "NVIDIA A100-SXM4-80GB",
    0x20B5: "NVIDIA A100 80GB PCIe",
    0x20F1: "NVIDIA A100-PCIE-40GB",
    0x2204: "NVIDIA GeForce RTX 3090",
    0x2330: "NVIDIA H100 80GB HBM3",
    0x2331: "NVIDIA H100 PCIe",
    0x2335: "NVIDIA H200",
    0x2684: "NVIDIA GeForce RTX 4090",
    0x26B9: "NVIDIA L40S",
    0x27B8: "NVIDIA L4",
}


def discover(
    reader: SysfsReader, nvml: NvmlBackend, verbs: VerbsBackend, *, label: str | None = None,
    cuda_env: Mapping[str, str] | None = None,
) -> Topology:
    """Read every source and build the topology. Missing sources become statuses.

    ``label`` names the sysfs source in its status (default: ``root <reader root>``);
    ``cuda_env`` is the environment whose ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER``
    number the GPUs (``os.environ`` for the live host; ``None``: every GPU, PCI order).
    """
    facts = scan_sysfs(reader)
    nvml_answer = nvml.query()
    verbs_answer = verbs.query()
    return build_topology(facts, nvml_answer, verbs_answer,
                          sysfs_label=label or f"root {reader.root}", cuda_env=cuda_env)


def build_topology(
    facts: SysfsFacts,
    nvml_answer: NvmlReport | Unavailable,
    verbs_answer: VerbsReport | Unavailable,
    *,
    sysfs_label: str = "root /",
    cuda_env: Mapping[str, str] | None = None,
) -> Topology:
    """Combine sysfs facts with NVML and verbs answers; GPUs get the CUDA ordinals they
    have under ``cuda_env`` (``None``: every GPU visible, PCI order)."""
    reported = () if isinstance(nvml_answer, Unavailable) else nvml_answer.gpus
    sysfs_gpus = [*facts.gpus, *(addr for addr, _ in facts.unplaced_gpus)]
    nvml_gpus, to_sysfs = match_nvml(sysfs_gpus, reported)
    verbs_ports: dict[tuple[str, int], VerbsPort] = {}
    verbs_names: list[str] = []
    if isinstance(verbs_answer, VerbsReport):
        for dev in verbs_answer.devices:
            verbs_names.append(dev.name)
            for vport in dev.ports:
                verbs_ports[dev.name, vport.port] = vport

    gpus = with_cuda_ordinals(_gpus(facts, nvml_gpus, to_sysfs), cuda_env or {})
    nics = _nics(facts, verbs_ports, verbs_names)
    numa = tuple(Numa(n.node, n.cpulist, n.distances) for n in facts.numa_nodes)
    only = numa[0].node if len(numa) == 1 else (0 if not numa else None)

    def node(value: int | None) -> int | None:  # unknown on a one-node host: that node
        return value if value is not None else only

    gpu_nic = {
        g.name: {
            n.name: classify(
                g.place.path or None,
                n.place.path if n.place is not None and n.place.path else None,
                node(g.numa_node),
                node(n.numa_node),
            )
            for n in nics
        }
        for g in gpus
    }
    gpu_gpu = _gpu_matrix(gpus, nvml_gpus, to_sysfs, set(facts.nvswitches), node)
    sources = (
        _sysfs_status(facts, sysfs_label),
        _nvml_status(nvml_answer),
        _verbs_status(verbs_answer),
    )
    return Topology(
        gpus=gpus,
        nics=nics,
        pcie_switches=_switches(
            facts,
            [g.place for g in gpus]
            + [n.place for n in nics if n.place is not None]
            + [_place(facts, facts.functions[pci]) for pci in facts.nvswitches],
        ),
        nvswitches=tuple(
            NvSwitch(pci, facts.functions[pci].numa_node) for pci in facts.nvswitches
        ),
        numa_nodes=numa,
        modules=facts.modules,
        sources=sources,
        gpu_nic=gpu_nic,
        gpu_gpu=gpu_gpu,
        modules_known=facts.modules_known,
    )


def _bdf_parts(address: str) -> tuple[int, int, int, int] | None:
    try:
        return pci_sort_key(address)
    except ValueError:
        return None


def match_nvml(
    sysfs_gpus: Sequence[str], reported: Sequence[NvmlGpu]
) -> tuple[dict[str, NvmlGpu], dict[str, str]]:
    """Pair NVML's GPUs with sysfs GPUs: ``({sysfs address: NVML GPU}, {NVML address:
    sysfs address})``. NVML GPUs that match nothing keep their own address.

    The address NVML reports is tried as is, then with its PCI domain cut to the low 16
    bits (Hyper-V guests: NVML may carry a 32-bit domain where sysfs has 16 bits), then by
    bus, device and function alone when exactly one sysfs GPU has them.
    """
    left = list(sysfs_gpus)
    by_sysfs: dict[str, NvmlGpu] = {}
    to_sysfs: dict[str, str] = {}
    pending: list[NvmlGpu] = []
    for gpu in reported:  # exact matches first, so a loose match never steals one
        if gpu.pci in left:
            left.remove(gpu.pci)
            by_sysfs[gpu.pci] = gpu
            to_sysfs[gpu.pci] = gpu.pci
        else:
            pending.append(gpu)
    for gpu in pending:
        want = _bdf_parts(gpu.pci)
        match: str | None = None
        if want is not None:
            low = [a for a in left if (p := _bdf_parts(a)) is not None
                   and p == (want[0] & 0xFFFF, *want[1:])]
            same_bdf = [a for a in left if (p := _bdf_parts(a)) is not None
                        and p[1:] == want[1:]]
            match = low[0] if len(low) == 1 else (same_bdf[0] if len(same_bdf) == 1 else None)
        if match is None:
            by_sysfs[gpu.pci] = gpu
            to_sysfs[gpu.pci] = gpu.pci
            continue
        _log.info("NVML GPU %s is sysfs GPU %s (PCI domain differs)", gpu.pci, match)
        left.remove(match)
        by_sysfs[match] = gpu
        to_sysfs[gpu.pci] = match
    return by_sysfs, to_sysfs


def _place(facts: SysfsFacts, fn: PciFunction) -> PciPlace:
    upstream = fn.upstream
    up_fn = facts.functions.get(upstream) if upstream is not None else None
    return PciPlace(
        pci=fn.address,
        path=fn.path,
        link=fn.link,
        upstream_pci=upstream,
        upstream_link=up_fn.link if up_fn is not None else None,
        iommu_group=fn.iommu_group,
        iommu_type=fn.iommu_type,
    )


def _gpus(
    facts: SysfsFacts, nvml_gpus: dict[str, NvmlGpu], to_sysfs: dict[str, str]
) -> tuple[Gpu, ...]:
    unplaced = {addr for addr, _ in facts.unplaced_gpus}
    addresses = [*facts.gpus, *sorted(unplaced)]
    addresses += [pci for pci in nvml_gpus if pci not in facts.functions and
                  pci not in unplaced]
    addresses.sort(key=lambda a: _bdf_parts(a) or (1 << 32, 0, 0, 0))
    gpus: list[Gpu] = []
    for index, pci in enumerate(addresses):
        fn = facts.functions.get(pci)
        info = nvml_gpus.get(pci)
        place = _place(facts, fn) if fn is not None else PciPlace(pci, (), PciLink())
        origin = (GpuOrigin.SYSFS if fn is not None else
                  GpuOrigin.SYSFS_UNPLACED if pci in unplaced else GpuOrigin.NVML_ONLY)
        nvml_pci = info.pci if info is not None and to_sysfs.get(info.pci) != info.pci else None
        fallback = GPU_NAMES.get(fn.device or 0) if fn is not None else None
        if fallback is None and fn is not None and fn.device is not None:
            fallback = f"NVIDIA GPU [10de:{fn.device:04x}]"
        gpus.append(
            Gpu(
                index=index,
                name=f"GPU{index}",
                place=place,
                model=(info.name if info and info.name else None) or fallback or "NVIDIA GPU",
                uuid=info.uuid if info else None,
                memory_total_bytes=info.memory_total_bytes if info else None,
                numa_node=fn.numa_node if fn is not None else None,
                cpu_affinity=fn.local_cpulist if fn is not None else None,
                pcie_gen_current=info.pcie_gen_current if info else None,
                pcie_gen_max=info.pcie_gen_max if info else None,
                pcie_width_current=info.pcie_width_current if info else None,
                pcie_width_max=info.pcie_width_max if info else None,
                origin=origin,
                nvml_pci=nvml_pci,
                nvlinks_active=len(info.nvlinks) if info else None,
            )
        )
    return tuple(gpus)


def with_cuda_ordinals(gpus: tuple[Gpu, ...], environ: Mapping[str, str]) -> tuple[Gpu, ...]:
    """``gpus`` with the CUDA ordinal each has under ``environ`` (notes logged)."""
    ordinals = cuda_ordinals(
        [NvmlGpu(g.index, g.pci, g.model, g.uuid) for g in gpus], environ)
    for note in ordinals.notes:
        _log.warning("CUDA ordinals: %s", note)
    return tuple(dataclasses.replace(g, cuda_ordinal=ordinals.ordinal_of(g.pci)) for g in gpus)


def _rdma_state(raw: str | None) -> PortState:
    if raw is None:
        return PortState.UNKNOWN
    return PortState.ACTIVE if raw.upper() in ("ACTIVE", "ACTIVE_DEFER") else PortState.DOWN


def _eth_state(operstate: str | None) -> PortState:
    if operstate == "up":
        return PortState.ACTIVE
    if operstate in ("down", "lowerlayerdown", "notpresent", "dormant"):
        return PortState.DOWN
    return PortState.UNKNOWN


def _rdma_port(port: IbPort, vport: VerbsPort | None, netdevs: list[NetDev]) -> NicPort:
    same_port = [n for n in netdevs if n.dev_port == port.port - 1]
    netdev = same_port[0] if same_port else None
    if netdev is None:
        gid_dev = next((g.netdev for g in port.gids if g.netdev), None)
        netdev = next((n for n in netdevs if n.name == gid_dev), None)
    raw_state = vport.state if vport is not None else port.state
    return NicPort(
        port=port.port,
        state=_rdma_state(raw_state),
        raw_state=raw_state,
        phys_state=port.phys_state,
        rate_gbps=(vport.rate_gbps if vport is not None and vport.rate_gbps else None)
        or port.rate_gbps,
        link_layer=(vport.link_layer if vport is not None else None) or port.link_layer,
        netdev=netdev.name if netdev is not None else None,
        netdev_mtu=netdev.mtu if netdev is not None else None,
        active_mtu_bytes=vport.active_mtu_bytes if vport is not None else None,
        lanes=vport.lanes if vport is not None else None,
        gids=port.gids,
    )


def _nics(
    facts: SysfsFacts, verbs_ports: dict[tuple[str, int], VerbsPort], verbs_names: list[str]
) -> tuple[Nic, ...]:
    by_pci: dict[str, list[NetDev]] = defaultdict(list)
    for netdev in facts.netdevs:
        by_pci[netdev.pci].append(netdev)
    nics: list[Nic] = []
    rdma_pcis: set[str] = set()
    for dev in facts.ib_devices:
        fn = facts.functions.get(dev.pci) if dev.pci else None
        if dev.pci:
            rdma_pcis.add(dev.pci)
        netdevs = by_pci.get(dev.pci, []) if dev.pci else []
        ports = tuple(
            _rdma_port(p, verbs_ports.get((dev.name, p.port)), netdevs) for p in dev.ports
        )
        nics.append(
            Nic(
                name=dev.name,
                kind=NicKind.RDMA,
                place=_place(facts, fn) if fn is not None else None,
                numa_node=fn.numa_node if fn is not None else None,
                cpu_affinity=fn.local_cpulist if fn is not None else None,
                ports=ports,
            )
        )
    known = {d.name for d in facts.ib_devices}
    for name in verbs_names:  # verbs sees a device sysfs does not (no sysfs under the root)
        if name in known:
            continue
        ports = tuple(
            NicPort(p.port, _rdma_state(p.state), p.state, None, p.rate_gbps, p.link_layer,
                    active_mtu_bytes=p.active_mtu_bytes, lanes=p.lanes)
            for (dev_name, _), p in sorted(verbs_ports.items()) if dev_name == name
        )
        nics.append(Nic(name, NicKind.RDMA, None, None, None, ports))
    for netdev in facts.netdevs:
        if netdev.pci in rdma_pcis or netdev.arp_type not in (1, None):
            continue
        fn = facts.functions.get(netdev.pci)
        port = NicPort(
            port=netdev.dev_port + 1,
            state=_eth_state(netdev.operstate),
            raw_state=netdev.operstate,
            phys_state=None,
            rate_gbps=netdev.speed_mbps / 1000 if netdev.speed_mbps else None,
            link_layer="Ethernet",
            netdev=netdev.name,
            netdev_mtu=netdev.mtu,
        )
        nics.append(
            Nic(
                name=netdev.name,
                kind=NicKind.ETHERNET,
                place=_place(facts, fn) if fn is not None else None,
                numa_node=fn.numa_node if fn is not None else None,
                cpu_affinity=fn.local_cpulist if fn is not None else None,
                ports=(port,),
            )
        )
    return tuple(nics)


def _gpu_matrix(
    gpus: tuple[Gpu, ...],
    nvml_gpus: dict[str, NvmlGpu],
    to_sysfs: dict[str, str],
    nvswitches: set[str],
    node: Callable[[int | None], int | None],
) -> dict[str, dict[str, str]]:
    """GPU x GPU cells. NVLink wins over the PCIe path, as in ``nvidia-smi topo -m``: ``NV#``
    with # the links between the pair, or through NVSwitches the links each GPU has to
    the switches (the smaller of the two)."""
    matrix: dict[str, dict[str, str]] = {}
    for a in gpus:
        row: dict[str, str] = {}
        links_a = nvml_gpus[a.pci].nvlinks if a.pci in nvml_gpus else ()
        to_switch_a = sum(1 for link in links_a if link.remote_is_switch or
                          link.remote_pci in nvswitches)
        for b in gpus:
            if a is b:
                row[b.name] = LinkClass.X.value
                continue
            direct = sum(1 for link in links_a if not link.remote_is_switch and
                         to_sysfs.get(link.remote_pci, link.remote_pci) == b.pci)
            links_b = nvml_gpus[b.pci].nvlinks if b.pci in nvml_gpus else ()
            to_switch_b = sum(1 for link in links_b if link.remote_is_switch or
                              link.remote_pci in nvswitches)
            if direct:
                row[b.name] = f"NV{direct}"
            elif to_switch_a and to_switch_b:
                row[b.name] = f"NV{min(to_switch_a, to_switch_b)}"
            else:
                row[b.name] = classify(
                    a.place.path or None, b.place.path or None, node(a.numa_node),
                    node(b.numa_node)
                ).value
        matrix[a.name] = row
    return matrix


def _switches(facts: SysfsFacts, places: list[PciPlace]) -> tuple[PcieSwitch, ...]:
    below: dict[str, list[str]] = defaultdict(list)
    level: dict[str, int] = {}
    host: dict[str, str] = {}
    for place in places:
        chain = place.path[1:]
        for i in range(1, len(chain) - 1, 2):
            usp = chain[i]
            below[usp].append(place.pci)
            level[usp] = (i + 1) // 2
            host[usp] = place.path[0]
    out = []
    for usp in sorted(below, key=pci_sort_key):
        fn = facts.functions.get(usp)
        out.append(
            PcieSwitch(
                pci=usp,
                vendor=fn.vendor if fn else None,
                device=fn.device if fn else None,
                host_bridge=host[usp],
                level=level[usp],
                below=tuple(sorted(set(below[usp]), key=pci_sort_key)),
            )
        )
    return tuple(out)


def _sysfs_status(facts: SysfsFacts, label: str) -> SourceStatus:
    if facts.unavailable is not None:
        return SourceStatus("sysfs", False, facts.unavailable.reason, facts.unavailable.hint)
    return SourceStatus(
        "sysfs",
        True,
        f"{label}: {len(facts.gpus) + len(facts.unplaced_gpus)} GPU(s), "
        f"{len(facts.ib_devices)} RDMA device(s), "
        f"{len(facts.netdevs)} PCI netdev(s), {len(facts.numa_nodes)} NUMA node(s)",
    )


def _nvml_status(answer: NvmlReport | Unavailable) -> SourceStatus:
    if isinstance(answer, Unavailable):
        return SourceStatus("nvml", False, answer.reason, answer.hint)
    driver = f"driver {answer.driver_version}, " if answer.driver_version else ""
    return SourceStatus("nvml", True, f"{driver}{len(answer.gpus)} GPU(s)")


def _verbs_status(answer: VerbsReport | Unavailable) -> SourceStatus:
    if isinstance(answer, Unavailable):
        return SourceStatus("verbs", False, answer.reason, answer.hint)
    return SourceStatus("verbs", True, f"{len(answer.devices)} RDMA device(s)")
