"""A transfer reply's error text is under its MAC (issue 27.6).

With a token every transfer frame's control part carries a MAC, but an error reply's text
(78 bytes in the attack) followed the MAC outside it: a relay that holds no token could
rewrite what the initiator reports as the target's refusal. The MAC now covers the text; a
rewritten one closes the connection as any altered frame does."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvctl.net import auth
from kvctl.net.framing import FrameError, recv_exact
from kvctl.transfer import TransferEngine
from kvctl.transfer import protocol as p
from kvctl.transfer.transports import tcp
from tests.transfer._helpers import memory_url

TOKEN = "error-text-token"
SIZE = 1 << 16
#: Where the first reply's error text starts in the target → initiator stream.
TEXT_AT = p.HELLO.size + p.VERDICT.size + p.HEADER.size + auth.FRAME_MAC_BYTES


class _TextRelay:
    """Relays both ways; on the target's side it swaps the case of the first byte of the
    first reply's error text (``flip``: at most once)."""

    def __init__(self, upstream: tuple[str, int], *, flip: bool) -> None:
        self.upstream = upstream
        self.flip = flip
        self.flipped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self.listener.getsockname()[:2]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = self.listener.accept()
                up = socket.create_connection(self.upstream, timeout=10)
                self._socks += [down, up]
                threading.Thread(target=self._pipe, args=(up, down, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(down, up, False), daemon=True
                                 ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_target: bool) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                data = bytearray(chunk)
                if from_target and self.flip and not self.flipped and \
                        seen <= TEXT_AT < seen + len(data):
                    data[TEXT_AT - seen] ^= 0x20
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def target() -> Iterator[TransferEngine]:
    with TransferEngine("text-target", memory_url(), token=TOKEN) as engine:
        engine.register_segment("vault", SIZE)
        yield engine


def _refused_write(relay: _TextRelay, seg_id: int) -> tuple[socket.socket, bytearray]:
    """A WRITE outside the segment through ``relay``: the socket and the reply's header."""
    sock = tcp.open_connection(relay.host, relay.port, token=TOKEN, local_address=None,
                               connect_timeout_s=5, timeout_s=5)
    control = p.HEADER.pack(p.FrameType.WRITE, 0, 0, 1, 1, 4) + p.ENTRY.pack(seg_id, SIZE, 4)
    sock.sendall(b"".join(tcp._sealed(sock, control)) + b"data")
    return sock, recv_exact(sock, p.HEADER.size)


def _address(engine: TransferEngine) -> tuple[str, int]:
    host, _, port = (engine.address or "").rpartition(":")
    return host, int(port)


def test_a_rewritten_error_text_is_refused(target: TransferEngine) -> None:
    relay = _TextRelay(_address(target), flip=True)
    try:
        sock, head = _refused_write(relay, target.lookup("vault").seg_id)
        with sock:
            assert p.HEADER.unpack(head)[1] == p.WireStatus.OUT_OF_RANGE
            with pytest.raises(FrameError, match="MAC"):
                tcp._check_reply_mac(sock, head)
        assert relay.flipped == 1
    finally:
        relay.close()


def test_an_error_text_passed_through_is_read_whole(target: TransferEngine) -> None:
    relay = _TextRelay(_address(target), flip=False)
    try:
        sock, head = _refused_write(relay, target.lookup("vault").seg_id)
        with sock:
            text = tcp._check_reply_mac(sock, head)
            assert len(text) == p.HEADER.unpack(head)[5] > 0
            # The connection stays usable after a refusal (the next frame's MAC checks).
            control = p.HEADER.pack(p.FrameType.WRITE, 0, 0, 2, 1, 4) + p.ENTRY.pack(
                target.lookup("vault").seg_id, 0, 4)
            sock.sendall(b"".join(tcp._sealed(sock, control)) + b"real")
            head = recv_exact(sock, p.HEADER.size)
            assert tcp._check_reply_mac(sock, head) == b""
            assert p.HEADER.unpack(head)[1] == p.WireStatus.OK
        assert bytes(target.local_view("vault")[:4]) == b"real"
    finally:
        relay.close()
