"""With a token, a transfer connection is bound to its handshake: the target proves it knows
the token, and every frame's control part carries a MAC keyed by that handshake, so a relay
that passed a real handshake through can neither inject, alter, replay nor reorder frames."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvctl.errors import AuthError
from kvctl.net import auth
from kvctl.net.framing import FrameError, recv_exact
from kvctl.transfer import OpCode, TransferEngine, TransferRequest
from kvctl.transfer import protocol as p
from kvctl.transfer.transports import tcp
from tests.transfer._helpers import memory_url

TOKEN = "frame-mac-token"
SIZE = 1 << 16


@pytest.fixture
def target() -> Iterator[TransferEngine]:
    with TransferEngine("mac-target", memory_url(), token=TOKEN) as engine:
        engine.register_segment("vault", SIZE)
        yield engine


def _address(engine: TransferEngine) -> tuple[str, int]:
    host, _, port = (engine.address or "").rpartition(":")
    return host, int(port)


def _handshake(sock: socket.socket, token: str) -> auth.FrameMac:
    """The legitimate client's half of a handshake, by hand; returns its frame MACs."""
    _, _, _, nonce = p.HELLO.unpack(recv_exact(sock, p.HELLO.size))
    mine = auth.new_nonce()
    sock.sendall(p.ANSWER.pack(p.MAGIC, p.VERSION,
                               auth.respond(token, bytes(nonce), p.AUTH_CONTEXT), mine))
    _, code, proof = p.VERDICT.unpack(recv_exact(sock, p.VERDICT.size))
    assert code == p.Verdict.OK
    assert proof == auth.server_proof(token, bytes(nonce), mine, p.AUTH_CONTEXT)
    return auth.FrameMac(auth.session_key(token, bytes(nonce), mine, p.AUTH_CONTEXT),
                         client=True)


def _write_frame(seg_id: int, offset: int, data: bytes, tag: int = 1) -> bytes:
    return p.HEADER.pack(p.FrameType.WRITE, 0, 0, tag, 1, len(data)) + p.ENTRY.pack(
        seg_id, offset, len(data))


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return True


def _reply_ok(sock: socket.socket, mac: auth.FrameMac) -> bool:
    head = recv_exact(sock, p.HEADER.size)
    assert mac.check(recv_exact(sock, auth.FRAME_MAC_BYTES), head)
    return p.HEADER.unpack(head)[1] == p.WireStatus.OK


def test_a_sealed_frame_is_served(target: TransferEngine) -> None:
    seg = target.lookup("vault").seg_id
    with socket.create_connection(_address(target), timeout=5) as sock:
        mac = _handshake(sock, TOKEN)
        control = _write_frame(seg, 0, b"good")
        sock.sendall(control + mac.seal(control) + b"good")
        assert _reply_ok(sock, mac)
    assert bytes(target.local_view("vault")[:4]) == b"good"


def test_a_frame_injected_without_the_session_key_is_refused(target: TransferEngine) -> None:
    """A relay that passed the handshake through has no session key: whatever it sends in
    the client's name (no MAC, or one made up) closes the connection and writes nothing."""
    seg = target.lookup("vault").seg_id
    for forged_mac in (b"", bytes(auth.FRAME_MAC_BYTES),
                       auth.FrameMac(b"k" * 32, client=True).seal(_write_frame(seg, 0, b"evil"))):
        with socket.create_connection(_address(target), timeout=5) as sock:
            _handshake(sock, TOKEN)  # the real client's handshake, relayed
            control = _write_frame(seg, 0, b"evil")
            with contextlib.suppress(OSError):
                sock.sendall(control + forged_mac + b"evil" + bytes(16))
            assert _closed(sock)
    assert bytes(target.local_view("vault")[:4]) != b"evil"


def test_a_replayed_frame_is_refused_on_its_own_and_on_another_connection(
        target: TransferEngine) -> None:
    seg = target.lookup("vault").seg_id
    with socket.create_connection(_address(target), timeout=5) as sock:
        mac = _handshake(sock, TOKEN)
        control = _write_frame(seg, 8, b"once")
        recorded = control + mac.seal(control) + b"once"
        sock.sendall(recorded)
        assert _reply_ok(sock, mac)
        target.local_view("vault")[8:12] = b"----"
        with contextlib.suppress(OSError):
            sock.sendall(recorded)  # the same bytes again: its sequence number is spent
        assert _closed(sock)
    with socket.create_connection(_address(target), timeout=5) as other:
        _handshake(other, TOKEN)  # another handshake, another key
        with contextlib.suppress(OSError):
            other.sendall(recorded)
        assert _closed(other)
    assert bytes(target.local_view("vault")[8:12]) == b"----"


