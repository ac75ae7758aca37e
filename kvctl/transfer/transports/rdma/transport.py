"""The ``rdma`` transport: one-sided READ/WRITE over RC queue pairs on every usable port.

It ties the parts together: :mod:`.devices` (which ports, a context per port, NIC choice),
:mod:`.memory` (MRs per buffer and port), :mod:`.exchange` (QP lifecycle and the QP
exchange service) and :mod:`.datapath` (posting and completion matching, one poster per
port). It knows nothing of the engine: the engine hands it its name, token and listen
address, and calls :meth:`RdmaTransport.register`/:meth:`RdmaTransport.unregister` for its
segments and :meth:`RdmaTransport.execute` for requests.

Per request: cut into slices of at most :attr:`RdmaTransport.slice_bytes`; each slice gets
a (local port, remote port) pair, round robin over the local buffer's ports (topology
ranking of its location) and the target buffer's published ports; a failed slice is
retried on another pair and counted.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvctl.errors import UsageError
from kvctl.transfer.batch import SETTLE_FAILED, Batch, OpCode
from kvctl.transfer.errors import TransportUnavailableError
from kvctl.transfer.paths import slice_ranges
from kvctl.transfer.segments import LocalBuffer, LocalSegment
from kvctl.transfer.transports.base import Item, RemoteSegment, Transport
from kvctl.transfer.transports.rdma import devices
from kvctl.transfer.transports.rdma.datapath import Poster, Slice, settle_failed
from kvctl.transfer.transports.rdma.devices import NicContext, NicPort, Probe, RdmaOptions
from kvctl.transfer.transports.rdma.exchange import (
    Connection,
    ExchangeServer,
    access_flags,
    connect_qp,
    new_qp,
    request_qp,
)
from kvctl.transfer.transports.rdma.memory import CudaGateway, MemoryRegistry
from kvctl.transfer.transports.rdma.provider import INSTALL_HINT, Verbs, load_verbs

_log = logging.getLogger("kvctl.transfer.rdma")


class RdmaTransport(Transport):
    """RC queue pairs on every usable port; one poster thread per port.

    Args:
        engine_name: shown to targets in their logs.
        token: shared secret for the QP exchange (``None``: open).
        listen_host: address the QP exchange service binds (the engine's listen host).
        advertise: addresses to publish for it (the engine's ``advertise``).
        options: see :class:`~kvctl.transfer.transports.rdma.devices.RdmaOptions`.
        verbs: the provider (default: :func:`~.provider.load_verbs`).
        probe_result: the ports to use (default: :func:`~.devices.probe`).
        cuda: CUDA gateway for dma-buf registration of GPU buffers.
        peermem: whether plain MRs reach GPU memory (default: ask ``/sys/module``).

    Raises (constructor):
        TransportUnavailableError: no pyverbs, no usable port, or no port could be opened
            (the cause says why, the hint how to fix it).
        UsageError: bad options.
    """

    name = "rdma"

    def __init__(self, *, engine_name: str, token: str | None = None,
                 listen_host: str = "127.0.0.1", advertise: Sequence[str] = (),
                 options: RdmaOptions | None = None, verbs: Verbs | None = None,
                 probe_result: Probe | None = None, cuda: CudaGateway | None = None,
                 peermem: bool | None = None) -> None:
        self.options = options = options or RdmaOptions()
        options.check()
        if verbs is None:
            try:
                verbs = load_verbs()
            except ImportError as exc:
                raise TransportUnavailableError(f"pyverbs is not importable ({exc})",
                                                INSTALL_HINT) from None
        self._verbs = verbs
        found = probe_result or devices.probe(options, verbs)
        if found.reason is not None:
            raise TransportUnavailableError(found.reason, found.hint or "see ibv_devinfo -v")
        self._engine_name = engine_name
        self._token = token
        self._listen_host = listen_host
        self._advertise = tuple(advertise)
        self._nics: dict[str, NicContext] = {}
        errors: list[TransportUnavailableError] = []
        for port in found.ports:
            try:
                self._nics[port.name] = NicContext(verbs, port, options)
            except TransportUnavailableError as exc:
                _log.warning("RDMA: not using %s: %s", port.name, exc.cause)
                errors.append(exc)
        if not self._nics:
            self._close_nics()
            first = errors[0]
            raise TransportUnavailableError(f"no RDMA port could be opened: {first.cause}",
                                            first.hint) from None
        self.ports: tuple[NicPort, ...] = tuple(n.port for n in self._nics.values())
        #: requests above this are sliced; never above any port's max_msg_sz
        self.slice_bytes = min(options.slice_bytes, *(p.max_msg_bytes for p in self.ports))
        first_nic = next(iter(self._nics.values()))
        self._access = access_flags(first_nic)
        self._registry = MemoryRegistry(
            self._nics, self._access, verbs.Error, gpu_memory=options.gpu_memory,
            cuda=cuda if cuda is not None else options.cuda,
            peermem=peermem if peermem is not None else options.peermem)
        self._ranking = options.ranking
        self._ranking_read = options.ranking is not None or len(self._nics) < 2
        self._server: ExchangeServer | None = None
        self._lock = threading.Lock()
        self._rr = itertools.count()
        self._paused: dict[tuple[str, str], float] = {}
        self._failures: dict[tuple[str, str], int] = {}
        self._closed = False
        self._posters = {name: Poster(nic, self._registry, options,
                                      open_connection=self._open, reroute=self._reroute)
                         for name, nic in self._nics.items()}
        _log.info("RDMA transport on %s (slices of %d bytes)",
                  ", ".join(self._describe(p) for p in self.ports), self.slice_bytes)

    @staticmethod
    def _describe(port: NicPort) -> str:
        if port.is_ib:
            return f"{port.name} (InfiniBand, LID {port.lid})"
        return f"{port.name} (RoCE, GID index {port.gid_index} {port.gid_type or ''})".replace(
            " )", ")")

    # -- NIC choice --------------------------------------------------------------------

    def _ports_for(self, location: str) -> list[str]:
        if not self._ranking_read:
            self._ranking_read = True
            self._ranking = devices.topo_ranking()
        return [p.name for p in devices.order_for(location, self.ports, self._ranking)]

    def nics_for(self, buf: LocalBuffer) -> list[str]:
        """The local ports that move ``buf``'s bytes (registered ones, else by location)."""
        return self._registry.nics_of(buf) or self._ports_for(buf.location)

    # -- registration ------------------------------------------------------------------

    def register(self, seg: LocalSegment) -> tuple[dict[str, Any], ...] | None:
        """Register ``seg``'s buffers on the ports chosen for their locations.

        Returns what peers need, per buffer (``length``, ``mode``, ``cm``: the QP exchange
        addresses, ``nics``: port → ``addr``/``rkey``/``link``/``max_msg``), or ``None``
        when a buffer can only be staged (a file, GPU memory without dma-buf or peermem):
        such a segment is an initiator's local buffer, not an RDMA target.

        Raises:
            TransportUnavailableError: a registration failed (e.g. the memlock limit).
        """
        entries = self._registry.register(seg, lambda buf: self._ports_for(buf.location))
        staged = [e for e in entries if e.mode == "staged"]
        if staged:
            _log.info("segment %s: %d buffer(s) without a memory region (%s); not offered "
                      "over RDMA (initiator use is staged)", seg.name, len(staged),
                      staged[0].buf.location)
            return None
        server = self._exchange()
        out = []
        for entry in entries:
            nics = {}
            for name, mr in entry.mrs.items():
                port = self._nics[name].port
                nics[name] = {"addr": mr.base, "rkey": mr.rkey,
                              "link": "ib" if port.is_ib else "roce",
                              "max_msg": port.max_msg_bytes}
            out.append({"length": entry.buf.length, "mode": entry.mode,
                        "cm": list(server.addresses), "nics": nics})
        return tuple(out)

    def unregister(self, seg: LocalSegment) -> None:
        """Deregister ``seg``'s memory regions (its pinned pages are released)."""
        self._registry.unregister(seg)

    def _exchange(self) -> ExchangeServer:
        with self._lock:
            if self._server is None:
                self._server = ExchangeServer(self._nics, self.options, token=self._token,
                                              host=self._listen_host,
                                              advertise=self._advertise,
                                              error=self._verbs.Error)
            return self._server

    # -- data path ---------------------------------------------------------------------

    def pieces(self, length: int) -> int:
        return -(-length // self.slice_bytes)

    def execute(self, batch: Batch, op: OpCode, target: RemoteSegment, items: list[Item]) -> None:
        if self._closed:
            batch.settle([it[0] for it in items], path="rdma", failure=SETTLE_FAILED,
                         cause="RDMA transport closed")
            return
        published = target.info.rdma
        if len(published) != len(target.info.buffers) or not all(
                "nics" in b for b in published):
            batch.settle([it[0] for it in items], path="rdma", failure=SETTLE_FAILED,
                         cause=f"segment {target.info.name!r} publishes no RDMA memory regions "
                               "this kvctl understands")
            return
        per_port: dict[str, list[Slice]] = {}
        slice_bytes = self.slice_bytes
        rr = self._rr
        for slot, lbuf, lrel, bi, trel, _toff, length in items:
            pairs = self._pairs_cached(target, lbuf, bi)
            if self._paused:
                pairs = self._healthy(pairs)
            if not pairs:
                for _ in range(-(-length // slice_bytes)):
                    batch.settle([slot], path="rdma", failure=SETTLE_FAILED,
                                 cause="no NIC pair with the same link layer (InfiniBand or "
                                       f"RoCE) reaches segment {target.info.name!r}")
                continue
            for off, piece in slice_ranges(length, slice_bytes):
                local, remote = pairs[next(rr) % len(pairs)]
                sl = Slice(batch, slot, op, lbuf, lrel + off, target, bi, trel + off, piece,
                           remote)
                limit = int(published[bi]["nics"][remote].get("max_msg") or piece)
                if piece > limit:
                    settle_failed(sl, f"slice of {piece} bytes is above {remote}'s max_msg_sz "
                                      f"({limit})", timeout=False)
                    continue
                per_port.setdefault(local, []).append(sl)
        for port, slices in per_port.items():
            self._posters[port].submit(slices)

    def _pairs(self, lbuf: LocalBuffer, published: dict[str, Any]) -> list[tuple[str, str]]:
        """(local port, remote port) pairs for a buffer pair, interleaved so consecutive
        slices use different NICs on both ends; only pairs of the same link layer."""
        local = self.nics_for(lbuf)
        remote = published["nics"]
        pairs: list[tuple[str, str]] = []
        for k in range(max(len(local), len(remote))):
            lname = local[k % len(local)]
            link = "ib" if self._nics[lname].port.is_ib else "roce"
            same = [r for r, info in remote.items() if info.get("link", link) == link]
            if same and (lname, same[k % len(same)]) not in pairs:
                pairs.append((lname, same[k % len(same)]))
        return pairs

    def _pairs_cached(self, target: RemoteSegment, lbuf: LocalBuffer, bi: int
                      ) -> list[tuple[str, str]]:
        cache: dict[tuple[LocalBuffer, int], list[tuple[str, str]]] = target.cache.setdefault(
            "rdma-pairs", {})
        pairs = cache.get((lbuf, bi))
        if pairs is None:
            pairs = cache[(lbuf, bi)] = self._pairs(lbuf, target.info.rdma[bi])
        return pairs

    def _healthy(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """``pairs`` without the paused ones (all of them when every pair is paused)."""
        now = time.monotonic()
        healthy = [p for p in pairs if self._paused.get(p, 0.0) <= now]
        return healthy or pairs

    def _reroute(self, sl: Slice, cause: str, timeout: bool) -> None:
        """A slice failed on a pair: retry it on another one, or settle it."""
        failed = (sl.last_path.removeprefix("rdma:").partition("->")[0], sl.remote)
        self._note_failure(failed)
        policy = self.options.retry
        if self._closed or sl.attempt >= policy.max_retries:
            settle_failed(sl, cause, timeout=timeout)
            return
        pairs = self._pairs(sl.lbuf, sl.target.info.rdma[sl.bi])
        now = time.monotonic()
        others = [p for p in pairs if p != failed]
        healthy = [p for p in others if self._paused.get(p, 0.0) <= now]
        choice = (healthy or others or pairs)
        if not choice:
            settle_failed(sl, cause, timeout=timeout)
            return
        local, remote = choice[sl.attempt % len(choice)]
        sl.attempt += 1
        sl.remote = remote
        sl.batch.add_retries(1)
        _log.info("RDMA: retrying a slice of %d bytes on %s->%s after: %s", sl.length, local,
                  remote, cause)
        self._posters[local].submit([sl])

    def _note_failure(self, pair: tuple[str, str]) -> None:
        with self._lock:
            count = self._failures.get(pair, 0) + 1
            if count >= self.options.retry.pause_after:
                self._paused[pair] = time.monotonic() + self.options.retry.pause_s
                count = 0
            self._failures[pair] = count

    def _open(self, nic: NicContext, sl: Slice) -> Connection:
        """Create a QP on ``nic``, exchange it with the target's service, connect it."""
        published = sl.target.info.rdma[sl.bi]
        addresses = [str(a) for a in published.get("cm", ())]
        qp, mine = new_qp(nic, nic.window)
        sock = None
        try:
            peer, sock = request_qp(addresses, token=self._token, initiator=self._engine_name,
                                    target_nic=sl.remote, mine=mine,
                                    timeout_s=min(self.options.timeout_s, 10.0))
            connect_qp(nic, qp, mine, peer, self.options)
        except BaseException:
            qp.close()
            if sock is not None:
                sock.close()
            raise
        conn = Connection((sl.target.info.engine, sl.remote), nic, sl.remote, qp, sock,
                          nic.window)
        _log.info("RDMA QP %s: %s -> %s of %s (window %d)", mine.qpn, nic.name, sl.remote,
                  sl.target.info.engine, nic.window)
        return conn

    # -- state and teardown ------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters: WRs posted, completions matched, stale completions ignored, QPs open
        (as initiator) and served (as target)."""
        posters = list(self._posters.values())
        return {"posted": sum(p.posted for p in posters),
                "completed": sum(p.completed for p in posters),
                "stale": sum(p.stale for p in posters),
                "connections": sum(p.connections for p in posters),
                "served": self._server.connections if self._server is not None else 0}

    def close(self) -> None:
        """Fail pending slices, drain and destroy every QP, deregister every MR, close the
        ports (reverse order, first error kept). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for poster in self._posters.values():
            poster.stop()
        if self._server is not None:
            self._server.close()
        self._registry.close()
        self._close_nics()

    def _close_nics(self) -> None:
        for nic in reversed(list(self._nics.values())):
            nic.close()


def rdma_probe(options: RdmaOptions | None = None) -> Probe:
    """Which ports the rdma transport would use here, or why none (never raises)."""
    opts = options or RdmaOptions()
    try:
        opts.check()
        return devices.probe(opts)
    except UsageError as exc:
        return Probe((), (), exc.cause, exc.hint)


def rdma_unavailable_reason(devices_wanted: Sequence[str] = ()) -> str | None:
    """Why RDMA cannot be used here, or ``None`` when some usable port exists."""
    return rdma_probe(RdmaOptions(nics=tuple(devices_wanted))).reason
