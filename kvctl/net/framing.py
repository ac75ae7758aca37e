"""Socket helpers for framed protocols: exact reads, scatter/gather I/O, length-prefixed frames.

Two layers, both used by the transfer engine and the store:

- Zero-copy primitives on blocking sockets: :func:`recv_exact_into` (``recv_into`` with
  ``MSG_WAITALL`` until the view is full), :func:`recv_into_views` (``recvmsg_into`` over a
  list of memoryviews, one syscall for many destinations) and :func:`send_views`
  (``sendmsg`` gather of many memoryviews, chunked at ``IOV_MAX``, partial sends resumed).
  None of them copies payload bytes in Python.
- :class:`FrameCodec`: a generic length-prefixed message frame ``magic(4) kind(u8) 3 pad
  length(u32)`` followed by ``length`` payload bytes, with a hard size limit checked before
  any payload is read. A frame with the wrong magic or an oversized length raises
  :class:`FrameError`; the caller closes that connection and nothing else.
  :class:`FrameReader` reads a connection's frames through a read-ahead buffer (one
  ``recv`` for a small message instead of two); :class:`Poller` waits for a reply by
  polling briefly before it sleeps.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time
from collections.abc import Sequence

from kvctl.errors import KvctlError

#: After this many polls in a row miss, a reader polls once every 2**this waits.
SPIN_BACKOFF_MAX = 6
#: Most buffers one ``sendmsg``/``recvmsg_into`` call accepts on Linux.
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class FrameError(KvctlError):
    """A peer sent bytes that break the protocol (bad magic, oversized or truncated frame)."""


class ConnectionClosedError(FrameError):
    """The peer closed the connection in the middle of a frame (or before one)."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``.

    Raises:
        ConnectionClosedError: the peer closed before ``len(view)`` bytes arrived.
    """
    total = view.nbytes
    got = 0
    while got < total:
        n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionClosedError(
                f"peer closed the connection after {got} of {total} bytes",
                "the peer stopped or dropped the connection; retry",
            )
        got += n


def set_io_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking with kernel send/receive timeouts (``SO_SNDTIMEO`` /
    ``SO_RCVTIMEO``). Python's own timeouts (``settimeout``) poll before every call, one
    more system call per chunk; a timed-out call raises :class:`BlockingIOError`."""
    sock.settimeout(None)
    tv = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """A kernel send timeout (``SO_SNDTIMEO``) on ``sock``: a send that makes no progress
    that long fails (:class:`BlockingIOError`)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` of ``seconds``, at least 1 ms (a zero timeval means "wait
    forever", a negative one is refused)."""
    seconds = max(seconds, 0.001)
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


def recv_exact(sock: socket.socket, size_bytes: int) -> bytearray:
    """Read exactly ``size_bytes`` bytes into a new buffer (for headers, not payloads)."""
    buf = bytearray(size_bytes)
    if size_bytes:
        recv_exact_into(sock, memoryview(buf))
    return buf


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """Drop the first ``done`` bytes from a list of views (cheap when whole views finish)."""
    i = 0
    while i < len(views) and done >= views[i].nbytes:
        done -= views[i].nbytes
        i += 1
    rest = views[i:]
    if done and rest:
        rest[0] = rest[0][done:]
    return rest


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes | bytearray]) -> None:
    """Send every buffer in order with ``sendmsg`` gather (no concatenation copies)."""
    pending: list[memoryview] = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        chunk = pending[:IOV_MAX]
        sent = sock.sendmsg(chunk)
        pending = _advance(pending, sent)


