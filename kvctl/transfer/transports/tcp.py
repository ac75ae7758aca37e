"""``tcp``: the framed protocol of :mod:`kvctl.transfer.protocol` over persistent connections.

Per peer, a small set of *paths* (connections, each from a chosen local address/NIC) with one
worker thread each; socket calls release the GIL, so paths move data in parallel. A
submission is cut into frames: requests over ``slice_bytes`` are sliced, small ones are
coalesced so a batch becomes roughly one frame per path. A WRITE frame is sent with one
``sendmsg`` gather of header, entries and the local memoryviews; a READ reply is received
with ``recvmsg_into`` straight into the local memoryviews (no intermediate copies unless the
local buffer is a file or GPU memory). A frame that fails on a connection is retried on
another path; repeated failures pause a path (see :mod:`kvctl.transfer.paths`).

Small submissions of a caller that waits skip the workers (``TransferEngine.run`` and
``transfer``): when a submission of at most ``inline_bytes`` needs no more frames than there
are paths, the calling thread sends each frame on a spare connection of a different path
(same route as the path; kept for reuse, one set per concurrent caller) and then takes the
replies itself. A 4 KiB read costs one round trip
and no thread hand-off (the queue and condition wake-ups of the worker design cost about as
much as the round trip itself on loopback), and a 4 MiB read still moves as four 1 MiB
slices on four connections at once. A spare connection that breaks hands its frame to the
worker paths, which retry it as usual.

Timeouts use ``SO_RCVTIMEO``/``SO_SNDTIMEO`` on blocking sockets (no extra ``poll`` per call):
a stalled target turns the frame's requests into ``TIMEOUT`` and closes that connection.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import logging
import queue
import select
import socket
import struct
import threading
from collections.abc import Sequence

from kvctl.errors import AuthError, TransferError
from kvctl.net import auth
from kvctl.net.framing import (
    ConnectionClosedError,
    FrameError,
    Poller,
    recv_exact,
    recv_exact_into,
    recv_into_views,
    send_views,
    set_io_timeouts,
)
from kvctl.transfer import protocol as p
from kvctl.transfer.batch import SETTLE_FAILED, SETTLE_TIMEOUT, Batch, OpCode
from kvctl.transfer.paths import PathHealth, RetryPolicy, slice_ranges
from kvctl.transfer.segments import LocalBuffer, SegmentInfo, landing_views
from kvctl.transfer.transports.base import Item, RemoteSegment, Transport

_log = logging.getLogger("kvctl.transfer.tcp")

#: Frames smaller than this are not split further to spread a batch over paths.
MIN_FRAME_BYTES = 524288
#: Waited-for submissions up to this size (one frame per path) run in the calling thread.
DEFAULT_INLINE_BYTES = 4 << 20
#: How long a calling thread polls for a target's reply before it sleeps, seconds.
DEFAULT_SPIN_S = 200e-6
_U16 = struct.Struct("<H")

#: A piece of a request inside a frame: (slot, local buffer, local offset, target offset, length)
_Piece = tuple[int, LocalBuffer, int, int, int]


class _RemoteError(TransferError):
    """The target answered a frame with an error status (connection stays usable)."""


class _Frame:
    __slots__ = ("attempt", "batch", "op", "pieces", "seg_id", "target")

    def __init__(self, batch: Batch, op: OpCode, target: str, seg_id: int,
                 pieces: list[_Piece]) -> None:
        self.batch = batch
        self.op = op
        self.target = target
        self.seg_id = seg_id
        self.pieces = pieces
        self.attempt = 0

    def slots(self) -> list[int]:
        return [piece[0] for piece in self.pieces]


class _Conn(socket.socket):
    """A connection to a target, with the MACs its frames carry when a token is set."""

    mac: auth.FrameMac | None = None


def _mac_of(sock: socket.socket) -> auth.FrameMac | None:
    return sock.mac if isinstance(sock, _Conn) else None


def _sealed(sock: socket.socket, control: bytes, *more: bytes) -> list[bytes]:
    """``control`` (and ``more``) followed by the frame's MAC when the connection has one."""
    mac = _mac_of(sock)
    return [control, *more] if mac is None else [control, *more, mac.seal(control, *more)]


#: The longest error text a reply may carry (the target sends at most 4 KiB).
_MAX_ERROR_TEXT = 65536


