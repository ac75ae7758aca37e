"""What an agent tells the cluster about its host: addresses, GPUs, NICs, doctor, transports.

Facts come from the sources the rest of kvctl reads, passed in so tests hand in their own:
the topology (``kvctl topo``: GPUs, RDMA and Ethernet NICs with rates and port states, the
doctor's findings) and the host's network interfaces (psutil), which also list what topo
does not see (virtual NICs without a PCI function). The *rails* of a host are its active
NICs with an IPv4 address, in name order, or the ones ``kvctl agent --rail`` names, in the
order given: rail ``i`` of one host is benchmarked against rail ``i`` of another.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psutil

from kvctl import __version__
from kvctl.cluster.protocol import (
    DoctorSummary,
    FindingFact,
    GpuFact,
    HostRecord,
    NicFact,
    Rail,
    check_host_name,
    now,
)
from kvctl.errors import KvctlError, UsageError
from kvctl.net.advertise import interface_addresses, route_source
from kvctl.net.bind import LOOPBACK, is_loopback

if TYPE_CHECKING:
    from kvctl.topo.model import Topology

_log = logging.getLogger("kvctl.cluster")


@dataclasses.dataclass(frozen=True)
class Netdev:
    """A network interface.

    Attributes:
        name: interface name (``eth0``).
        up: administratively and operationally up.
        speed_mbps: link speed in Mbit/s as the kernel reports it (0: unknown).
        addresses: its IPv4 addresses.
    """

    name: str
    up: bool
    speed_mbps: int
    addresses: tuple[str, ...]


def psutil_netdevs() -> list[Netdev]:
    """This host's interfaces (loopback excluded), from psutil."""
    stats = psutil.net_if_stats()
    found: list[Netdev] = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        st = stats.get(name)
        v4 = tuple(a.address for a in addrs if a.family == socket.AF_INET)
        if st is None or any(is_loopback(a) for a in v4) or "loopback" in (st.flags or ""):
            continue
        found.append(Netdev(name, bool(st.isup), int(st.speed or 0), v4))
    return found


def load_live_topology() -> Topology | None:
    """This host's topology, or ``None`` (logged) when it cannot be read."""
    from kvctl.topo.sources import TopoSettings, load_topology

    try:
        return load_topology(TopoSettings())
    except KvctlError as exc:
        _log.warning("topology unreadable: %s", exc.cause)
        return None


def doctor_summary(topology: Topology | None) -> DoctorSummary:
    """``kvctl topo doctor`` of ``topology``, as counts and findings."""
    if topology is None:
        return DoctorSummary(error="topology could not be read (run 'kvctl topo -v' on that host)")
    from kvctl.topo.doctor import run_doctor

    findings = run_doctor(topology)
    facts = [FindingFact(f.check, f.severity.value, f.subject, f.message, f.hint)
             for f in findings]
    count = {s: sum(1 for f in facts if f.severity == s) for s in ("error", "warning", "info")}
    return DoctorSummary(errors=count["error"], warnings=count["warning"], infos=count["info"],
                         findings=facts)


def nic_facts(topology: Topology | None, netdevs: Sequence[Netdev]) -> list[NicFact]:
    """The topology's NICs with their interface addresses, then the interfaces it does not
    list (virtual NICs) that are up or have an address, each with its kernel-reported
    speed."""
    by_name = {d.name: d for d in netdevs}
    out: list[NicFact] = []
    covered: set[str] = set()
    for nic in topology.nics if topology is not None else ():
        netdev = next((p.netdev for p in nic.ports if p.netdev), None)
        if netdev is None and nic.kind.value == "ethernet":
            netdev = nic.name
        dev = by_name.get(netdev or "")
        if netdev:
            covered.add(netdev)
        out.append(NicFact(name=nic.name, kind=nic.kind.value, state=nic.state.value.lower(),
                           rate_gbps=nic.rate_gbps, netdev=netdev,
                           addresses=list(dev.addresses) if dev else [],
                           numa_node=nic.numa_node))
    for dev in netdevs:
        if dev.name in covered or not (dev.up or dev.addresses):
            continue
        out.append(NicFact(name=dev.name, kind="netdev", state="active" if dev.up else "down",
                           rate_gbps=dev.speed_mbps / 1000 if dev.speed_mbps > 0 else None,
                           netdev=dev.name, addresses=list(dev.addresses)))
    return out


def rails_of(nics: Sequence[NicFact]) -> list[Rail]:
    """Active NICs with an IPv4 address, in name order, numbered from 0."""
    usable = sorted((n for n in nics if n.state == "active" and n.addresses),
                    key=lambda n: n.name)
    return [Rail(i, n.name, n.addresses[0]) for i, n in enumerate(usable)]


