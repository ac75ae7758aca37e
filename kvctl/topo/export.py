"""Topology in the forms other tools take: JSON, Mooncake's custom topology, env variables.

- :func:`topology_payload`: the ``--json`` document (schema in ``docs/topo.md``).
- :func:`mooncake_topology`: Mooncake's ``MC_CUSTOM_TOPO_JSON`` format,
  ``{"cuda:0": [[preferred HCAs], [available HCAs]], "cpu:0": [...]}``; RDMA devices only,
  ports known to be down left out.
- :func:`env_lines`: ready-to-paste ``NCCL_IB_HCA``, ``UCX_NET_DEVICES``,
  ``MOONCAKE_DEVICE`` and ``MC_GID_INDEX`` per GPU and per NUMA node.

GPUs are named ``cuda:N`` by their CUDA ordinal (:attr:`~kvctl.topo.model.Gpu.cuda_ordinal`),
as Mooncake's own discovery (``cudaGetDeviceCount``/``cudaDeviceGetPCIBusId``) and torch
number them in a process with the same ``CUDA_VISIBLE_DEVICES``; GPUs hidden by it are
left out of the Mooncake and env exports.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from kvctl.errors import UnavailableError
from kvctl.probe.host import GidEntry
from kvctl.topo.model import Nic, NicKind, PortState, Topology
from kvctl.topo.rank import best_nics, nic_ports, preferred_nics, rank_nics


def locations(topology: Topology) -> list[str]:
    """Every buffer location of the host: ``cuda:N`` for each GPU this process's CUDA sees
    (CUDA ordinals, as Mooncake and torch number them), ``cpu:N`` per NUMA node."""
    cpus = [n.location for n in topology.numa_nodes] or ["cpu:0"]
    return [g.location for g in topology.gpus if g.location is not None] + cpus


def _nic_dict(nic: Nic) -> dict[str, Any]:
    return {
        "name": nic.name,
        "kind": nic.kind.value,
        "pci": nic.pci,
        "numa": nic.numa_node,
        "cpu_affinity": nic.cpu_affinity,
        "state": nic.state.value,
        "rate_gbits_per_s": nic.rate_gbps,
        "pcie": dataclasses.asdict(nic.place.link) if nic.place else None,
        "iommu_group": nic.place.iommu_group if nic.place else None,
        "ports": [
            {
                "port": p.port,
                "state": p.state.value,
                "raw_state": p.raw_state,
                "phys_state": p.phys_state,
                "rate_gbits_per_s": p.rate_gbps,
                "link_layer": p.link_layer,
                "netdev": p.netdev,
                "netdev_mtu": p.netdev_mtu,
                "active_mtu_bytes": p.active_mtu_bytes,
                "lanes": p.lanes,
                "gids": [dataclasses.asdict(g) for g in p.gids],
            }
            for p in nic.ports
        ],
    }


def topology_payload(topology: Topology) -> dict[str, Any]:
    """The ``kvctl topo --json`` payload (without the envelope)."""
    gpus = [
        {
            "name": g.name,
            "index": g.index,
            "location": g.location,
            "cuda_ordinal": g.cuda_ordinal,
            "model": g.model,
            "pci": g.pci,
            "numa": g.numa_node,
            "cpu_affinity": g.cpu_affinity,
            "uuid": g.uuid,
            "memory_total_bytes": g.memory_total_bytes,
            "pcie": dataclasses.asdict(g.place.link),
            "pcie_gen": {"current": g.pcie_gen_current, "max": g.pcie_gen_max},
            "pcie_width": {"current": g.pcie_width_current, "max": g.pcie_width_max},
            "iommu_group": g.place.iommu_group,
            "origin": g.origin.value,
            "nvml_pci": g.nvml_pci,
            "nvlinks_active": g.nvlinks_active,
        }
        for g in topology.gpus
    ]
    preferred = {g.name: preferred_nics(topology, g) for g in topology.gpus}
    use = {g.name: best_nics(topology, g) for g in topology.gpus}
    cpu = {loc: preferred_nics(topology, loc) for loc in locations(topology)
           if loc.startswith("cpu:")}
    return {
        "gpus": gpus,
        "nics": [_nic_dict(n) for n in topology.nics],
        "matrix": {g: {n: c.value for n, c in row.items()} for g, row in
                   topology.gpu_nic.items()},
        "gpu_matrix": topology.gpu_gpu,
        "preferred": preferred,
        "use": use,
        "cpu_preferred": cpu,
        "pcie_switches": [dataclasses.asdict(s) for s in topology.pcie_switches],
        "nvswitches": [dataclasses.asdict(s) for s in topology.nvswitches],
        "numa_nodes": [
            {"node": n.node, "cpulist": n.cpulist, "distances": list(n.distances)}
            for n in topology.numa_nodes
        ],
        "modules": sorted(topology.modules),
        "modules_known": topology.modules_known,
        "sources": {
            s.name: {"available": s.available, "detail": s.detail, "hint": s.hint}
            for s in topology.sources
        },
    }


def mooncake_topology(topology: Topology) -> dict[str, list[list[str]]]:
    """Mooncake's custom topology (``MC_CUSTOM_TOPO_JSON``) for this host.

    Preferred HCAs are the ACTIVE RDMA devices tied for first place for the location;
    available are the other RDMA devices not known to be down, best first.

    Raises:
        UnavailableError: the host has no RDMA device that is not down. Mooncake needs at
            least one HCA per entry, and an empty topology (``{}``) would only move the
            failure to Mooncake's start.
    """
    rdma = [n for n in topology.nics if n.kind is NicKind.RDMA]
    down = {n.name for n in topology.nics if n.state is PortState.DOWN}
    if not any(n.name not in down for n in rdma):
        gpus = f"{len(topology.gpus)} GPU(s)" if topology.gpus else "no GPU"
        if rdma:
            cause = (f"every RDMA device of this host is down ({', '.join(sorted(down))}; "
                     f"{gpus}): a Mooncake topology needs at least one HCA per entry")
            hint = "bring a port up (kvctl topo doctor names the port and the fix)"
        else:
            cause = (f"this host has no RDMA device ({gpus}): a Mooncake topology needs at "
                     "least one HCA per entry")
            hint = ("without RDMA, Mooncake moves bytes over TCP and needs no custom "
                    "topology: leave MC_CUSTOM_TOPO_JSON unset")
        raise UnavailableError(cause, hint)
    out: dict[str, list[list[str]]] = {}
    for loc in locations(topology):
        best = best_nics(topology, loc, kind=NicKind.RDMA)
        rest = [n for n in preferred_nics(topology, loc, kind=NicKind.RDMA)
                if n not in best and n not in down]
        out[loc] = [best, rest]
    return out


def mooncake_notes(topology: Topology) -> list[str]:
    """What an operator should know about the Mooncake topology of this host (warnings)."""
    notes: list[str] = []
    if not topology.gpus:
        notes.append("no NVIDIA GPU found: the Mooncake topology has cpu:N entries only")
    hidden = [g.name for g in topology.gpus if g.location is None]
    if hidden:
        notes.append(f"{', '.join(hidden)} hidden by CUDA_VISIBLE_DEVICES: left out, and "
                     "cuda:N counts only the visible GPUs; run Mooncake with the same "
                     "CUDA_VISIBLE_DEVICES")
    for loc in locations(topology):
        if not best_nics(topology, loc, kind=NicKind.RDMA):
            notes.append(f"{loc}: no ACTIVE RDMA device, so no preferred HCA")
    return notes


def _gid_preference(gid: GidEntry) -> tuple[int, int]:
    """IPv4-mapped GIDs first (routable RoCE v2), then global, then link-local."""
    if gid.gid.startswith("0000:0000:0000:0000:0000:ffff:"):
        return (0, gid.index)
    if gid.gid.startswith("fe80:"):
        return (2, gid.index)
    return (1, gid.index)


def _gid_index(nics: list[Nic]) -> int | None:
    """The RoCE v2 GID index shared by every RoCE port of ``nics``, if there is one."""
    indexes: set[int] = set()
    for nic in nics:
        for port in nic.active_ports or nic.ports:
            if not port.is_roce:
                continue
            v2 = [g for g in port.gids if g.type == "RoCE v2"]
            if not v2:
                return None
            indexes.add(min(v2, key=_gid_preference).index)
    return indexes.pop() if len(indexes) == 1 else None


def env_lines(topology: Topology) -> list[str]:
    """Shell lines: one commented block per location with the variables for that process."""
    lines = ["# kvctl topo --format env: paste the block of the GPU (or NUMA node) a process",
             "# uses; NCCL_IB_HCA uses '=' for exact device names.",
             "# Mooncake custom topology: kvctl topo --format mooncake > topo.json;"
             " export MC_CUSTOM_TOPO_JSON=$PWD/topo.json"]
    for loc in locations(topology):
        gpu = next((g for g in topology.gpus if g.location == loc), None)
        title = f"{gpu.name} ({loc}, {gpu.pci})" if gpu else f"NUMA node {loc[4:]} ({loc})"
        rdma_names = best_nics(topology, loc, kind=NicKind.RDMA)
        eth_names = best_nics(topology, loc, kind=NicKind.ETHERNET)
        lines.append("")
        if not rdma_names and not eth_names:
            lines.append(f"# {title}: no ACTIVE NIC")
            continue
        classes = ", ".join(
            f"{r.name} {r.link_class.value}" for r in rank_nics(topology, loc)
            if r.name in rdma_names + eth_names
        )
        lines.append(f"# {title}: {classes}")
        if rdma_names:
            rdma = [n for n in topology.nics if n.name in rdma_names]
            ports = [f"{n.name}:{p}" for n in rdma for p in nic_ports(n)]
            lines.append(f"export NCCL_IB_HCA={shlex.quote('=' + ','.join(ports))}")
            lines.append(f"export UCX_NET_DEVICES={shlex.quote(','.join(ports))}")
            lines.append(f"export MOONCAKE_DEVICE={shlex.quote(','.join(rdma_names))}")
            gid = _gid_index(rdma)
            if gid is not None:
                lines.append(f"export MC_GID_INDEX={gid}")
                lines.append(f"export NCCL_IB_GID_INDEX={gid}")
        else:
            joined = ",".join(eth_names)
            lines.append(f"export NCCL_SOCKET_IFNAME={shlex.quote(joined)}")
            lines.append(f"export UCX_NET_DEVICES={shlex.quote(joined)}")
    return lines
