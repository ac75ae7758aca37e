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
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from collections.abc import Sequence

from kvctl.errors import KvctlError

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
        header = recv_exact(sock, self._HEADER.size)
        magic, kind, length = self._HEADER.unpack(header)
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
        return Frame(kind, bytes(recv_exact(sock, length)))