def recv_into_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view in order with ``recvmsg_into`` scatter (data lands in place).

    Raises:
        ConnectionClosedError: the peer closed before every view was filled.
    """
    pending = [v for v in views if v.nbytes]
    while pending:
        if len(pending) == 1:
            recv_exact_into(sock, pending[0])
            return
        got, _, _, _ = sock.recvmsg_into(pending[:IOV_MAX], 0, socket.MSG_WAITALL)
        if got == 0:
            raise ConnectionClosedError(
                "peer closed the connection in the middle of a payload",
                "the peer stopped or dropped the connection; retry",
            )
        pending = _advance(pending, got)


def discard(sock: socket.socket, size_bytes: int, *, chunk_bytes: int = 1 << 20) -> None:
    """Read and drop ``size_bytes`` bytes (to skip a rejected payload and keep the stream)."""
    scratch = memoryview(bytearray(min(chunk_bytes, max(size_bytes, 1))))
    left = size_bytes
    while left > 0:
        n = min(left, scratch.nbytes)
        recv_exact_into(sock, scratch[:n])
        left -= n


@dataclasses.dataclass(frozen=True)
class Frame:
    """One length-prefixed message: ``kind`` (0-255) and its payload."""

    kind: int
    payload: bytes


class FrameCodec:
    """Length-prefixed frames ``magic kind pad length payload`` with a size limit.

    Args:
        magic: exactly 4 bytes naming the protocol (``b"KVST"``).
        max_payload_bytes: frames announcing more are refused before reading the payload.
    """

    _HEADER = struct.Struct("<4sB3xI")

    def __init__(self, magic: bytes, *, max_payload_bytes: int = 16 << 20) -> None:
        if len(magic) != 4:
            raise ValueError("frame magic must be exactly 4 bytes")
        self.magic = magic
        self.max_payload_bytes = max_payload_bytes

    @property
    def header_bytes(self) -> int:
        """Size of the fixed frame header in bytes."""
        return self._HEADER.size

    def encode_header(self, kind: int, length_bytes: int) -> bytes:
        """The header announcing a ``kind`` frame of ``length_bytes`` payload bytes."""
        if not 0 <= kind <= 255:
            raise ValueError(f"frame kind {kind} is outside 0..255")
        if length_bytes > self.max_payload_bytes:
            raise FrameError(
                f"frame of {length_bytes} bytes exceeds the limit of {self.max_payload_bytes}",
                "split the message or raise the frame size limit on both ends",
            )
        return self._HEADER.pack(self.magic, kind, length_bytes)

    def send(self, sock: socket.socket, kind: int, *parts: bytes | bytearray | memoryview) -> None:
        """Send one frame whose payload is the concatenation of ``parts`` (gathered)."""
        length = sum(memoryview(p).nbytes for p in parts)
        send_views(sock, [self.encode_header(kind, length), *parts])

    def recv(self, sock: socket.socket) -> Frame:
        """Read one frame.

        Raises:
            ConnectionClosedError: the connection ended (cleanly between frames or not).
            FrameError: bad magic or a length over the limit (close the connection).
        """
        kind, length = self.parse_header(recv_exact(sock, self._HEADER.size))
        return Frame(kind, bytes(recv_exact(sock, length)))

    def parse_header(self, buffer: bytes | bytearray | memoryview, offset: int = 0
                     ) -> tuple[int, int]:
        """(kind, payload length) of the header at ``offset`` of ``buffer``.

        Raises:
            FrameError: bad magic or a length over the limit (close the connection).
        """
        magic, kind, length = self._HEADER.unpack_from(buffer, offset)
        if magic != self.magic:
            raise FrameError(
                f"bad frame magic {bytes(magic)!r} (expected {self.magic!r})",
                "the peer does not speak this protocol; check the address",
            )
        if length > self.max_payload_bytes:
            raise FrameError(
                f"peer announced a {length}-byte frame, over the {self.max_payload_bytes} limit",
                "the peer is misbehaving or configured with a larger limit",
            )
        return kind, length


class Poller:
    """Waits for bytes on a blocking socket by polling first, for replies expected soon.

    A thread that blocks in ``recv`` is put to sleep and woken when the bytes arrive; on a
    virtual machine that wake-up alone can cost 100 µs, most of a loopback round trip
    (bare Python echo here: 135 µs blocking, 40 µs polling). :meth:`recv_into` polls
    (``MSG_DONTWAIT``) for up to ``spin_s`` before it blocks, burning that much CPU at
    most. Polls that keep missing (a slow peer, a crowded machine, where polling only takes
    CPU from the peer) back off: after ``k`` misses in a row the next ``2**k`` waits (at most
    64) block at once; a hit starts over. The socket must be blocking (see
    :func:`set_io_timeouts`). Counters are not locked: threads sharing a poller may lose an
    update, which only shifts the back-off.
    """

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self.misses = 0  # polls in a row that ended without data
        self.skip = 0  # waits left that block at once

    def recv_into(self, sock: socket.socket, view: memoryview) -> int:
        """One ``recv_into`` of ``view`` (what arrived, at least 1 byte; 0 at EOF)."""
        if self.spin_s > 0:
            if self.skip > 0:  # (> 0: a racing decrement must not leave it below zero)
                self.skip -= 1
            else:
                deadline = time.perf_counter() + self.spin_s
                while True:
                    try:
                        got = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        if time.perf_counter() >= deadline:
                            break
                    else:
                        self.misses = 0
                        return got
                self.misses = min(self.misses + 1, SPIN_BACKOFF_MAX)
                self.skip = 1 << self.misses
        return sock.recv_into(view)

    def recv_exact_into(self, sock: socket.socket, view: memoryview) -> None:
        """Fill ``view`` (the first bytes polled for, the rest read as they come).

        Raises:
            ConnectionClosedError: the peer closed before ``len(view)`` bytes arrived.
        """
        got = self.recv_into(sock, view)
        if got == 0 and view.nbytes:
            raise ConnectionClosedError("peer closed the connection before replying",
                                        "the peer stopped or dropped the connection; retry")
        if got < view.nbytes:
            recv_exact_into(sock, view[got:])


class FrameReader:
    """Frames of one connection read through a read-ahead buffer.

    :meth:`FrameCodec.recv` reads a header, then its payload: two ``recv`` calls per
    message. Here one ``recv`` usually brings the header, the payload and whatever the peer
    sent behind it (on a loopback round trip of a few hundred microseconds each system call
    counts). Bytes past a frame stay buffered for the next :meth:`recv` or
    :meth:`recv_into_views`; a payload larger than the buffer is read straight into its
    own. One reader per connection, used by one thread at a time.
    """

    def __init__(self, sock: socket.socket, codec: FrameCodec, *,
                 buffer_bytes: int = 64 << 10, spin_s: float = 0.0) -> None:
        self._sock = sock
        self._codec = codec
        #: how reads wait for the peer's bytes (polling first when ``spin_s`` > 0).
        self.poller = Poller(spin_s)
        self._buf = bytearray(max(buffer_bytes, codec.header_bytes))
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet."""
        return self._end - self._start

    def _fill(self, need: int) -> None:
        """Buffer at least ``need`` bytes (at most the buffer's size)."""
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buf):  # move the tail to the front
            tail = bytes(self._view[self._start:self._end])
            self._view[:len(tail)] = tail
            self._start, self._end = 0, len(tail)
        while self._end - self._start < need:
            got = self.poller.recv_into(self._sock, self._view[self._end:])
            if got == 0:
                raise ConnectionClosedError(
                    f"peer closed the connection after {self._end - self._start} of {need} "
                    "bytes", "the peer stopped or dropped the connection; retry")
            self._end += got

    def _take(self, dest: memoryview) -> int:
        """Copy buffered bytes into the start of ``dest``; how many."""
        n = min(dest.nbytes, self._end - self._start)
        if n:
            dest[:n] = self._view[self._start:self._start + n]
            self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return n

    def recv(self) -> Frame:
        """Read one frame.

        Raises:
            ConnectionClosedError: the connection ended (cleanly between frames or not).
            FrameError: bad magic or a length over the limit (close the connection).
        """
        size = self._codec.header_bytes
        self._fill(size)
        kind, length = self._codec.parse_header(self._view, self._start)
        self._start += size
        if length <= len(self._buf):
            self._fill(length)
            payload = bytes(self._view[self._start:self._start + length])
            self._start += length
            if self._start == self._end:
                self._start = self._end = 0
            return Frame(kind, payload)
        big = bytearray(length)
        done = self._take(memoryview(big))
        recv_exact_into(self._sock, memoryview(big)[done:])
        return Frame(kind, bytes(big))

    def recv_into_views(self, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order: buffered bytes first, then straight from the socket."""
        rest: list[memoryview] = []
        for view in views:
            done = self._take(view) if self.buffered else 0
            if done < view.nbytes:
                rest.append(view[done:])
        recv_into_views(self._sock, rest)