class _FlippingRelay:
    """A man in the middle: relays both ways and flips one bit of the first request that
    follows the first handshake it relays (inside the entry's offset)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.flipped = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = self.listener.accept()
                up = socket.create_connection(self.upstream, timeout=10)
                self._socks += [down, up]
                threading.Thread(target=self._pipe, args=(up, down, False), daemon=True).start()
                threading.Thread(target=self._pipe, args=(down, up, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, client_side: bool) -> None:
        seen = 0
        flip_at = p.ANSWER.size + p.HEADER.size + 4  # a byte of the first entry's offset
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                data = bytearray(chunk)
                if client_side and seen <= flip_at < seen + len(data):
                    with self._lock:
                        if not self.flipped:
                            data[flip_at - seen] ^= 0x01
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


def test_a_request_altered_on_the_way_never_lands() -> None:
    url = memory_url()
    with TransferEngine("mitm-target", url, token=TOKEN) as tgt:
        tgt.register_segment("vault", SIZE)
        relay = _FlippingRelay(_address(tgt))
        try:
            seg = tgt.lookup("vault").seg_id
            host, port = relay.address.split(":")
            sock = tcp.open_connection(host, int(port), token=TOKEN, local_address=None,
                                       connect_timeout_s=5, timeout_s=5)
            with sock:
                control = _write_frame(seg, 0, b"real")
                sock.sendall(b"".join(tcp._sealed(sock, control)) + b"real")
                with pytest.raises((FrameError, OSError)):  # the target hung up on it
                    tcp._check_reply_mac(sock, recv_exact(sock, p.HEADER.size))
            assert relay.flipped == 1
            # Unchecked, the request would have written at offset 1 instead of 0; it wrote
            # nothing anywhere.
            assert bytes(tgt.local_view("vault")) == bytes(SIZE)
            # A fresh connection through the same relay (it flips only once) works.
            sock = tcp.open_connection(host, int(port), token=TOKEN, local_address=None,
                                       connect_timeout_s=5, timeout_s=5)
            with sock:
                sock.sendall(b"".join(tcp._sealed(sock, control)) + b"real")
                head = recv_exact(sock, p.HEADER.size)
                tcp._check_reply_mac(sock, head)
                assert p.HEADER.unpack(head)[1] == p.WireStatus.OK
            assert bytes(tgt.local_view("vault")[:4]) == b"real"
        finally:
            relay.close()


def test_a_client_refuses_a_target_that_cannot_prove_the_token() -> None:
    """Something that answers at the target's address and says OK without knowing the token
    (a squatter, a relay to an open target) gets no request."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: list[bytes] = []

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(p.HELLO.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH, auth.new_nonce()))
            recv_exact(conn, p.ANSWER.size)
            conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.OK, bytes(32)))
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                got.append(conn.recv(100))

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    with pytest.raises(AuthError) as info:
        tcp.open_connection("127.0.0.1", port, token=TOKEN, local_address=None,
                            connect_timeout_s=5, timeout_s=5)
    assert "could not prove" in info.value.cause
    thread.join(5)
    listener.close()
    assert got in ([], [b""])  # no request reached it


def test_a_reply_with_a_wrong_mac_is_refused() -> None:
    """The client checks replies too: a relay cannot forge a target's answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            nonce = auth.new_nonce()
            conn.sendall(p.HELLO.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH, nonce))
            _, _, _, theirs = p.ANSWER.unpack(recv_exact(conn, p.ANSWER.size))
            conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.OK, auth.server_proof(
                TOKEN, nonce, bytes(theirs), p.AUTH_CONTEXT)))
            recv_exact(conn, p.HEADER.size + auth.FRAME_MAC_BYTES)
            conn.sendall(p.HEADER.pack(p.FrameType.RESP, 0, 0, 1, p.NO_INDEX, 0)
                         + bytes(auth.FRAME_MAC_BYTES))

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    sock = tcp.open_connection("127.0.0.1", port, token=TOKEN, local_address=None,
                               connect_timeout_s=5, timeout_s=5)
    with sock:
        sock.sendall(b"".join(tcp._sealed(sock, p.HEADER.pack(p.FrameType.PING, 0, 0, 1, 0,
                                                                0))))
        with pytest.raises(FrameError) as info:
            tcp._check_reply_mac(sock, recv_exact(sock, p.HEADER.size))
        assert "MAC" in info.value.cause
    thread.join(5)
    listener.close()


def test_versions_are_refused_by_name_both_ways(target: TransferEngine) -> None:
    with socket.create_connection(_address(target), timeout=5) as sock:
        recv_exact(sock, p.HELLO.size)
        sock.sendall(p.ANSWER_V1.pack(p.MAGIC, 1, bytes(32)))  # an older kvctl
        assert p.VERDICT.unpack(recv_exact(sock, p.VERDICT.size))[1] == p.Verdict.BAD_VERSION
    listener = socket.create_server(("127.0.0.1", 0))

    def old_target() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(p.HELLO.pack(p.MAGIC, 1, 0, bytes(32)))
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                conn.recv(100)

    threading.Thread(target=old_target, daemon=True).start()
    with pytest.raises(FrameError) as info:
        tcp.open_connection("127.0.0.1", listener.getsockname()[1], token=None,
                            local_address=None, connect_timeout_s=5, timeout_s=5)
    assert "version 1" in info.value.cause
    listener.close()


def test_without_a_token_frames_carry_no_mac() -> None:
    with TransferEngine("open-target", memory_url()) as open_target:
        open_target.register_segment("v", 4096)
        host, port = _address(open_target)
        sock = tcp.open_connection(host, port, token=None, local_address=None,
                                   connect_timeout_s=5, timeout_s=5)
        with sock:
            assert tcp._mac_of(sock) is None
            assert tcp._sealed(sock, b"abc") == [b"abc"]


def test_a_whole_batch_runs_with_macs() -> None:
    url = memory_url()
    with TransferEngine("t2", url, token=TOKEN) as tgt, \
            TransferEngine("i2", url, transport="tcp", token=TOKEN) as ini:
        tgt.register_segment("vault", SIZE)
        ini.register_segment("l", SIZE)
        ini.local_view("l")[:SIZE] = bytes(range(256)) * (SIZE // 256)
        ini.transfer([TransferRequest(OpCode.WRITE, "l", 0, "vault", 0, SIZE)], timeout_s=20)
        ini.local_view("l")[:SIZE] = bytes(SIZE)
        ini.transfer([TransferRequest(OpCode.READ, "l", 0, "vault", 0, SIZE)], timeout_s=20)
        assert bytes(ini.local_view("l")) == bytes(range(256)) * (SIZE // 256)
