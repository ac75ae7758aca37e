"""``kvctl store master --state etcd://...``: a master that leads or stands by.

The listen address is bound at once but not listened on, so the port is this master's
and a client or node that tries it meanwhile is refused at once (and moves on to the next
master it was given). The master campaigns (:mod:`kvctl.store.master.election`); once it
leads it loads the state and listens on that port, its state writes fenced by its term,
and serves until it is stopped or deposed. Loading only after the claim matters: every
write of the previous leader that etcd took is then in what this master loads, and
every later one is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from collections.abc import Callable

from kvctl.errors import UsageError
from kvctl.net.advertise import advertised_hosts, join_host_port
from kvctl.net.bind import address_family, is_unspecified, parse_listen
from kvctl.store.embedded import start_master
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.master.election import Election
from kvctl.store.server import MasterServer
from kvctl.store.settings import DEFAULT_PORT, StoreSettings
from kvctl.store.state.base import StateBackend
from kvctl.store.state.writebehind import MetadataState


def reserve(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and not listening (connections are refused).

    Raises:
        StoreUnavailableError: the address cannot be bound.
    """
    family = address_family(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and is_unspecified(host):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StoreUnavailableError(
            f"store master cannot listen on {host}:{port}: {exc.strerror or exc}",
            "pick another --listen port or stop what holds it") from exc
    return sock


def _candidate(settings: StoreSettings, *, token: str | None, cluster_id: str
               ) -> tuple[str, int, socket.socket, Election]:
    """The listen host, the port reserved for this master (``sock``, bound and not
    listening) and its part in the election, which names that port."""
    host, port = parse_listen(settings.listen, default_port=DEFAULT_PORT)
    sock = reserve(host, port)
    bound = sock.getsockname()[1]
    shown = advertised_hosts(host)[0] if is_unspecified(host) else host
    try:
        election = Election(settings.state, address=join_host_port(shown, bound),
                            cluster_id=cluster_id, token=token, ttl_s=settings.ha_ttl)
    except BaseException:
        sock.close()
        raise
    return host, bound, sock, election


def run_elected(settings: StoreSettings, *, token: str | None, cluster_id: str,
                stop: threading.Event, on_leading: Callable[[MasterServer, int], None]
                ) -> str | None:
    """Stand by, then lead until ``stop`` is set; ``None`` then, or why this master was
    deposed (it has stopped serving). ``on_leading(server, term)`` runs once it serves.

    Raises:
        StoreUnavailableError: the listen address cannot be bound.
        UsageError: the state is not etcd, or a bad TTL.
    """
    host, bound, sock, election = _candidate(settings, token=token, cluster_id=cluster_id)
    deposed = threading.Event()

    def ended(why: str) -> None:
        deposed.set()
        stop.set()

    election.on_deposed(ended)
    server: MasterServer | None = None
    try:
        if not election.campaign(stop):
            return None
        sock.close()  # the server binds the same port now
        server = _start_leading(settings, host, bound, election, token=token,
                                cluster_id=cluster_id)
        if not deposed.is_set():  # (deposed while loading: it never served)
            on_leading(server, election.term)
        while not stop.wait(0.5):
            pass
        return election.deposed if deposed.is_set() else None
    finally:
        if server is not None:
            server.close()  # flushes the state while the key is still ours
        else:
            with contextlib.suppress(OSError):
                sock.close()
        election.close()


def _start_leading(settings: StoreSettings, host: str, port: int, election: Election, *,
                   token: str | None, cluster_id: str) -> MasterServer:
    """The master of a leader that has just claimed the key: it loads the state (every
    write the previous leader got into etcd is in it), its writes fenced by the term and
    its requests refused once it is deposed."""
    def fence(state: StateBackend) -> None:
        # Fenced before it is loaded, so from its first write on (the tick and the first
        # connections start with the server, before this function returns): a leader
        # whose lease ran out while it loaded never writes over its successor's state.
        if not isinstance(state, MetadataState):  # pragma: no cover - etcd:// only
            raise UsageError(f"{settings.state}: not a metadata state",
                             "use an etcd:// URL")
        state.fence_writes(election.fence, election.depose)

    server = start_master(dataclasses.replace(settings, listen=join_host_port(host, port)),
                          token=token, cluster_id=cluster_id, fence=fence)
    try:
        server.lead_while(election.check)
        server.core.fence_nodes(election.sure)  # nodes follow the lease (27.7)
    except BaseException:
        server.close()
        raise
    return server


def lead_now(settings: StoreSettings, *, token: str | None, cluster_id: str
             ) -> tuple[MasterServer, Election]:
    """A master that leads at once or not at all (``kvctl store serve`` on etcd state,
    which has a node of its own in the process and cannot stand by): the claimed
    leadership and its server, fenced like an elected master's, so an elected master
    started later stands by instead of writing the same state.

    Raises:
        StoreUnavailableError: another master leads (named), etcd cannot be reached, or
            the listen address cannot be bound.
    """
    from kvctl.metadata.base import MetadataError

    host, bound, sock, election = _candidate(settings, token=token, cluster_id=cluster_id)
    try:
        try:
            won = election.try_once(standby=False)  # refused: it never stands by
            holder = None if won else election.leader()
        except MetadataError as exc:
            raise StoreUnavailableError(
                f"cannot take the lead of the store state in {settings.state}: {exc.cause}",
                "check that etcd is up and reachable (etcdctl endpoint health)") from exc
        if not won:
            who = f"master {holder.describe()}" if holder is not None else "another process"
            raise StoreUnavailableError(
                f"{who} leads the store state in {settings.state}; a second master would "
                "write the same state unfenced",
                "point clients and nodes at the leader (--master etcd://...), stop it "
                "first, or give this store its own state or KVCTL_CLUSTER_ID; a leader "
                f"that died on another host holds the state until its {election.ttl_s:g} s "
                "lease runs out (one that died on this host is taken over at once)")
        sock.close()  # the server binds the same port now
        return _start_leading(settings, host, bound, election, token=token,
                              cluster_id=cluster_id), election
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        election.close()
        raise
