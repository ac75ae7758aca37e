"""The target server: serves READ/WRITE/NOTIFY frames on the segments registered here.

One thread per connection (socket I/O releases the GIL). Payloads move between the socket
and the segment's memory with ``sendmsg``/``recvmsg_into`` over memoryviews: a READ reply is
gathered straight from the buffers, a WRITE lands straight in them. Files and GPU memory go
through a bounded scratch buffer.

Safety: every entry must fall inside one registered buffer (checked before any byte moves);
frames over the limits, payload lengths that do not add up, unknown types and bad magic close
that one connection; other connections keep being served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kvctl.errors import KvctlError, UnavailableError
from kvctl.net import auth
from kvctl.net.bind import address_family, announce_bind, is_unspecified
from kvctl.net.framing import (
    FrameError,
    discard,
    recv_exact_into,
    recv_into_views,
    send_views,
)
from kvctl.net.limits import PendingLimit, accept
from kvctl.transfer import protocol as p
from kvctl.transfer.errors import OutOfRangeError
from kvctl.transfer.segments import LocalBuffer, LocalSegment, find_buffer, landing_views

if TYPE_CHECKING:
    from kvctl.metrics import ServerMetrics

_log = logging.getLogger("kvctl.transfer.server")

_U16 = struct.Struct("<H")
HANDSHAKE_TIMEOUT_S = 10.0
#: Connections that have not finished the handshake, at once (the oldest gives way).
MAX_PENDING = 64
#: Connections served at once; past it new ones are closed at once.
MAX_CONNECTIONS = 512


class _RejectError(Exception):
    """An entry the server answers with an error status (connection stays usable)."""

    def __init__(self, status: p.WireStatus, index: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.index = index
        self.message = message


class TargetServer:
    """Serve registered segments over the kvctl transfer protocol.

    Args:
        lookup: seg_id → segment (``None`` when unknown or being removed).
        on_notify: called with (sender, message) for each NOTIFY frame.
        host, port: where to listen (loopback and any free port by default).
        token: shared secret; when set, clients must answer the HMAC challenge.
        max_frame_bytes: largest payload one frame may carry or request.
        metrics: where to count READs and WRITEs, their latency and payload bytes (ops
            ``read``/``write``; outcome ``ok`` or the refusal's status), or ``None``.
    """

    def __init__(self, lookup: Callable[[int], LocalSegment | None],
                 on_notify: Callable[[str, bytes], None], *, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None,
                 max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
                 metrics: ServerMetrics | None = None) -> None:
        self._lookup = lookup
        self.metrics = metrics
        self._on_notify = on_notify
        self._token = token
        self.max_frame_bytes = max_frame_bytes
        try:
            self._listener = socket.create_server((host, port), backlog=128,
                                                  family=address_family(host),
                                                  dualstack_ipv6=is_unspecified(host) and
                                                  ":" in host)
        except OSError as exc:
            raise UnavailableError(
                f"cannot listen on {host}:{port}: {exc.strerror}",
                "pick another --listen address or a free port (0 = any)",
            ) from None
        self.host, self.port = self._listener.getsockname()[:2]
        announce_bind("transfer target", self.host, self.port)
        self._pending = PendingLimit(MAX_PENDING, f"transfer target {self.address}",
                                     deadline_s=HANDSHAKE_TIMEOUT_S)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvctl-target-accept",
                                          daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop accepting, cut every connection and join the threads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        self._pending.close()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5.0)
        for thread in list(self._threads):
            thread.join(5.0)

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        while True:
            accepted = accept(self._listener, f"transfer target {self.address}")
            if accepted is None:
                return
            conn, peer = accepted
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    _log.warning("transfer target: %d connections open, refusing one",
                                 MAX_CONNECTIONS)
                    conn.close()
                    continue
                self._conns.add(conn)
                self._pending.admit(conn, str(peer[0]))
                self._threads = [t for t in self._threads if t.is_alive()]
                thread = threading.Thread(target=self._serve, args=(conn, peer),
                                          name="kvctl-target-conn", daemon=True)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ok, mac = self._handshake(conn)
            if ok:
                self._loop(conn, mac)
        except FrameError as exc:
            _log.warning("closing connection from %s:%d: %s", peer[0], peer[1], exc.cause)
        except OSError as exc:
            _log.debug("connection from %s:%d ended: %s", peer[0], peer[1], exc)
        finally:
            self._pending.trusted(conn)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> tuple[bool, auth.FrameMac | None]:
        """Run the handshake: (whether the client may go on, its frames' MACs if a token)."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = auth.new_nonce() if self._token else bytes(auth.NONCE_BYTES)
        flags = p.FLAG_AUTH if self._token else 0
        conn.sendall(p.HELLO.pack(p.MAGIC, p.VERSION, flags, nonce))
        answer = bytearray(p.ANSWER.size)
        try:
            recv_exact_into(conn, memoryview(answer)[:p.ANSWER_HEAD.size])
            magic, version = p.ANSWER_HEAD.unpack_from(answer)
            if magic != p.MAGIC:
                raise FrameError(f"bad handshake magic {bytes(magic)!r}", None)
            if version != p.VERSION:
                rest = (p.ANSWER_V1.size if version == 1 else 0) - p.ANSWER_HEAD.size
                if rest > 0:
                    recv_exact_into(conn, memoryview(bytearray(rest)))
                conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.BAD_VERSION,
                                            bytes(auth.DIGEST_BYTES)))
                return False, None
            recv_exact_into(conn, memoryview(answer)[p.ANSWER_HEAD.size:])
        except TimeoutError:
            raise FrameError("client sent no handshake answer in time", None) from None
        _, _, digest, client_nonce = p.ANSWER.unpack(answer)
        if self._token and not auth.check_response(self._token, nonce, p.AUTH_CONTEXT,
                                                   bytes(digest)):
            _log.warning("refused a connection: authentication failed")
            conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.AUTH_REFUSED,
                                        bytes(auth.DIGEST_BYTES)))
            return False, None
        mac: auth.FrameMac | None = None
        proof = bytes(auth.DIGEST_BYTES)
        if self._token:
            proof = auth.server_proof(self._token, nonce, bytes(client_nonce), p.AUTH_CONTEXT)
            mac = auth.FrameMac(auth.session_key(self._token, nonce, bytes(client_nonce),
                                                 p.AUTH_CONTEXT), client=False)
        conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.OK, proof))
        conn.settimeout(None)
        self._pending.trusted(conn)
        return True, mac

    def _loop(self, conn: socket.socket, mac: auth.FrameMac | None) -> None:
        head = bytearray(p.HEADER.size)
        head_view = memoryview(head)
        entries = bytearray(p.ENTRY.size * 64)
        tail = bytearray(auth.FRAME_MAC_BYTES)
        while True:
            try:
                recv_exact_into(conn, head_view)
            except FrameError:
                return  # closed between frames: a normal end
            ftype, _flags, _pad, tag, count, payload = p.HEADER.unpack(head)
            if ftype in (p.FrameType.READ, p.FrameType.WRITE):
                if count == 0 or count > p.MAX_ENTRIES:
                    raise FrameError(f"frame with {count} entries (limit {p.MAX_ENTRIES})", None)
                if payload > self.max_frame_bytes:
                    raise FrameError(f"frame payload {payload} bytes over the limit "
                                     f"{self.max_frame_bytes}", None)
                need = count * p.ENTRY.size
                if len(entries) < need:
                    entries = bytearray(need)
                recv_exact_into(conn, memoryview(entries)[:need])
                if mac is not None:
                    _check_mac(conn, mac, tail, head, memoryview(entries)[:need])
                parsed = list(p.ENTRY.iter_unpack(memoryview(entries)[:need]))
                started = time.perf_counter()
                if ftype == p.FrameType.READ:
                    if payload:
                        raise FrameError("READ frame carries a payload", None)
                    status = self._read(conn, mac, tag, parsed)
                else:
                    status = self._write(conn, mac, tag, parsed, payload)
                if self.metrics is not None:
                    moved = sum(length for _, _, length in parsed) if status == 0 else 0
                    write = ftype == p.FrameType.WRITE
                    self.metrics.record("write" if write else "read",
                                        time.perf_counter() - started, status.name.lower(),
                                        bytes_in=moved if write else 0,
                                        bytes_out=0 if write else moved)
            elif ftype == p.FrameType.NOTIFY:
                if count or payload > p.MAX_NOTIFY_BYTES or payload < _U16.size:
                    raise FrameError(f"bad NOTIFY frame ({count} entries, {payload} bytes)", None)
                body = bytearray(payload)
                recv_exact_into(conn, memoryview(body))
                if mac is not None:
                    _check_mac(conn, mac, tail, head, body)
                (name_len,) = _U16.unpack_from(body)
                if _U16.size + name_len > payload:
                    raise FrameError("NOTIFY sender name overruns the frame", None)
                sender = body[_U16.size : _U16.size + name_len].decode("utf-8", "replace")
                message = bytes(body[_U16.size + name_len :])
                self._reply(conn, mac, tag, p.WireStatus.OK)
                self._deliver(sender, message)
            elif ftype == p.FrameType.PING:
                if count or payload:
                    raise FrameError("PING frame with a body", None)
                if mac is not None:
                    _check_mac(conn, mac, tail, head)
                self._reply(conn, mac, tag, p.WireStatus.OK)
            else:
                raise FrameError(f"unknown frame type {ftype}", None)

    def _deliver(self, sender: str, message: bytes) -> None:
        try:
            self._on_notify(sender, message)
        except KvctlError as exc:
            _log.warning("notification from %s not delivered: %s", sender, exc.cause)

    # ------------------------------------------------------------------ requests

    def _resolve(self, parsed: list[tuple[int, int, int]], held: dict[int, LocalSegment]
                 ) -> tuple[list[tuple[LocalBuffer, int, int]], int]:
        """Map entries to (buffer, relative offset, length); acquire each segment once."""
        out: list[tuple[LocalBuffer, int, int]] = []
        total = 0
        last_id = -1
        seg = cast("LocalSegment", None)  # set by the first entry
        single: LocalBuffer | None = None
        size = 0
        for index, (seg_id, offset, length) in enumerate(parsed):
            if seg_id != last_id:
                known = held.get(seg_id)
                if known is None:
                    known = self._lookup(seg_id)
                    if known is None:
                        raise _RejectError(p.WireStatus.NO_SEGMENT, index,
                                           f"no segment with id {seg_id} is served here")
                    known.acquire()
                    held[seg_id] = known
                    if known.closed:
                        raise _RejectError(p.WireStatus.NO_SEGMENT, index,
                                           f"segment {known.name!r} was unregistered")
                seg = known
                last_id = seg_id
                single = seg.buffers[0] if len(seg.buffers) == 1 else None
                size = seg.lengths[0]
            # Wire integers are unsigned; compare without forming offset + length.
            if single is not None and length <= size and offset <= size - length:
                out.append((single, offset, length))
            else:
                try:
                    i, rel = find_buffer(seg.offsets, seg.lengths, offset, length,
                                         segment=seg.name)
                except OutOfRangeError as exc:
                    raise _RejectError(p.WireStatus.OUT_OF_RANGE, index, exc.cause) from None
                out.append((seg.buffers[i], rel, length))
            total += length
        return out, total

    def _read(self, conn: socket.socket, mac: auth.FrameMac | None, tag: int,
              parsed: list[tuple[int, int, int]]) -> p.WireStatus:
        held: dict[int, LocalSegment] = {}
        try:
            try:
                targets, total = self._resolve(parsed, held)
                if total > self.max_frame_bytes:
                    raise _RejectError(p.WireStatus.OUT_OF_RANGE, p.NO_INDEX,
                                  f"READ of {total} bytes over the frame limit "
                                  f"{self.max_frame_bytes}")
                reply = p.HEADER.pack(p.FrameType.RESP, p.WireStatus.OK, 0, tag, p.NO_INDEX,
                                      total)
                views: list[memoryview | bytes | bytearray] = [reply]
                if mac is not None:
                    views.append(mac.seal(reply))
                for buf, rel, length in targets:
                    view = buf.view
                    if view is not None:
                        views.append(view[rel : rel + length])
                    else:
                        scratch = memoryview(bytearray(length))
                        buf.read_into(rel, scratch)
                        views.append(scratch)
            except _RejectError as rej:
                self._reply(conn, mac, tag, rej.status, rej.index, rej.message)
                return rej.status
            except OSError as exc:
                self._reply(conn, mac, tag, p.WireStatus.INTERNAL, p.NO_INDEX,
                            f"target I/O error: {os.strerror(exc.errno or 0)}")
                return p.WireStatus.INTERNAL
            send_views(conn, views)
            return p.WireStatus.OK
        finally:
            for seg in held.values():
                seg.release()

    def _write(self, conn: socket.socket, mac: auth.FrameMac | None, tag: int,
               parsed: list[tuple[int, int, int]], payload: int) -> p.WireStatus:
        total = sum(length for _, _, length in parsed)
        if total != payload:
            raise FrameError(f"WRITE payload {payload} bytes != sum of entry lengths {total}",
                             None)
        held: dict[int, LocalSegment] = {}
        try:
            try:
                targets, _ = self._resolve(parsed, held)
            except _RejectError as rej:
                discard(conn, payload)
                self._reply(conn, mac, tag, rej.status, rej.index, rej.message)
                return rej.status
            views, staged = landing_views(targets)
            recv_into_views(conn, views)
            try:
                for buf, rel, scratch in staged:
                    buf.write_from(rel, scratch)
            except OSError as exc:
                self._reply(conn, mac, tag, p.WireStatus.INTERNAL, p.NO_INDEX,
                            f"target I/O error: {os.strerror(exc.errno or 0)}")
                return p.WireStatus.INTERNAL
            self._reply(conn, mac, tag, p.WireStatus.OK)
            return p.WireStatus.OK
        finally:
            for seg in held.values():
                seg.release()

    @staticmethod
    def _reply(conn: socket.socket, mac: auth.FrameMac | None, tag: int, status: p.WireStatus,
               index: int = p.NO_INDEX, message: str = "") -> None:
        body = message.encode()[:4096]
        head = p.HEADER.pack(p.FrameType.RESP, status, 0, tag, index, len(body))
        # The MAC covers an error reply's text too (issue 27.6: a relay rewrote it); an OK
        # reply's payload (a READ's data) stays outside it, as the protocol says.
        sealed = body if status != p.WireStatus.OK else b""
        send_views(conn, [head, mac.seal(head, sealed), body] if mac is not None
                   else [head, body])


def _check_mac(conn: socket.socket, mac: auth.FrameMac, tail: bytearray,
               *parts: bytes | bytearray | memoryview) -> None:
    """Read a frame's MAC into ``tail`` and check it over ``parts`` (its control part).

    Raises:
        FrameError: the MAC is wrong: the frame was forged, altered, replayed or
            reordered on the way (the connection is closed).
    """
    recv_exact_into(conn, memoryview(tail))
    if not mac.check(tail, *parts):
        raise FrameError("a frame failed its MAC check (altered, injected or replayed on the "
                         "way): connection closed", None)
