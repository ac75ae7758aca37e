"""The transfer engine: register segments, publish them, move batches of READ/WRITE requests.

Typical use (see ``docs/transfer.md``)::

    with TransferEngine("prefill-0", metadata="file:///var/lib/kvctl") as engine:
        engine.register_segment("kv-0", 1 << 30)              # shm, published with a lease
        target = engine.open_segment("decode-0.kv")           # from the metadata service
        batch = engine.allocate_batch(128)
        engine.submit(batch, [TransferRequest(OpCode.WRITE, "kv-0", 0,
                                              "decode-0.kv", 0, 1 << 20)], notify=b"done:42")
        result = engine.wait(batch, timeout_s=10)
        engine.free_batch(batch)

Transport choice is per target: explicit (``shm``, ``tcp``, ``rdma``) or ``auto`` (shm on the
same host, rdma when both ends have it, else tcp); the choice is logged and shown in every
request's status.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

from kvctl.errors import AuthError, KvctlError, TransferError, UsageError
from kvctl.metadata import LeaseKeeper, MetadataClient, key_prefix, open_metadata
from kvctl.metadata.base import service_host
from kvctl.net.advertise import advertised_addresses, default_listen
from kvctl.net.bind import is_loopback, parse_listen
from kvctl.net.framing import FrameError
from kvctl.transfer import protocol
from kvctl.transfer.admin import list_segments, lookup_segment, segment_key
from kvctl.transfer.batch import Batch, BatchResult, OpCode, RequestStatus, TransferRequest
from kvctl.transfer.errors import (
    OutOfRangeError,
    SegmentNotFoundError,
    TransferFailedError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from kvctl.transfer.paths import RetryPolicy
from kvctl.transfer.segments import (
    BufferInfo,
    LocalSegment,
    SegmentInfo,
    create_file_segment,
    create_gpu_segment,
    create_shm_segment,
    find_buffer,
    host_id,
    validate_name,
    wrap_memory,
)
from kvctl.transfer.server import TargetServer
from kvctl.transfer.transports import rdma as rdma_mod
from kvctl.transfer.transports.base import Item, RemoteSegment, Transport
from kvctl.transfer.transports.shm import ShmTransport
from kvctl.transfer.transports.tcp import DEFAULT_SPIN_S, TcpTransport

if TYPE_CHECKING:
    from kvctl.metrics import ServerMetrics

_log = logging.getLogger("kvctl.transfer")
#: Unread notifications kept, by count and by bytes (the oldest go first beyond).
MAX_INBOX = 4096
MAX_INBOX_BYTES = 16 << 20

TRANSPORTS = ("auto", "shm", "tcp", "rdma")
#: How long close() waits for transfers in flight on its segments before it leaves their
#: memory to the last of them, seconds (a 128 MiB shm copy takes about 0.05 s).
CLOSE_WAIT_S = 5.0

_Plan = tuple[dict[tuple[str, str, OpCode], tuple[RemoteSegment, list[Item]]], list[int],
              list[int], list[LocalSegment], list[str]]


@dataclasses.dataclass(frozen=True)
class Notification:
    """A short message a peer sent when its batch to one of our segments completed.

    Attributes:
        sender: name of the sending engine.
        message: the bytes it attached (at most 64 KiB).
        received_at: ``time.time()`` when it arrived.
    """

    sender: str
    message: bytes
    received_at: float


@dataclasses.dataclass(frozen=True)
class SegmentHandle:
    """An opened (or registered) segment as callers see it.

    Attributes:
        name: segment name.
        kind: ``shm``, ``file``, ``gpu`` or ``host``.
        engine: engine serving it.
        same_host: whether it lives on this host.
        transport: transport this engine uses for it (``shm``, ``tcp``, ``rdma``).
        buffers: its buffers (offset, length, location).
        addresses: target server addresses.
        size_bytes: extent of its address space.
    """

    name: str
    kind: str
    engine: str
    same_host: bool
    transport: str
    buffers: tuple[BufferInfo, ...]
    addresses: tuple[str, ...]
    size_bytes: int


class TransferEngine:
    """An embedded transfer engine (thread-safe; a context manager; ``close()`` idempotent).

    Args:
        name: this engine's name (unique in the cluster; shown to peers as notification sender).
        metadata: metadata service URL (``memory://``, ``file:///dir``, ...) or an open client
            (then the caller keeps ownership).
        cluster_id: namespace under ``kvctl/``.
        transport: ``auto`` (default), ``shm``, ``tcp`` or ``rdma``.
        listen: ``HOST:PORT`` for the target server (started on the first registration);
            by default any free port on loopback, or, when the metadata service is on
            another host, on the local address that routes to it (peers there must reach
            the published address).
        advertise: addresses published for peers, ``HOST`` (the bound port) or
            ``HOST:PORT``; by default the bound address, or every interface address when
            bound to ``0.0.0.0``/``::`` (see :mod:`kvctl.net.advertise`). Several addresses
            give initiators several paths.
        token: shared secret for challenge-response authentication (``None``: open).
        connections_per_peer: TCP paths (connections + worker threads) per target.
        nics: local IP addresses to spread TCP connections over (e.g. topo's ranking for the
            buffer's location); empty lets the OS route.
        slice_bytes: requests above this are sliced over parallel paths.
        retry: retry/pause policy for failed slices and paths.
        timeout_s: a request whose path makes no progress for this long becomes TIMEOUT.
        lease_ttl_s: TTL of the lease published segments live under (a
            :class:`~kvctl.metadata.LeaseKeeper` renews it every third).
        rdma_devices: RDMA NICs to use and nothing else (``mlx5_0`` or ``mlx5_0:1``, in
            order of preference; default: every usable port, chosen per buffer by topo's
            ranking).
        rdma: further RDMA settings (GID index, hop limit, ranking, ...; see
            :class:`~kvctl.transfer.transports.rdma.RdmaOptions`); by default
            ``timeout_s`` and ``retry`` are the engine's.
        on_notification: called from the server thread for each notification (else queued
            for :meth:`get_notification`).
        max_frame_bytes: largest frame the target server accepts.
        spin_s: how long a calling thread polls for a tcp target's reply before it sleeps
            (see :class:`~kvctl.net.framing.Poller`); 0 never polls.
        metrics: where the target server counts the READs and WRITEs it serves.
    """

    def __init__(
        self,
        name: str,
        metadata: str | MetadataClient = "memory://",
        *,
        cluster_id: str = "",
        transport: str = "auto",
        listen: str | None = None,
        advertise: Sequence[str] = (),
        token: str | None = None,
        connections_per_peer: int = 4,
        nics: Sequence[str] = (),
        slice_bytes: int = 1 << 20,
        retry: RetryPolicy | None = None,
        timeout_s: float = 30.0,
        lease_ttl_s: float = 10.0,
        rdma_devices: Sequence[str] = (),
        rdma: rdma_mod.RdmaOptions | None = None,
        on_notification: Callable[[Notification], None] | None = None,
        max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES,
        spin_s: float = DEFAULT_SPIN_S,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.metrics = metrics
        if transport not in TRANSPORTS:
            raise UsageError(f"unknown transport {transport!r}",
                             f"known transports: {', '.join(TRANSPORTS)}")
        if slice_bytes <= 0 or timeout_s <= 0 or lease_ttl_s <= 0:
            raise UsageError("slice_bytes, timeout_s and lease_ttl_s must be positive",
                             "pass positive values")
        self.transport = transport
        self.cluster_id = cluster_id
        self._prefix = key_prefix(cluster_id)
        self._advertise = tuple(advertise)
        self._token = token
        self._max_frame_bytes = max_frame_bytes
        self._lease_ttl_s = lease_ttl_s
        self._on_notification = on_notification
        self._own_metadata = isinstance(metadata, str)
        self.metadata = (open_metadata(metadata, token=token) if isinstance(metadata, str)
                         else metadata)
        peers = service_host(self.metadata.url)
        if listen is None:
            listen = default_listen(peers)
        elif peers is not None and not self._advertise and is_loopback(
                parse_listen(listen)[0]) and not is_loopback(peers):
            _log.warning("engine %s listens on %s but publishes in %s on another host: "
                         "peers there cannot reach it (listen on 0.0.0.0 or this host's "
                         "address, or advertise one)", name, listen, self.metadata.url)
        self._listen = parse_listen(listen)
        self.host = host_id()
        self._lock = threading.RLock()
        self._segments: dict[str, LocalSegment] = {}
        self._by_id: dict[int, LocalSegment] = {}
        self._infos: dict[str, SegmentInfo] = {}
        self._next_id = 1
        self._remote: dict[str, RemoteSegment] = {}
        self._server: TargetServer | None = None
        self._keeper: LeaseKeeper | None = None
        self._inbox: queue.SimpleQueue[Notification] = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()
        self._inbox_bytes = 0
        #: unread notifications dropped because the inbox was full
        self.notifications_dropped = 0
        self._closed = False

        self._rdma_reason: str | None = "not requested"
        self._rdma_hint: str | None = None
        self._rdma: rdma_mod.RdmaTransport | None = None
        if transport in ("auto", "rdma"):
            options = rdma or rdma_mod.RdmaOptions(timeout_s=timeout_s,
                                                   retry=retry or RetryPolicy())
            if rdma_devices:
                options = dataclasses.replace(options, nics=tuple(rdma_devices))
            try:
                self._rdma = rdma_mod.RdmaTransport(
                    engine_name=self.name, token=token, listen_host=self._listen[0],
                    advertise=self._advertise, options=options)
                self._rdma_reason = None
            except TransportUnavailableError as exc:
                self._rdma_reason, self._rdma_hint = exc.cause, exc.hint
                if transport == "rdma":
                    raise TransportUnavailableError(
                        f"RDMA unavailable: {exc.cause}",
                        f"{exc.hint or 'check ibv_devinfo -v'}; or use transport 'auto' to "
                        "fall back to tcp/shm") from None
                _log.info("RDMA unavailable: %s; auto transport will use shm or tcp",
                          exc.cause)
        self._tcp = TcpTransport(
            token=token, connections_per_peer=connections_per_peer, local_addresses=nics,
            slice_bytes=slice_bytes, retry=retry, timeout_s=timeout_s, spin_s=spin_s)
        self._shm = ShmTransport()
        self._transports: dict[str, Transport] = {"tcp": self._tcp, "shm": self._shm}
        if self._rdma is not None:
            self._transports["rdma"] = self._rdma

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine(name={self.name!r}, transport={self.transport!r})"

    @property
    def rdma_unavailable_reason(self) -> str | None:
        """Why RDMA is not used by this engine (``None`` when it is available)."""
        return self._rdma_reason

    @property
    def rdma_unavailable_hint(self) -> str | None:
        """How to make RDMA available (``None`` when it is, or was not requested)."""
        return self._rdma_hint

    @property
    def advertised(self) -> tuple[str, ...]:
        """``HOST:PORT`` addresses published for peers (empty before the first segment)."""
        if self._server is None:
            return ()
        return advertised_addresses(self._server.host, self._server.port, self._advertise)

    @property
    def address(self) -> str | None:
        """The target server's ``host:port``, once a segment is registered."""
        return self._server.address if self._server is not None else None

    def close(self) -> None:
        """Stop heartbeats, withdraw published segments, stop transports and the server.

        Requests still queued fail with "transfer engine closed". Safe to call twice.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._keeper is not None:
            self._keeper.stop()  # revokes the lease: our entries vanish now
        self._infos.clear()
        for transport in self._transports.values():
            transport.close()
        if self._server is not None:
            self._server.close()
        # Transfers still running (a copy in a caller's thread, a reply being received)
        # hold their segment: it is unmapped when they end, never under them.
        deadline = time.monotonic() + CLOSE_WAIT_S
        for seg in list(self._segments.values()):
            if not seg.retire(deadline - time.monotonic()):
                _log.warning("segment %s closed with %d transfer(s) in flight: its memory "
                             "goes when they end", seg.name, seg.inflight)
        self._segments.clear()
        self._by_id.clear()
        for remote in self._remote.values():
            for transport in self._transports.values():
                transport.forget(remote)
        if self._own_metadata:
            self.metadata.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer engine {self.name!r} is closed", "open a new engine")

    # ------------------------------------------------------------------ segments

    def register_segment(self, name: str, size_bytes: int | Sequence[int], *,
                         kind: str = "shm", path: Path | None = None,
                         location: str = "cpu:0") -> SegmentHandle:
        """Create, serve and publish a segment.

        Args:
            name: segment name, unique in the cluster.
            size_bytes: size of its single buffer, or a list of buffer sizes.
            kind: ``shm`` (host DRAM in shared memory), ``file`` (needs ``path``) or ``gpu``.
            path: the file backing a ``file`` segment.
            location: ``cpu:N`` for shm; ``cuda:N`` selects the device for ``gpu``.

        Raises:
            UsageError: bad name/size/kind, or the name is already registered or published.
            UnavailableError: shared memory, the file or the GPU cannot be used.
        """
        self._check_open()
        validate_name(name)
        if kind == "shm":
            factory: Callable[[], LocalSegment] = lambda: create_shm_segment(  # noqa: E731
                name, size_bytes, location=location)
        elif kind == "file":
            if path is None:
                raise UsageError(f"file segment {name!r} needs a path",
                                 "pass path= (or --path) on a local disk")
            factory = lambda: create_file_segment(name, path, size_bytes)  # noqa: E731
        elif kind == "gpu":
            index = int(location.partition(":")[2] or 0) if location.startswith("cuda") else 0
            factory = lambda: create_gpu_segment(name, size_bytes, device_index=index)  # noqa: E731
        else:
            raise UsageError(f"unknown segment kind {kind!r}", "use shm, file or gpu")
        self._reserve_name(name)
        return self._add(factory())

    def register_memory(self, name: str, buffers: Sequence[Any], *,
                        location: str = "cpu:0") -> SegmentHandle:
        """Register caller-owned writable buffers (no copy); served over TCP (and RDMA)."""
        self._check_open()
        self._reserve_name(name)
        return self._add(wrap_memory(name, buffers, location=location))

    def _reserve_name(self, name: str) -> None:
        if name in self._segments:
            raise UsageError(f"segment {name!r} is already registered in this engine",
                             "pick another name or unregister it first")
        raw = self.metadata.get(segment_key(self.cluster_id, name))
        if raw is not None:
            raise UsageError(
                f"segment {name!r} is already published in {self.metadata.url}",
                "pick another name, or remove a stale entry with "
                f"'kvctl segment rm {name}' if its process is gone")

    def _add(self, seg: LocalSegment) -> SegmentHandle:
        try:
            with self._lock:
                self._check_open()
                if self._server is None:
                    host, port = self._listen
                    self._server = TargetServer(
                        self._by_id.get, self._deliver, host=host, port=port,
                        token=self._token, max_frame_bytes=self._max_frame_bytes,
                        metrics=self.metrics)
                seg_id = self._next_id
                self._next_id += 1
                offered = ["tcp"]
                if seg.kind in ("shm", "file"):
                    offered.insert(0, "shm")
                rdma: tuple[dict[str, Any], ...] = ()
                if self._rdma is not None and seg.kind in ("shm", "host", "gpu"):
                    published = self._register_rdma(seg)
                    if published is not None:
                        rdma = published
                        offered.append("rdma")
                info = SegmentInfo(
                    name=seg.name, kind=seg.kind, engine=self.name, host=self.host,
                    pid=os.getpid(), addresses=self.advertised,
                    seg_id=seg_id, transports=tuple(offered), buffers=seg.buffer_infos(),
                    auth=self._token is not None, rdma=rdma)
                self._segments[seg.name] = seg
                self._by_id[seg_id] = seg
                self._infos[seg.name] = info
                self._publish(info)
        except BaseException:
            if seg.name not in self._segments:
                seg.close()
            raise
        _log.info("registered segment %s (%s, %d bytes) at %s", seg.name, seg.kind,
                  seg.size_bytes, ",".join(info.addresses))
        return self._handle(info, transport="local")

    def _register_rdma(self, seg: LocalSegment) -> tuple[dict[str, Any], ...] | None:
        """RDMA memory regions for ``seg`` (``None``: not an RDMA target). A registration
        failure (e.g. the memlock limit) is fatal with transport ``rdma``; with ``auto`` it
        turns RDMA off for this engine, logged with its fix, and tcp serves."""
        rdma = self._rdma
        if rdma is None:
            return None
        try:
            return rdma.register(seg)
        except TransportUnavailableError as exc:
            if self.transport == "rdma":
                raise
            self._degrade_rdma(exc)
            return None

    def _degrade_rdma(self, exc: TransportUnavailableError) -> None:
        """Stop offering and using RDMA (auto transport), republishing what offered it."""
        rdma, self._rdma = self._rdma, None
        self._rdma_reason, self._rdma_hint = exc.cause, exc.hint
        self._transports.pop("rdma", None)
        _log.warning("RDMA unavailable: %s; auto transport will use shm or tcp (%s)",
                     exc.cause, exc.hint)
        for name, info in list(self._infos.items()):
            if "rdma" in info.transports:
                info = dataclasses.replace(
                    info, transports=tuple(t for t in info.transports if t != "rdma"), rdma=())
                self._infos[name] = info
                self._publish(info)
        for name, remote in list(self._remote.items()):
            if remote.transport == "rdma":
                del self._remote[name]
        if rdma is not None:
            rdma.close()

    def _publish(self, info: SegmentInfo) -> None:
        if self._keeper is None:
            self._keeper = LeaseKeeper(self.metadata, self._lease_ttl_s,
                                       name=f"kvctl-lease-{self.name}").start()
        key = segment_key(self.cluster_id, info.name)
        self._keeper.publish(key, info.to_json(token=self._token, key=key))

    def unregister_segment(self, name: str) -> None:
        """Withdraw and release a segment registered here.

        Raises:
            SegmentNotFoundError: no such segment is registered in this engine.
            BusyError: transfers are in flight on it (local or served).
        """
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                raise SegmentNotFoundError(f"segment {name!r} is not registered in engine "
                                           f"{self.name!r}", "see engine.local_segments()")
            if seg.inflight > 0:
                seg.close()  # raises BusyError while in flight
            if self._rdma is not None:
                self._rdma.unregister(seg)  # MRs go before the memory does
            seg.close()
            info = self._infos.pop(name)
            del self._segments[name]
            self._by_id.pop(info.seg_id, None)
        if self._keeper is not None:
            self._keeper.unpublish(segment_key(self.cluster_id, name))
        remote = self._remote.pop(name, None)
        if remote is not None:
            for transport in self._transports.values():
                transport.forget(remote)

    def local_view(self, name: str, buffer_index: int = 0) -> memoryview:
        """A writable byte view of buffer ``buffer_index`` of local segment ``name``.

        This is the memory transfers read from and land in (fill KV blocks here).

        Raises:
            SegmentNotFoundError: no such local segment or buffer.
            UsageError: the buffer is a file or GPU memory (not directly addressable).
        """
        seg = self._segments.get(name)
        if seg is None or not 0 <= buffer_index < len(seg.buffers):
            raise SegmentNotFoundError(
                f"local segment {name!r} buffer {buffer_index} is not registered in engine "
                f"{self.name!r}", "see engine.local_segments()")
        view = seg.buffers[buffer_index].view
        if view is None:
            raise UsageError(f"segment {name!r} is {seg.kind} memory, not addressable here",
                             "move bytes with transfers, or use a shm/host segment")
        return view

    def read_local(self, name: str, offset: int, dest: memoryview) -> None:
        """Copy ``len(dest)`` bytes at segment ``offset`` of local segment ``name`` into
        ``dest``, whatever its kind (GPU memory is copied through pinned host memory, a
        file is read).

        Raises:
            SegmentNotFoundError: no such local segment.
            UsageError: the range is outside the segment or spans two buffers.
        """
        buf, rel = self._local_segment(name).locate(offset, dest.nbytes)
        buf.read_into(rel, dest)

    def write_local(self, name: str, offset: int, src: memoryview) -> None:
        """Copy ``src`` to segment ``offset`` of local segment ``name``, whatever its kind
        (the counterpart of :meth:`read_local`).

        Raises:
            SegmentNotFoundError: no such local segment.
            UsageError: the range is outside the segment or spans two buffers.
        """
        buf, rel = self._local_segment(name).locate(offset, src.nbytes)
        buf.write_from(rel, src)

    def _local_segment(self, name: str) -> LocalSegment:
        seg = self._segments.get(name)
        if seg is None:
            raise SegmentNotFoundError(
                f"local segment {name!r} is not registered in engine {self.name!r}",
                "see engine.local_segments()")
        return seg

    def hold_local(self, name: str, offset: int, length: int
                   ) -> tuple[memoryview, Callable[[], None]] | None:
        """A view of ``length`` bytes at ``offset`` of local segment ``name``, counted as a
        transfer in flight (the segment cannot be unregistered) until the returned release
        is called; for serving this memory in-process, as the target server does over
        the wire.

        ``None`` when the segment is not registered here (or is being removed), the range
        is not inside one of its buffers, or that buffer is not directly addressable.
        """
        seg = self._segments.get(name)
        if seg is None:
            return None
        seg.acquire()
        try:
            if not seg.closed:
                buf, rel = seg.locate(offset, length)
                if buf.view is not None:
                    return buf.view[rel:rel + length], seg.release
        except OutOfRangeError:
            pass
        except BaseException:
            seg.release()
            raise
        seg.release()
        return None

    def local_segments(self) -> list[SegmentHandle]:
        """Segments registered in this engine."""
        with self._lock:
            return [self._handle(info, transport="local") for info in self._infos.values()]

    def list_segments(self) -> list[SegmentInfo]:
        """Every segment published in the metadata service (this cluster id)."""
        return list_segments(self.metadata, self.cluster_id)

    def lookup(self, name: str) -> SegmentInfo:
        """The published descriptor of ``name``.

        Raises:
            SegmentNotFoundError: nothing is published under that name.
            MetadataError: the metadata service could not answer.
        """
        return lookup_segment(self.metadata, self.cluster_id, name, token=self._token)

    def open_segment(self, name: str) -> SegmentHandle:
        """Resolve a (usually remote) segment and pick its transport; cached per name.

        Raises:
            SegmentNotFoundError: nothing is published under that name.
            TransportUnavailableError: the explicit transport cannot reach it.
        """
        self._check_open()
        remote = self._remote.get(name)
        if remote is None:
            remote = self._resolve(name)
        return self._handle(remote.info, transport=remote.transport)

    def refresh_segment(self, name: str) -> SegmentHandle:
        """Re-read ``name``'s descriptor (e.g. after its target restarted) and re-pick its
        transport, dropping the cached mappings of the old descriptor.

        Raises:
            SegmentNotFoundError: nothing is published under that name.
        """
        self._check_open()
        remote = self._resolve(name)
        return self._handle(remote.info, transport=remote.transport)

    def _resolve(self, name: str) -> RemoteSegment:
        info = self.lookup(name)
        if self._token is None and info.auth:
            raise AuthError(
                f"segment {name!r} (engine {info.engine} at {', '.join(info.addresses)}) "
                "requires a token, and this side has none",
                "set the same KVCTL_TOKEN (or common.token) on both hosts")
        if self._token is not None and not info.auth:
            # One side configured, the other not: say so now, not as a late auth failure.
            raise AuthError(
                f"segment {name!r} (engine {info.engine} at {', '.join(info.addresses)}) "
                "is served without a token, but this side has one",
                "set the same KVCTL_TOKEN (or common.token) on both hosts, or unset it here")
        transport = self._choose(info)
        remote = RemoteSegment(info, transport)
        with self._lock:
            old = self._remote.get(name)
            self._remote[name] = remote
        if old is not None:
            for t in self._transports.values():
                t.forget(old)
        return remote

    def _choose(self, info: SegmentInfo) -> str:
        same = info.host == self.host
        wanted = self.transport
        if wanted == "auto":
            if same and "shm" in info.transports:
                choice, why = "shm", "same host"
            elif "rdma" in info.transports and self._rdma is not None:
                choice, why = "rdma", "both ends have RDMA"
            else:
                choice = "tcp"
                why = ("target offers RDMA but RDMA unavailable here: " + str(self._rdma_reason)
                       if "rdma" in info.transports else "different host, no RDMA")
            _log.info("segment %s: transport %s (%s)", info.name, choice, why)
            return choice
        if wanted not in info.transports:
            raise TransportUnavailableError(
                f"segment {info.name!r} does not offer transport {wanted!r} "
                f"(offers {', '.join(info.transports)})",
                "use transport 'auto' or one the target offers")
        if wanted == "shm" and not same:
            raise TransportUnavailableError(
                f"segment {info.name!r} is on another host; shm needs the same host",
                "use transport 'tcp', 'rdma' or 'auto'")
        return wanted

    def _handle(self, info: SegmentInfo, *, transport: str) -> SegmentHandle:
        return SegmentHandle(info.name, info.kind, info.engine, info.host == self.host,
                             transport, info.buffers, info.addresses, info.size_bytes)

    # ------------------------------------------------------------------ batches

    def allocate_batch(self, capacity: int) -> Batch:
        """A batch with room for ``capacity`` requests."""
        self._check_open()
        return Batch(capacity, self)

    def submit(self, batch: Batch, requests: Sequence[TransferRequest], *,
               notify: bytes | None = None) -> None:
        """Validate ``requests`` and start moving them; returns without waiting.

        Every request is checked (local and target segments exist, ranges inside one buffer
        on each side) before anything moves; one bad request rejects the whole submission.

        Args:
            batch: from :meth:`allocate_batch`, with enough free slots.
            requests: the requests, appended to the batch in order.
            notify: sent to the engine serving each target segment once all of these
                requests completed (not sent if any failed).

        Raises:
            SegmentNotFoundError: a local or target segment does not exist.
            OutOfRangeError: a range is outside its segment's buffers.
            UsageError: bad length, full or freed batch, oversized notification.
            TransportUnavailableError: a target cannot be reached with the chosen transport.
        """
        self._submit(batch, requests, notify, waiting=False)

    def run(self, batch: Batch, requests: Sequence[TransferRequest], *,
            timeout_s: float | None = None, notify: bytes | None = None) -> BatchResult:
        """:meth:`submit` then :meth:`wait`, for a caller that blocks anyway: transports may
        move the requests in the calling thread. Small tcp submissions (up to
        ``inline_bytes``, one frame per path) are sent and answered here on spare
        connections, and shm copies run here: no hand-off to a worker thread, which on a
        4 KiB read costs about as much as the round trip itself. Failures and statuses are
        exactly those of ``submit``; a connection that breaks is retried on the worker
        paths.

        Raises:
            the errors of :meth:`submit` and :meth:`wait`.
        """
        self._submit(batch, requests, notify, waiting=True)
        return batch.wait(timeout_s)

    def _submit(self, batch: Batch, requests: Sequence[TransferRequest],
                notify: bytes | None, *, waiting: bool) -> None:
        self._check_open()
        if batch._owner is not self:
            raise UsageError("batch belongs to another engine", "allocate it from this engine")
        if notify is not None and len(notify) > protocol.MAX_NOTIFY_BYTES - 256:
            raise UsageError(f"notification of {len(notify)} bytes is too long",
                             "keep notifications under 64 KiB")
        with batch._submit_lock:  # slots are numbered in submission order
            start = batch.submitted
            plan = self._plan(start, requests)
            if plan is None:
                return
            groups, lengths, pieces, locals_, names = plan
            on_done = None
            if notify is not None:
                targets = {id(g[0]): g[0].info for g in groups.values()}
                on_done = self._notifier(batch, list(targets.values()), notify)
            counts: dict[LocalSegment, int] = {}
            for seg in locals_:
                counts[seg] = counts.get(seg, 0) + 1
            for seg, count in counts.items():
                seg.acquire(count)
            if self._closed or any(seg.closed for seg in counts):
                for seg, count in counts.items():
                    seg.release(count)
                self._check_open()
                raise SegmentNotFoundError("a local segment of this submission was "
                                           "unregistered while it was being submitted",
                                           "register it again, or submit to another")
            try:
                batch._reserve(lengths, pieces, locals_, names, on_done)
            except BaseException:
                for seg, count in counts.items():
                    seg.release(count)
                raise
            for (tname, _, op), (remote, items) in groups.items():
                transport = self._transports[tname]
                if waiting:
                    transport.execute_waiting(batch, op, remote, items)
                else:
                    transport.execute(batch, op, remote, items)

    def _plan(self, start: int, requests: Sequence[TransferRequest]) -> _Plan | None:
        """Validate requests and group them per (transport, target, op); the hot path."""
        segments = self._segments
        remotes = self._remote
        slice_of = {name: getattr(t, "slice_bytes", 0) for name, t in self._transports.items()}
        groups: dict[tuple[str, str, OpCode], tuple[RemoteSegment, list[Item]]] = {}
        lengths: list[int] = []
        pieces: list[int] = []
        locals_: list[LocalSegment] = []
        names: list[str] = []
        last_lname = last_tname = None
        lseg = cast("LocalSegment", None)  # both set on the first request
        remote = cast("RemoteSegment", None)
        litems: list[Item] = []
        last_key: tuple[str, str, OpCode] | None = None
        slice_bytes = 0
        for k, req in enumerate(requests):
            length = req.length
            if length <= 0:
                raise UsageError(f"request {k} has length {length}", "use lengths above 0")
            if req.local_segment != last_lname:
                found = segments.get(req.local_segment)
                if found is None:
                    raise SegmentNotFoundError(
                        f"request {k}: local segment {req.local_segment!r} is not registered "
                        f"in engine {self.name!r}", "register it with register_segment first")
                lseg = found
                last_lname = req.local_segment
            if req.target_segment != last_tname:
                remote = remotes.get(req.target_segment) or self._resolve(req.target_segment)
                last_tname = req.target_segment
                slice_bytes = slice_of[remote.transport]
            lbuf, lrel = lseg.locate(req.local_offset, length)
            toff = req.target_offset
            bi, trel = find_buffer(remote.offsets, remote.lengths, toff, length,
                                   segment=remote.info.name)
            tname = remote.transport
            key = (tname, remote.info.name, req.op)
            if key != last_key:
                group = groups.get(key)
                if group is None:
                    group = groups[key] = (remote, [])
                litems = group[1]
                last_key = key
            litems.append((start + k, lbuf, lrel, bi, trel, toff, length))
            lengths.append(length)
            pieces.append(-(-length // slice_bytes) if slice_bytes else 1)
            locals_.append(lseg)
            names.append(tname)
        if not lengths:
            return None
        return groups, lengths, pieces, locals_, names

    def _notifier(self, batch: Batch, targets: list[SegmentInfo], message: bytes
                  ) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            if not ok:
                return
            for info in targets:
                try:
                    self._tcp.notify(info, self.name, message)
                except (OSError, KvctlError) as exc:
                    cause = getattr(exc, "cause", None) or str(exc)
                    text = f"notification to {info.engine} ({info.name}) failed: {cause}"
                    _log.warning("%s", text)
                    batch.notify_errors.append(text)

        return done

    def status(self, batch: Batch) -> list[RequestStatus]:
        """Per-request status of ``batch`` (PENDING, COMPLETED, FAILED with cause, TIMEOUT)."""
        return batch.statuses()

    def wait(self, batch: Batch, timeout_s: float | None = None) -> BatchResult:
        """Block until every request of ``batch`` is settled and its notifications sent.

        Raises:
            TransferTimeoutError: ``timeout_s`` passed first (requests stay in flight).
        """
        return batch.wait(timeout_s)

    def free_batch(self, batch: Batch) -> None:
        """Release ``batch``.

        Raises:
            BusyError: requests of the batch are still in flight.
        """
        batch._check_free()

    def transfer(self, requests: Sequence[TransferRequest], *, timeout_s: float | None = None,
                 notify: bytes | None = None) -> BatchResult:
        """Synchronous convenience: submit ``requests`` as one batch and wait.

        Raises:
            TransferFailedError: a request failed or timed out (cause of the first one).
            TransferTimeoutError: ``timeout_s`` passed before the batch settled.
        """
        batch = self.allocate_batch(max(1, len(requests)))
        result = self.run(batch, requests, timeout_s=timeout_s, notify=notify)
        self.free_batch(batch)
        if not result.ok:
            raise TransferFailedError(
                f"{result.failed + result.timed_out} of {result.total} request(s) failed: "
                f"{result.first_cause}", "see the cause; engine.status(batch) has details")
        return result

    def move_direct(self, op: OpCode, target_segment: str, target_offset: int,
                    local: memoryview) -> None:
        """Move one small request between ``local`` and a segment reached over tcp, in the
        calling thread: the fast path for a caller that moves one value and waits (a store
        get or put), without a batch's bookkeeping (about 0.1 ms of Python per request on
        the test VM, as much as the loopback round trip). ``local`` need not be registered:
        it is used only during the call. Nothing is retried here: on an error the caller
        runs the request as a batch, which retries on other paths.

        Raises:
            UsageError: the target is not reached over tcp, or ``local`` is empty or larger
                than the tcp transport's inline size.
            OutOfRangeError: the range is outside the target's buffers.
            SegmentNotFoundError: the target segment is not published.
            TransferError: the connection failed or the target refused.
        """
        self._check_open()
        remote = self._remote.get(target_segment) or self._resolve(target_segment)
        length = local.nbytes
        if remote.transport != "tcp":
            raise UsageError(f"segment {target_segment!r} is reached over "
                             f"{remote.transport}, not tcp", "submit a batch instead")
        if not 0 < length <= self._tcp.inline_bytes:
            raise UsageError(f"direct move of {length} bytes (1 to {self._tcp.inline_bytes})",
                             "submit a batch instead")
        find_buffer(remote.offsets, remote.lengths, target_offset, length,
                    segment=target_segment)
        self._tcp.move_direct(op, remote.info, target_offset, local)

    # ------------------------------------------------------------------ notifications

    def notify(self, target_segment: str, message: bytes) -> None:
        """Send ``message`` to the engine serving ``target_segment`` now.

        Raises:
            SegmentNotFoundError: the segment is not published.
            TransferFailedError: the target could not be reached or refused it.
        """
        remote = self._remote.get(target_segment) or self._resolve(target_segment)
        try:
            self._tcp.notify(remote.info, self.name, message)
        except (OSError, FrameError) as exc:
            cause = getattr(exc, "cause", None) or str(exc)
            raise TransferFailedError(f"notification to {remote.info.engine} failed: {cause}",
                                      "check that the target engine is running") from None

    def _deliver(self, sender: str, message: bytes) -> None:
        note = Notification(sender, message, time.time())
        if self._on_notification is not None:
            self._on_notification(note)
            return
        # Unread notifications are bounded: past the bound the oldest is dropped (and
        # counted), so a peer that floods us cannot grow this process without limit.
        with self._inbox_lock:
            while self._inbox.qsize() >= MAX_INBOX or (
                    self._inbox_bytes + len(message) > MAX_INBOX_BYTES and self._inbox.qsize()):
                try:
                    old = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._inbox_bytes -= len(old.message)
                self.notifications_dropped += 1
                if self.notifications_dropped in (1, 100, 10000):
                    _log.warning("engine %s: %d unread notification(s) dropped (the inbox "
                                 "keeps %d)", self.name, self.notifications_dropped, MAX_INBOX)
            self._inbox_bytes += len(message)
            self._inbox.put(note)

    def _took(self, note: Notification) -> Notification:
        with self._inbox_lock:
            self._inbox_bytes -= len(note.message)
        return note

    def get_notification(self, timeout_s: float | None = None) -> Notification:
        """The next notification received (waits up to ``timeout_s``; ``None``: forever).

        Raises:
            TransferTimeoutError: none arrived in time.
        """
        try:
            return self._took(self._inbox.get(timeout=timeout_s))
        except queue.Empty:
            raise TransferTimeoutError(f"no notification within {timeout_s:g} s",
                                       "check that the peer submits with notify=...") from None

    def drain_notifications(self) -> list[Notification]:
        """Every notification received and not yet taken, oldest first."""
        out: list[Notification] = []
        while True:
            try:
                out.append(self._took(self._inbox.get_nowait()))
            except queue.Empty:
                return out

