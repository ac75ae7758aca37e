"""Shared test helpers: data patterns, a faulty loopback TCP proxy, a stalled listener."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

_HEAD = struct.Struct("<QQQ")


def pattern(run_id: int, block: int, offset: int, length: int) -> bytes:
    """Bytes unique to (run, block index, offset): a header then a block-specific ramp."""
    head = _HEAD.pack(run_id, block, offset)
    ramp = bytes((block * 7 + k) % 251 for k in range(251))
    body = ramp * (length // 251 + 1)
    return (head + body)[:length]


def memory_url() -> str:
    """A memory:// metadata URL no other test shares."""
    return f"memory://{uuid.uuid4().hex}"


def wait_until(predicate: object, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate()`` until true, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


class FaultyProxy:
    """A loopback TCP proxy that can cut or stall connections after some client bytes.

    Attributes:
        upstream: ``(host, port)`` to forward to (may be set after construction).
        cut_after: cut the *first* connection once it forwarded this many client bytes.
        stall_after: stop forwarding on every connection after this many client bytes.
        captured: every client→server byte seen (for "no token in clear" checks).
    """

    def __init__(self, *, cut_after: int | None = None, stall_after: int | None = None) -> None:
        self.upstream: tuple[str, int] | None = None
        self.cut_after = cut_after
        self.stall_after = stall_after
        self.captured = bytearray()
        self.cuts = 0
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            assert self.upstream is not None
            server = socket.create_connection(self.upstream)
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, index, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, index, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, index: int, upstream: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream:
                    with self._lock:
                        self.captured += data
                    seen += len(data)
                    if self.cut_after is not None and index == 0 and seen > self.cut_after:
                        self.cuts += 1
                        break
                    if self.stall_after is not None and seen > self.stall_after:
                        self._closed.wait()
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut_all(self) -> None:
        """Close every connection open now at both ends (a middlebox's idle cut, a
        target that restarted); the proxy keeps accepting new ones."""
        with self._lock:
            socks, self._socks = list(self._socks), []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextlib.contextmanager
def behind_proxy(url: str, segment: str = "remote", size: int = 1 << 20, *,
                 name: str = "t", cut_after: int | None = None,
                 stall_after: int | None = None, token: str | None = None
                 ) -> Iterator[tuple[Any, FaultyProxy]]:
    """A target engine ``name`` serving ``segment`` of ``size`` bytes, reached only through
    a :class:`FaultyProxy` (it advertises the proxy's address); both closed at the end."""
    from kvctl.transfer import TransferEngine

    proxy = FaultyProxy(cut_after=cut_after, stall_after=stall_after)
    try:
        with TransferEngine(name, url, token=token, advertise=[proxy.address]) as tgt:
            tgt.register_segment(segment, size)
            host, _, port = (tgt.address or "").rpartition(":")
            proxy.upstream = (host, int(port))
            yield tgt, proxy
    finally:
        proxy.close()
