"""Which NIC should move a buffer's bytes: NICs ranked for a location (``cuda:N``/``cpu:N``).

The order is: ACTIVE ports first (a port that is not ACTIVE is listed but never preferred;
an unknown state ranks after ACTIVE and before DOWN), then the path class (PIX before PXB
before PHB before NODE before SYS), then the same NUMA node before another, then the higher
link rate, then the name. For ``cpu:N`` the class is NODE for a NIC on node N and SYS
otherwise. On a host with one NUMA node a device whose node is unknown (kernel ``-1``) is on
that node (:meth:`~kvctl.topo.model.Topology.effective_numa`).

The transfer engine calls :func:`preferred_nics` to pick NICs for a registered buffer.
"""

from __future__ import annotations

import dataclasses

from kvctl.errors import NotFoundError, UsageError
from kvctl.topo.model import Gpu, LinkClass, Nic, NicKind, PortState, Topology

_STATE_ORDER = {PortState.ACTIVE: 0, PortState.UNKNOWN: 1, PortState.DOWN: 2}


@dataclasses.dataclass(frozen=True)
class RankedNic:
    """One NIC as seen from a location.

    Attributes:
        name: NIC name (``mlx5_0`` or a netdev).
        kind: RDMA or Ethernet.
        link_class: path class from the location to the NIC.
        same_numa: whether the NIC is on the location's (known) NUMA node.
        rate_gbps: NIC link rate in Gb/s (decimal), ``None`` when unknown.
        state: port state (ACTIVE when any port is).
    """

    name: str
    kind: NicKind
    link_class: LinkClass
    same_numa: bool
    rate_gbps: float | None
    state: PortState

    def sort_key(self) -> tuple[int, int, int, float, str]:
        """The ranking key (lower is better)."""
        return (
            _STATE_ORDER[self.state],
            self.link_class.order,
            0 if self.same_numa else 1,
            -(self.rate_gbps or 0.0),
            self.name,
        )


@dataclasses.dataclass(frozen=True)
class Location:
    """A parsed buffer location: ``cuda:N`` (CUDA ordinal N: PCI order among the GPUs
    ``CUDA_VISIBLE_DEVICES`` leaves visible) or ``cpu:N`` (NUMA node N)."""

    device: str
    index: int

    def __str__(self) -> str:
        return f"{self.device}:{self.index}"


def parse_location(topology: Topology, location: str) -> Location:
    """Parse and check ``location`` against ``topology``.

    Raises:
        UsageError: not of the form ``cuda:N`` or ``cpu:N``.
        NotFoundError: no such GPU or NUMA node on this host.
    """
    device, sep, index_text = location.strip().partition(":")
    digits = index_text.isascii() and index_text.isdigit()  # not "²": int() refuses it
    if not sep or device not in ("cuda", "cpu") or not digits:
        raise UsageError(
            f"location {location!r} is not cuda:N or cpu:N",
            "write cuda:0 for CUDA device 0 or cpu:0 for NUMA node 0",
        )
    index = int(index_text)
    if device == "cuda":
        if topology.cuda_gpu(index) is None:
            known = ", ".join(g.location for g in topology.gpus if g.location) or "none"
            hidden = len([g for g in topology.gpus if g.location is None])
            raise NotFoundError(
                f"no GPU for location {location!r}",
                f"CUDA devices here: {known}"
                + (f" ({hidden} more hidden by CUDA_VISIBLE_DEVICES)" if hidden else ""))
    else:
        nodes = [n.node for n in topology.numa_nodes] or [0]
        if index not in nodes:
            known = ", ".join(f"cpu:{n}" for n in nodes)
            raise NotFoundError(f"no NUMA node for location {location!r}",
                                f"NUMA nodes here: {known}")
    return Location(device, index)


def rank_nics(
    topology: Topology, location: str | Gpu, *, kind: NicKind | None = None
) -> list[RankedNic]:
    """Every NIC (of ``kind``, or all), best first, as seen from ``location`` (``cuda:N``,
    ``cpu:N``, or a :class:`Gpu` itself, also one hidden from this process's CUDA)."""
    gpu: Gpu | None
    if isinstance(location, Gpu):
        gpu, node = location, None
    else:
        where = parse_location(topology, location)
        gpu = topology.cuda_gpu(where.index) if where.device == "cuda" else None
        node = where.index
    ranked: list[RankedNic] = []
    for nic in topology.nics:
        if kind is not None and nic.kind is not kind:
            continue
        nic_numa = topology.effective_numa(nic.numa_node)
        if gpu is not None:
            link_class = topology.gpu_nic[gpu.name][nic.name]
            numa = topology.effective_numa(gpu.numa_node)
        else:
            numa = node
            same = nic_numa == numa
            link_class = LinkClass.NODE if same else LinkClass.SYS
        ranked.append(
            RankedNic(
                name=nic.name,
                kind=nic.kind,
                link_class=link_class,
                same_numa=numa is not None and nic_numa == numa,
                rate_gbps=nic.rate_gbps,
                state=nic.state,
            )
        )
    ranked.sort(key=RankedNic.sort_key)
    return ranked


def preferred_nics(topology: Topology, location: str | Gpu, *,
                   kind: NicKind | None = None) -> list[str]:
    """NIC names for a buffer at ``location`` (``cuda:N`` / ``cpu:N``), best first.

    Every NIC is listed; NICs whose ports are not ACTIVE come last.

    Raises:
        UsageError: ``location`` is malformed.
        NotFoundError: no such GPU or NUMA node.
    """
    return [r.name for r in rank_nics(topology, location, kind=kind)]


def best_nics(topology: Topology, location: str | Gpu, *, kind: NicKind | None = None
              ) -> list[str]:
    """The ACTIVE NICs tied for first place (same class, NUMA match and rate); may be empty."""
    ranked = [r for r in rank_nics(topology, location, kind=kind)
              if r.state is PortState.ACTIVE]
    if not ranked:
        return []
    top = ranked[0].sort_key()[:4]
    return [r.name for r in ranked if r.sort_key()[:4] == top]


def nic_ports(nic: Nic) -> list[int]:
    """Port numbers to use on ``nic``: its ACTIVE ports, else all of them."""
    active = [p.port for p in nic.active_ports]
    return active or [p.port for p in nic.ports]
