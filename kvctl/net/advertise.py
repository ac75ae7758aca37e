"""Advertised addresses: what a listener tells peers, which is not always where it is bound.

A listener bound to ``0.0.0.0`` or ``::`` is reachable at every address of the host's
interfaces, never at ``0.0.0.0`` itself (a peer dialling that reaches its *own* loopback).
So kvctl publishes, in metadata, in printed hints and to a store master, the interface
addresses for such a bind (loopback only for loopback binds), and ``--advertise HOST``
overrides. Interface facts come from psutil; tests hand in their own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping, Sequence

import psutil

from kvctl.errors import UsageError
from kvctl.net.bind import LOOPBACK, is_loopback, is_unspecified, parse_listen

_log = logging.getLogger("kvctl.net")

#: interface name -> (family, address) pairs of the interfaces that are up.
Interfaces = Callable[[], Mapping[str, Sequence[tuple[int, str]]]]


def _psutil_interfaces() -> dict[str, list[tuple[int, str]]]:
    stats = psutil.net_if_stats()
    found: dict[str, list[tuple[int, str]]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        found[name] = [(int(a.family), a.address.split("%")[0]) for a in addrs
                       if a.family in (socket.AF_INET, socket.AF_INET6)]
    return found


def _split(address: str) -> tuple[str, str]:
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest.removeprefix(":")
    if address.count(":") == 1:
        host, _, port = address.partition(":")
        return host, port
    return address, ""  # a bare name, IPv4 or IPv6 address


def host_of(address: str) -> str:
    """The host part of ``HOST:PORT`` (``[v6]:PORT`` too); a bare host is returned as is."""
    return _split(address)[0]


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def interface_addresses(*, ipv6: bool = False, interfaces: Interfaces | None = None
                        ) -> list[str]:
    """Addresses of this host that peers can reach: interfaces up, no loopback, no
    link-local; IPv4 first, IPv6 only when ``ipv6``."""
    v4: list[str] = []
    v6: list[str] = []
    for _, addrs in sorted((interfaces or _psutil_interfaces)().items()):
        for family, text in addrs:
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
                continue
            if family == socket.AF_INET:
                v4.append(text)
            elif ipv6:
                v6.append(text)
    return list(dict.fromkeys(v4 + v6))


def route_source(peer_host: str) -> str | None:
    """The local address the kernel would use to reach ``peer_host`` (no packet is sent),
    or ``None`` when there is no route or the name does not resolve."""
    try:
        infos = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    return None


def advertised_hosts(bound_host: str, override: Sequence[str] = (), *,
                     prefer: str | None = None, interfaces: Interfaces | None = None
                     ) -> tuple[str, ...]:
    """The hosts a listener bound to ``bound_host`` tells peers about.

    ``override`` (``--advertise``) wins. A wildcard bind gives the interface addresses
    (``prefer`` first when it is one of them, e.g. the address that routes to a store
    master), or loopback when the host has no other; any other bind gives itself.
    """
    if override:
        return tuple(host_of(h) for h in override)
    if not is_unspecified(bound_host):
        return (bound_host,)
    found = interface_addresses(ipv6=":" in bound_host, interfaces=interfaces)
    if prefer is not None and prefer in found:
        found.remove(prefer)
        found.insert(0, prefer)
    return tuple(found) or (LOOPBACK,)


def advertised_addresses(bound_host: str, port: int, override: Sequence[str] = (), *,
                         prefer: str | None = None, interfaces: Interfaces | None = None
                         ) -> tuple[str, ...]:
    """``HOST:PORT`` for each of :func:`advertised_hosts`; an override entry may carry its
    own port (``HOST:PORT``), else the bound port is used."""
    if override:
        out = []
        for entry in override:
            host, port_text = _split(entry)
            if port_text and not (port_text.isascii() and port_text.isdigit()):
                raise UsageError(f"advertised address {entry!r} has a bad port",
                                 "write HOST or HOST:PORT")
            out.append(join_host_port(host, int(port_text) if port_text else port))
        return tuple(out)
    return tuple(join_host_port(h, port) for h in advertised_hosts(
        bound_host, prefer=prefer, interfaces=interfaces))


def default_listen(peer_host: str | None) -> str:
    """Where a listener binds when not told, given where its peers are: loopback when they
    are on this host (or unknown), else the local address that routes to ``peer_host``
    (any port). Loopback stays the default for everything that runs on one host."""
    if peer_host is None or is_loopback(peer_host):
        return f"{LOOPBACK}:0"
    if is_unspecified(peer_host):
        return "0.0.0.0:0"
    return join_host_port(route_source(peer_host) or "0.0.0.0", 0)


def check_reachable(peer_host: str | None, listen: str, advertise: Sequence[str], *,
                    what: str, flag: str) -> None:
    """Refuse a loopback ``listen`` (without ``advertise``) when peers are on another host.

    Raises:
        UsageError: peers at ``peer_host`` could never reach ``listen``; the hint names
            ``flag`` and ``--advertise``.
    """
    if peer_host is None or is_loopback(peer_host) or is_unspecified(peer_host) or advertise:
        return
    if is_loopback(parse_listen(listen)[0]):
        raise UsageError(
            f"{what} would listen on {listen}, but its peers reach it through {peer_host}, "
            "another host: they could not connect",
            f"drop {flag} (it then listens on the address that routes to {peer_host}), give "
            f"{flag} 0.0.0.0:0 or this host's address, or add --advertise HOST")


def warn_unresolvable(hosts: Sequence[str], what: str) -> None:
    """Log a warning for each advertised host name this host cannot resolve (peers likely
    cannot either: a typo, or a name only some resolvers know)."""
    for host in hosts:
        try:
            socket.getaddrinfo(host_of(host), None)
        except OSError:
            _log.warning("%s advertises %s, which does not resolve here: peers that cannot "
                         "resolve it will not reach it (give an address)", what, host_of(host))