def pinned_rails(specs: Sequence[str], nics: Sequence[NicFact],
                 addresses: Sequence[str]) -> list[Rail]:
    """The rails ``kvctl agent --rail`` names, numbered in the order given.

    Each spec is ``NAME=ADDRESS`` (rail ``NAME`` at ``ADDRESS``, an address of this host) or
    ``NAME`` (a NIC or interface of this host, at its first IPv4 address). A pinned NIC that
    is down stays a rail (its pairs fail) rather than renumbering the rails after it.

    Raises:
        UsageError: an empty name, an address this host does not have, a NIC it does not
            have or one without an address, or a name or address given twice.
    """
    by_name = {n.name: n for n in nics}
    by_name.update({n.netdev: n for n in nics if n.netdev and n.netdev not in by_name})
    rails: list[Rail] = []
    for spec in specs:
        name, sep, address = (part.strip() for part in spec.partition("="))
        if not name or (sep and not address):
            raise UsageError(f"--rail {spec!r} is not NAME or NAME=ADDRESS",
                             "e.g. --rail eth1 or --rail rail1=10.1.0.5")
        if not sep:
            nic = by_name.get(name)
            if nic is None:
                raise UsageError(f"--rail {name}: this host has no NIC or interface {name}",
                                 f"its NICs: {', '.join(sorted(by_name)) or 'none'}; or give "
                                 "NAME=ADDRESS")
            if not nic.addresses:
                raise UsageError(f"--rail {name}: {name} has no IPv4 address",
                                 "give the rail's address: --rail NAME=ADDRESS")
            address = nic.addresses[0]
        elif address not in addresses:
            raise UsageError(f"--rail {spec}: {address} is not an address of this host",
                             f"its addresses: {', '.join(addresses) or 'none'}")
        if any(r.nic == name or r.address == address for r in rails):
            raise UsageError(f"--rail {spec}: that name or address is already a rail",
                             "give each rail once, with its own address")
        rails.append(Rail(len(rails), name, address))
    return rails


def primary_address(toward: str | None, advertise: str | None = None,
                    route: Callable[[str], str | None] = route_source,
                    interfaces: Callable[[], list[str]] = interface_addresses) -> str:
    """Where peers reach this host: ``advertise``, else the address that routes toward the
    metadata service, else the first interface address, else loopback (one host)."""
    if advertise:
        return advertise
    if toward is not None and not is_loopback(toward):
        found = route(toward)
        if found and not is_loopback(found):
            return found
    if toward is not None and is_loopback(toward):
        return LOOPBACK
    return next(iter(interfaces()), LOOPBACK)


def _is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def transports_of(topology: Topology | None) -> list[str]:
    """``shm`` (same host), ``tcp``, and ``rdma`` when an RDMA port is active and verbs
    answers."""
    out = ["shm", "tcp"]
    if topology is not None:
        verbs = topology.source("verbs")
        if verbs is not None and verbs.available and any(
                n.kind.value == "rdma" and n.state.value == "ACTIVE" for n in topology.nics):
            out.append("rdma")
    return out


def engines_here() -> list[str]:
    """Transfer engines whose package imports here (their modules load, nothing starts)."""
    from kvctl.bench.engines.base import driver_class, known_engines

    found = []
    for name in known_engines():
        try:
            reason = driver_class(name).unavailable_reason()
        except KvctlError as exc:  # pragma: no cover - a registry entry that cannot load
            reason = exc.cause
        if reason is None:
            found.append(name)
    return found


@dataclasses.dataclass(frozen=True)
class FactSources:
    """Where facts come from (the live host by default; tests pass their own).

    Attributes:
        topology: reads the topology (``None``: unreadable).
        netdevs: lists the network interfaces.
        engines: lists the usable transfer engines.
        route: the local address toward a host.
    """

    topology: Callable[[], Topology | None] = load_live_topology
    netdevs: Callable[[], list[Netdev]] = psutil_netdevs
    engines: Callable[[], list[str]] = engines_here
    route: Callable[[str], str | None] = route_source


def collect_facts(*, hostname: str | None = None, toward: str | None = None,
                  advertise: str | None = None, jobs: Sequence[str] = (),
                  lease_ttl_s: float = 10.0, poll_s: float = 0.5, metrics: str | None = None,
                  rails: Sequence[str] = (), sources: FactSources | None = None
                  ) -> tuple[HostRecord, Topology | None]:
    """This host's record (and the topology it came from, for NIC line rates later).

    Args:
        hostname: the member name (default: the kernel's hostname).
        toward: the metadata service's host, to pick the address that routes to it.
        advertise: the address to publish instead (``--advertise``).
        rails: ``--rail`` specs (:func:`pinned_rails`); empty: every active NIC with an
            IPv4 address (:func:`rails_of`).

    Raises:
        UsageError: a host name that cannot be a key, or a ``--rail`` that is not this
            host's.
    """
    src = sources or FactSources()
    name = check_host_name(hostname or socket.gethostname())
    topology = src.topology()
    netdevs = src.netdevs()
    nics = nic_facts(topology, netdevs)
    addresses = [a for d in netdevs if d.up for a in d.addresses if _is_ipv4(a)]
    address = primary_address(toward, advertise, src.route,
                              lambda: list(dict.fromkeys(addresses)))
    gpus = [GpuFact(g.name, g.model, g.memory_total_bytes, g.numa_node)
            for g in (topology.gpus if topology is not None else ())]
    record = HostRecord(
        hostname=name, agent_id=uuid.uuid4().hex[:12], version=__version__, pid=os.getpid(),
        started_at=now(), address=address, addresses=list(dict.fromkeys(addresses)),
        gpus=gpus, nics=nics, doctor=doctor_summary(topology),
        rails=(pinned_rails(rails, nics, [a for d in netdevs for a in d.addresses])
               if rails else rails_of(nics)),
        transports=transports_of(topology), engines=src.engines(), jobs=list(jobs),
        lease_ttl_s=lease_ttl_s, poll_s=poll_s, metrics=metrics)
    return record, topology