def _check_reply_mac(sock: socket.socket, head: bytes | bytearray) -> bytes:
    """Check a reply's MAC; returns its error text (``b""`` for an OK reply, whose payload,
    a READ's data, the caller reads). The error text is under the MAC (issue 27.6: a relay
    could rewrite it), so it is read here, between the MAC and its check."""
    ftype, status, _, _, _, payload = p.HEADER.unpack(head)
    mac = _mac_of(sock)
    tail = recv_exact(sock, auth.FRAME_MAC_BYTES) if mac is not None else b""
    text = b""
    if ftype == p.FrameType.RESP and status != p.WireStatus.OK:
        if payload > _MAX_ERROR_TEXT:
            raise FrameError(f"error reply of {payload} bytes", None)
        text = bytes(recv_exact(sock, payload))
    if mac is not None and not mac.check(tail, head, text):
        raise FrameError("a reply failed its MAC check (altered, injected or replayed on the "
                         "way)", "the connection is closed and the request retried; if it "
                         "repeats, something between the hosts rewrites traffic")
    return text


def open_connection(host: str, port: int, *, token: str | None, local_address: str | None,
                    connect_timeout_s: float, timeout_s: float) -> socket.socket:
    """Connect, run the handshake and return a blocking socket with I/O timeouts set.

    With a token the target must prove it knows it too, and the connection's frames carry
    MACs (see :mod:`kvctl.transfer.protocol`).

    Raises:
        AuthError: the target requires a token we lack, refused ours, asks for none while
            we have one, or could not prove it knows the token.
        OSError / FrameError: the connection or handshake failed.
    """
    source = (local_address, 0) if local_address else None
    plain = socket.create_connection((host, port), timeout=connect_timeout_s,
                                     source_address=source)
    sock = _Conn(plain.family, plain.type, plain.proto, fileno=plain.detach())
    try:
        sock.settimeout(connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = recv_exact(sock, p.HELLO.size)
        magic, version, flags, nonce = p.HELLO.unpack(hello)
        if magic != p.MAGIC:
            raise FrameError(f"{host}:{port} is not a kvctl transfer target",
                             "check the segment's published address")
        if version != p.VERSION:
            raise FrameError(f"target {host}:{port} speaks transfer protocol version {version}, "
                             f"this kvctl {p.VERSION}", "run the same kvctl version on both ends")
        if flags & p.FLAG_AUTH and not token:
            raise AuthError(f"target {host}:{port} requires a token",
                            "set KVCTL_TOKEN (or common.token) to the cluster's shared token")
        if token and not flags & p.FLAG_AUTH:
            # A target that asks for no token proves nothing: an impostor, or a relay that
            # cleared the flag, would otherwise get this side's frames with no MACs.
            raise AuthError(f"target {host}:{port} asks for no token, but this side has one",
                            "set the same KVCTL_TOKEN (or common.token) on both hosts, or "
                            "unset it here")
        # From here a token means the target asked for one too (both refusals are above).
        client_nonce = auth.new_nonce() if token else bytes(auth.NONCE_BYTES)
        digest = auth.respond(token, bytes(nonce), p.AUTH_CONTEXT) if token \
            else bytes(auth.DIGEST_BYTES)
        sock.sendall(p.ANSWER.pack(p.MAGIC, p.VERSION, digest, client_nonce))
        _, code, proof = p.VERDICT.unpack(recv_exact(sock, p.VERDICT.size))
        if code == p.Verdict.AUTH_REFUSED:
            raise AuthError(f"target {host}:{port} refused our token",
                            "use the same KVCTL_TOKEN as the target")
        if code != p.Verdict.OK:
            raise FrameError(f"target {host}:{port} refused protocol version {p.VERSION}",
                             "run the same kvctl version on both ends")
        if token:
            expected = auth.server_proof(token, bytes(nonce), client_nonce, p.AUTH_CONTEXT)
            if not hmac.compare_digest(expected, bytes(proof)):
                raise AuthError(f"target {host}:{port} could not prove it knows the token",
                                "something answers at that address that is not the target "
                                "you meant (or it has another token); check the address")
            sock.mac = auth.FrameMac(auth.session_key(token, bytes(nonce), client_nonce,
                                                      p.AUTH_CONTEXT), client=True)
        set_io_timeouts(sock, timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _idle_and_open(sock: socket.socket) -> bool:
    """Whether an idle connection can carry the next request: nothing has arrived on it.
    A peer that closed or reset it while it sat in the pool (a restarted target, an idle
    cut by a middlebox) makes it readable (EOF or an error), and so does a reply nobody
    asked for; either way its stream is not ours to reuse. One ``poll`` with no wait, so
    a live connection costs a syscall, not its timeout."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return not poller.poll(0)
    except OSError:
        return False


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _Path:
    """One connection to a peer with its worker thread."""

    def __init__(self, peer: _Peer, index: int, address: str, local: str | None) -> None:
        self.peer = peer
        self.index = index
        self.address = address
        self.local = local
        self.name = f"{local or 'any'}->{address}#{index}"
        self.jobs: queue.SimpleQueue[_Frame | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.head = bytearray(p.HEADER.size)
        self.tags = itertools.count(1)
        self.thread = threading.Thread(target=self._run, name=f"kvctl-tcp-{index}", daemon=True)
        self.thread.start()

    def open(self) -> socket.socket:
        """A new connection over this path's route (address and local NIC)."""
        host, port = _split_address(self.address)
        t = self.peer.transport
        return open_connection(host, port, token=t.token, local_address=self.local,
                               connect_timeout_s=t.connect_timeout_s, timeout_s=t.timeout_s)

    def connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = self.open()
        return self.sock

    def drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _run(self) -> None:
        """Keep up to ``window`` frames in flight: send new ones, then take one reply."""
        window = self.peer.transport.window
        inflight: collections.deque[tuple[_Frame, int]] = collections.deque()
        stopping = False
        while True:
            new: list[_Frame] = []
            if not inflight:
                if stopping:
                    self.drop()
                    return
                frame = self.jobs.get()
                if frame is None:
                    self.drop()
                    return
                new.append(frame)
            while not stopping and len(inflight) + len(new) < window:
                try:
                    more = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                else:
                    new.append(more)
            self.peer.pump(self, inflight, new)


class _Peer:
    """The paths to one target server and the frames queued on them."""

    def __init__(self, transport: TcpTransport, addresses: Sequence[str]) -> None:
        self.transport = transport
        locals_: list[str | None] = list(transport.local_addresses) or [None]
        routes = list(itertools.product(addresses, locals_))
        count = max(transport.connections_per_peer, len(routes))
        self.paths = [_Path(self, i, *routes[i % len(routes)]) for i in range(count)]
        self.health = PathHealth([path.name for path in self.paths], transport.retry)
        self._control: socket.socket | None = None
        self._control_lock = threading.Lock()
        self.addresses = list(addresses)
        #: idle connections for inline frames, per path (same route as the path's own).
        self._spare: list[list[socket.socket]] = [[] for _ in self.paths]
        self._spare_lock = threading.Lock()
        #: how a calling thread waits for a reply (polls first; worker threads just block)
        self.poller = Poller(transport.spin_s)
        self._closed = False

    def dispatch(self, frame: _Frame, exclude: int = -1) -> None:
        self.paths[self.health.pick(exclude)].jobs.put(frame)

    def pump(self, path: _Path, inflight: collections.deque[tuple[_Frame, int]],
             new: list[_Frame]) -> None:
        """Send ``new`` frames on ``path``, then take the oldest reply; on a broken
        connection every frame in flight is retried elsewhere, timed out or failed."""
        try:
            sock = path.connect()
            while new:
                frame = new[0]
                inflight.append((frame, self._send(sock, path, frame)))
                new.pop(0)
            frame, tag = inflight[0]
            try:
                self._receive(sock, path.head, frame, tag)
            except _RemoteError as exc:  # the stream is still in sync: go on
                inflight.popleft()
                frame.batch.settle(frame.slots(), path=path.name, failure=SETTLE_FAILED,
                                   cause=exc.cause)
                return
            inflight.popleft()
            frame.batch.settle(frame.slots(), path=path.name)
            self.health.ok(path.index)
            return
        except (OSError, FrameError, AuthError) as exc:
            path.drop()
            self._failed(path, self._take(inflight, new), exc)

    def _failed(self, path: _Path, frames: list[_Frame],
                exc: OSError | FrameError | AuthError) -> None:
        """Settle or retry ``frames`` after their connection on ``path`` broke with ``exc``
        (the caller has closed it): auth failures fail, timeouts time out, other errors
        are retried on another path up to ``max_retries`` times (counted on the batch)."""
        t = self.transport
        if isinstance(exc, AuthError):
            for frame in frames:
                frame.batch.settle(frame.slots(), path=path.name, failure=SETTLE_FAILED,
                                   cause=exc.cause)
            return
        t.health_failed(self, path)
        if isinstance(exc, (TimeoutError, BlockingIOError)):
            for frame in frames:
                frame.batch.settle(
                    frame.slots(), path=path.name, failure=SETTLE_TIMEOUT,
                    cause=f"no answer from {frame.target} at {path.address} within "
                          f"{t.timeout_s:g} s (path {path.name})")
            return
        reason = getattr(exc, "cause", None) or getattr(exc, "strerror", None) or str(exc)
        for frame in frames:
            if frame.attempt < t.retry.max_retries and not t.closed:
                frame.attempt += 1
                frame.batch.add_retries(1)
                _log.info("frame to %s failed on path %s (%s); retry %d on another path",
                          frame.target, path.name, reason, frame.attempt)
                self.dispatch(frame, exclude=path.index)
                continue
            frame.batch.settle(
                frame.slots(), path=path.name, failure=SETTLE_FAILED,
                cause=f"transfer with {frame.target} failed after {frame.attempt + 1} "
                      f"attempt(s); last on path {path.name}: {reason}")

    def run_inline(self, frames: list[_Frame]) -> None:
        """Move ``frames`` in the calling thread, each on a spare connection of another
        path: send them all, then take the replies in order and settle. No worker thread is
        involved unless a connection breaks (its frame is then retried on the worker paths).
        """
        started: list[tuple[_Frame, _Path, socket.socket, int]] = []
        for frame in frames:
            index = self.health.pick()
            path = self.paths[index]
            sock = self._spare_of(index)
            try:
                if sock is None:
                    sock = path.open()
                started.append((frame, path, sock, self._send(sock, path, frame)))
            except (OSError, FrameError, AuthError) as exc:
                if sock is not None:
                    _close(sock)
                self._failed(path, [frame], exc)
        head = bytearray(p.HEADER.size)
        for frame, path, sock, tag in started:
            try:
                self._receive(sock, head, frame, tag, self.poller)
            except _RemoteError as exc:  # the stream is still in sync: keep the connection
                self._keep(path.index, sock)
                frame.batch.settle(frame.slots(), path=path.name, failure=SETTLE_FAILED,
                                   cause=exc.cause)
                continue
            except (OSError, FrameError, AuthError) as exc:
                _close(sock)
                self._failed(path, [frame], exc)
                continue
            self._keep(path.index, sock)
            self.health.ok(path.index)
            frame.batch.settle(frame.slots(), path=path.name)

    def move_direct(self, op: OpCode, seg_id: int, offset: int, local: memoryview) -> None:
        """One request of ``local.nbytes`` bytes between ``local`` and ``offset`` of the
        target's segment ``seg_id``, in the calling thread on a spare connection (see
        :meth:`TcpTransport.move_direct`).

        Raises:
            TransferError: the connection failed (closed here, counted against its path) or
                the target refused (the connection stays in sync and is kept).
        """
        index = self.health.pick()
        path = self.paths[index]
        sock = self._spare_of(index)
        length = local.nbytes
        try:
            if sock is None:
                sock = path.open()
            tag = next(path.tags) & 0xFFFFFFFF
            entry = p.ENTRY.pack(seg_id, offset, length)
            head = bytearray(p.HEADER.size)
            if op is OpCode.READ:
                send_views(sock, _sealed(sock, p.HEADER.pack(p.FrameType.READ, 0, 0, tag, 1, 0)
                                         + entry))
                payload = self._response(sock, head, tag, self.poller)
                if payload != length:
                    raise FrameError(f"READ reply of {payload} bytes, expected {length}", None)
                recv_exact_into(sock, local)
            else:
                send_views(sock, [*_sealed(sock, p.HEADER.pack(p.FrameType.WRITE, 0, 0, tag, 1,
                                                                length) + entry), local])
                self._response(sock, head, tag, self.poller)
        except _RemoteError:
            self._keep(index, sock)  # type: ignore[arg-type]  # set: the target answered
            raise
        except (OSError, FrameError, AuthError) as exc:
            if sock is not None:
                _close(sock)
            self.transport.health_failed(self, path)
            reason = getattr(exc, "cause", None) or getattr(exc, "strerror", None) or str(exc)
            raise TransferError(f"transfer with {self.addresses[0]} failed on path "
                                f"{path.name}: {reason}",
                                "retry through a batch (it retries on other paths)") from exc
        except BaseException:  # anything else (a read-only buffer, an interrupt): the
            if sock is not None:  # stream may be mid-frame, so the connection goes
                _close(sock)
            raise
        self._keep(index, sock)
        self.health.ok(index)

    def _spare_of(self, index: int) -> socket.socket | None:
        """An idle connection of path ``index`` that is still open at the far end, or
        None (open a new one): those the peer cut while idle are closed here instead of
        failing the request they would have carried."""
        while True:
            with self._spare_lock:
                spare = self._spare[index]
                sock = spare.pop() if spare else None
            if sock is None or _idle_and_open(sock):
                return sock
            _log.debug("idle connection to %s on path %s was closed by the peer; dropped",
                       self.addresses[0], self.paths[index].name)
            _close(sock)

    def _keep(self, index: int, sock: socket.socket) -> None:
        """Return a spare connection for reuse (at most ``connections_per_peer`` idle per
        path; more, or after close, are closed)."""
        with self._spare_lock:
            spare = self._spare[index]
            if not self._closed and len(spare) < self.transport.connections_per_peer:
                spare.append(sock)
                return
        _close(sock)

    @staticmethod
    def _take(inflight: collections.deque[tuple[_Frame, int]], new: list[_Frame]
              ) -> list[_Frame]:
        frames = [frame for frame, _ in inflight] + new
        inflight.clear()
        new.clear()
        return frames

    def _entries(self, path: _Path, frame: _Frame, ftype: int, payload: int) -> tuple[int, bytes]:
        tag = next(path.tags) & 0xFFFFFFFF
        seg_id = frame.seg_id
        pack = p.ENTRY.pack
        body = b"".join([pack(seg_id, toff, length) for _, _, _, toff, length in frame.pieces])
        return tag, p.HEADER.pack(ftype, 0, 0, tag, len(frame.pieces), payload) + body

    def _response(self, sock: socket.socket, head: bytearray, tag: int,
                  poller: Poller | None = None) -> int:
        if poller is not None:
            poller.recv_exact_into(sock, memoryview(head))
        else:
            recv_exact_into(sock, memoryview(head))
        text = _check_reply_mac(sock, head)
        ftype, status, _, rtag, index, payload = p.HEADER.unpack(head)
        if ftype != p.FrameType.RESP or rtag != tag:
            raise FrameError(f"unexpected reply (type {ftype}, tag {rtag}, expected {tag})",
                             "the connection is out of sync; it is reopened")
        if status != p.WireStatus.OK:
            message = text.decode("utf-8", "replace")
            where = "" if index == p.NO_INDEX else f" (entry {index})"
            raise _RemoteError(f"target {self.addresses[0]} refused{where}: {message} "
                               f"[{p.WireStatus(status).name}]",
                               "check the request's target segment, offset and length")
        return int(payload)

    def _send(self, sock: socket.socket, path: _Path, frame: _Frame) -> int:
        """Send one request frame (a WRITE with its payload, gathered); returns its tag."""
        if frame.op is OpCode.READ:
            tag, head = self._entries(path, frame, p.FrameType.READ, 0)
            send_views(sock, _sealed(sock, head))
            return tag
        total = sum(piece[4] for piece in frame.pieces)
        tag, head = self._entries(path, frame, p.FrameType.WRITE, total)
        views: list[memoryview | bytes] = [*_sealed(sock, head)]
        for _, lbuf, lrel, _, length in frame.pieces:
            view = lbuf.view
            if view is not None:
                views.append(view[lrel : lrel + length])
            else:
                scratch = memoryview(bytearray(length))
                lbuf.read_into(lrel, scratch)
                views.append(scratch)
        send_views(sock, views)
        return tag

    def _receive(self, sock: socket.socket, head: bytearray, frame: _Frame, tag: int,
                 poller: Poller | None = None) -> None:
        """Take the reply of one frame (its header lands in ``head``, a buffer of the
        connection's reader); a READ's data lands straight in the local buffers."""
        payload = self._response(sock, head, tag, poller)
        if frame.op is not OpCode.READ:
            return
        expected = sum(piece[4] for piece in frame.pieces)
        if payload != expected:
            raise FrameError(f"READ reply of {payload} bytes, expected {expected}", None)
        views, staged = landing_views(
            (lbuf, lrel, length) for _, lbuf, lrel, _, length in frame.pieces)
        recv_into_views(sock, views)
        for lbuf, lrel, scratch in staged:
            lbuf.write_from(lrel, scratch)

    def notify(self, sender: str, message: bytes) -> None:
        name = sender.encode()
        body = _U16.pack(len(name)) + name + message
        with self._control_lock:
            for attempt in range(2):
                try:
                    if self._control is None:
                        host, port = _split_address(self.addresses[0])
                        t = self.transport
                        self._control = open_connection(
                            host, port, token=t.token, local_address=None,
                            connect_timeout_s=t.connect_timeout_s, timeout_s=t.timeout_s)
                    sock = self._control
                    send_views(sock, _sealed(sock, p.HEADER.pack(p.FrameType.NOTIFY, 0, 0, 1, 0,
                                                                  len(body)), body))
                    head = recv_exact(sock, p.HEADER.size)
                    _check_reply_mac(sock, head)  # reads an error reply's text
                    ftype, status, _, _, _, payload = p.HEADER.unpack(head)
                    if payload and status == p.WireStatus.OK:
                        recv_exact(sock, min(payload, 65536))
                    if ftype != p.FrameType.RESP or status != p.WireStatus.OK:
                        raise FrameError(f"target refused the notification (status {status})",
                                         None)
                    return
                except (OSError, ConnectionClosedError):
                    self._close_control()
                    if attempt:
                        raise
                except FrameError:
                    self._close_control()
                    raise

    def _close_control(self) -> None:
        sock, self._control = self._control, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        with self._spare_lock:
            self._closed = True
            spares = [sock for spare in self._spare for sock in spare]
            for spare in self._spare:
                spare.clear()
        for spare_sock in spares:
            _close(spare_sock)
        for path in self.paths:
            path.jobs.put(None)
            sock = path.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for path in self.paths:
            path.thread.join(10.0)
            while True:  # frames queued behind the stop marker fail now
                try:
                    frame = path.jobs.get_nowait()
                except queue.Empty:
                    break
                if frame is not None:
                    frame.batch.settle(frame.slots(), path=path.name, failure=SETTLE_FAILED,
                                       cause="transfer engine closed before the request ran")
        with self._control_lock:
            self._close_control()


class TcpTransport(Transport):
    """Framed TCP to target servers, sliced and spread over several connections per peer.

    Args:
        token: shared secret for the targets' challenge-response (or ``None``).
        connections_per_peer: paths (connections, one worker thread each) per target server.
        local_addresses: local IPs (NICs) to connect from, e.g. from topo's ranking for the
            buffer's location; connections are spread over them. Empty: let the OS choose.
        slice_bytes: requests above this are cut into slices moved in parallel.
        retry: retry and pause policy.
        timeout_s: a frame with no progress for this long fails with TIMEOUT.
        connect_timeout_s: limit for TCP connect and handshake (at most ``timeout_s``).
        window: frames a path sends back to back before reading their replies (pipelining).
        inline_bytes: a waited-for submission (``execute_waiting``) of at most this many
            bytes and at most one frame per path runs in the calling thread on spare
            connections (0 turns this off:
            every frame goes through the worker paths).
        spin_s: how long a calling thread (those inline submissions, ``move_direct``) polls
            for a reply before it sleeps (see :class:`~kvctl.net.framing.Poller`; 0 never
            polls). Worker threads always block.
    """

    name = "tcp"

    def __init__(self, *, token: str | None = None, connections_per_peer: int = 4,
                 local_addresses: Sequence[str] = (), slice_bytes: int = 1 << 20,
                 retry: RetryPolicy | None = None, timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, window: int = 4,
                 inline_bytes: int = DEFAULT_INLINE_BYTES,
                 spin_s: float = DEFAULT_SPIN_S) -> None:
        self.token = token
        self.connections_per_peer = max(1, connections_per_peer)
        self.local_addresses = list(local_addresses)
        self.slice_bytes = slice_bytes
        self.retry = retry or RetryPolicy()
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.window = max(1, window)
        self.inline_bytes = max(0, inline_bytes)
        self.spin_s = max(0.0, spin_s)
        self._peers: dict[tuple[str, ...], _Peer] = {}
        self._lock = threading.Lock()
        self.closed = False

    def pieces(self, length: int) -> int:
        return -(-length // self.slice_bytes)

    def health_failed(self, peer: _Peer, path: _Path) -> None:
        """Count a failure on ``path``; log when it gets paused."""
        if peer.health.failed(path.index):
            _log.warning("path %s paused for %g s after %d consecutive failures", path.name,
                         self.retry.pause_s, self.retry.pause_after)

    def _peer(self, info: SegmentInfo) -> _Peer:
        key = info.addresses
        peer = self._peers.get(key)
        if peer is None:
            with self._lock:
                if self.closed:
                    raise TransferError("transfer engine is closed", "open a new engine")
                peer = self._peers.get(key)
                if peer is None:
                    peer = _Peer(self, info.addresses)
                    self._peers[key] = peer
        return peer

    def execute(self, batch: Batch, op: OpCode, target: RemoteSegment, items: list[Item]) -> None:
        peer = self._peer(target.info)
        for frame in self._frames(peer, batch, op, target, items)[0]:
            peer.dispatch(frame)

    def execute_waiting(self, batch: Batch, op: OpCode, target: RemoteSegment,
                        items: list[Item]) -> None:
        peer = self._peer(target.info)
        frames, total = self._frames(peer, batch, op, target, items)
        if total <= self.inline_bytes and len(frames) <= len(peer.paths):
            peer.run_inline(frames)  # small: this thread sends and takes the replies
            return
        for frame in frames:
            peer.dispatch(frame)

    def move_direct(self, op: OpCode, info: SegmentInfo, offset: int, local: memoryview
                    ) -> None:
        """Move one request between ``local`` (any contiguous writable or readable buffer)
        and ``offset`` of the segment ``info`` in the calling thread: one frame on a spare
        connection, no batch, no retry (the caller retries through a batch).

        Raises:
            TransferError: as :meth:`_Peer.move_direct`.
        """
        self._peer(info).move_direct(op, info.seg_id, offset, local)

    def _frames(self, peer: _Peer, batch: Batch, op: OpCode, target: RemoteSegment,
                items: list[Item]) -> tuple[list[_Frame], int]:
        """Cut a submission into frames (slices over ``slice_bytes``, small requests
        coalesced, about one frame per path); also returns its total bytes."""
        slice_bytes = self.slice_bytes
        pieces: list[_Piece] = []
        total = 0
        for slot, lbuf, lrel, _bi, _trel, toff, length in items:
            total += length
            if length <= slice_bytes:
                pieces.append((slot, lbuf, lrel, toff, length))
                continue
            pieces.extend((slot, lbuf, lrel + start, toff + start, n)
                          for start, n in slice_ranges(length, slice_bytes))
        # Spread the submission over the paths: about one frame per path, within limits.
        budget = min(slice_bytes, max(MIN_FRAME_BYTES, -(-total // len(peer.paths))))
        name, seg_id = target.info.name, target.info.seg_id
        frames: list[_Frame] = []
        frame: list[_Piece] = []
        size = 0
        for piece in pieces:
            if frame and (size + piece[4] > budget or len(frame) >= p.MAX_ENTRIES):
                frames.append(_Frame(batch, op, name, seg_id, frame))
                frame, size = [], 0
            frame.append(piece)
            size += piece[4]
        if frame:
            frames.append(_Frame(batch, op, name, seg_id, frame))
        return frames, total

    def notify(self, info: SegmentInfo, sender: str, message: bytes) -> None:
        """Deliver ``message`` to the engine serving ``info`` (waits for its acknowledgement).

        Raises:
            OSError / FrameError / AuthError: the target could not be reached or refused.
        """
        self._peer(info).notify(sender, message)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            peers = list(self._peers.values())
        for peer in peers:
            peer.close()
