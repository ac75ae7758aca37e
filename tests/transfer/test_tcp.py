"""The tcp transport and the target server: safety, auth, retries, timeouts."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from kvctl.errors import AuthError
from kvctl.net import auth
from kvctl.net.framing import recv_exact
from kvctl.transfer import OpCode, TransferEngine, TransferRequest, TransferState
from kvctl.transfer import protocol as p
from kvctl.transfer.paths import PathHealth, RetryPolicy, slice_ranges
from kvctl.transfer.segments import DescriptorAuthError
from tests.transfer._helpers import behind_proxy, memory_url

SIZE = 1 << 20


@pytest.fixture
def url() -> str:
    return memory_url()


@pytest.fixture
def target(url: str) -> Iterator[TransferEngine]:
    with TransferEngine("target", url, max_frame_bytes=2 * SIZE) as engine:
        engine.register_segment("remote", SIZE)
        engine.local_view("remote")[:8] = b"TARGET!!"
        yield engine


def _raw(engine: TransferEngine, token: str | None = None) -> socket.socket:
    """A hand-driven protocol connection to ``engine``'s target server."""
    host, _, port = (engine.address or "").rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    _, _, _flags, nonce = p.HELLO.unpack(recv_exact(sock, p.HELLO.size))
    digest = auth.respond(token, bytes(nonce), p.AUTH_CONTEXT) if token else bytes(32)
    sock.sendall(p.ANSWER.pack(p.MAGIC, p.VERSION, digest, bytes(32)))
    _, code, _proof = p.VERDICT.unpack(recv_exact(sock, p.VERDICT.size))
    assert code == p.Verdict.OK
    return sock


def _request(sock: socket.socket, ftype: int, entries: list[tuple[int, int, int]],
             payload: bytes = b"", *, declared: int | None = None) -> tuple[int, int, bytes]:
    body = b"".join(p.ENTRY.pack(*e) for e in entries)
    size = len(payload) if declared is None else declared
    sock.sendall(p.HEADER.pack(ftype, 0, 0, 7, len(entries), size) + body + payload)
    ftype, status, _, tag, _, length = p.HEADER.unpack(recv_exact(sock, p.HEADER.size))
    assert ftype == p.FrameType.RESP
    assert tag == 7
    return status, length, bytes(recv_exact(sock, length))


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _ping_ok(sock: socket.socket) -> bool:
    return _request(sock, p.FrameType.PING, [])[0] == p.WireStatus.OK


def test_server_reads_and_writes_inside_buffers(target: TransferEngine) -> None:
    seg_id = target.lookup("remote").seg_id
    with _raw(target) as sock:
        status, _length, data = _request(sock, p.FrameType.READ, [(seg_id, 0, 8)])
        assert (status, data) == (p.WireStatus.OK, b"TARGET!!")
        status, _, _ = _request(sock, p.FrameType.WRITE, [(seg_id, 100, 4), (seg_id, 0, 2)],
                                b"abcdXY")
        assert status == p.WireStatus.OK
    assert bytes(target.local_view("remote")[100:104]) == b"abcd"
    assert bytes(target.local_view("remote")[:2]) == b"XY"


@pytest.mark.parametrize(("offset", "length"), [
    (SIZE, 1), (SIZE - 1, 2), (2**64 - 1, 1), (1, 2**64 - 1), (2**63, 2**63),
])
def test_out_of_range_entries_are_refused_and_the_connection_survives(
        target: TransferEngine, offset: int, length: int) -> None:
    seg_id = target.lookup("remote").seg_id
    with _raw(target) as sock:
        status, _, message = _request(sock, p.FrameType.READ, [(seg_id, 0, 4),
                                                               (seg_id, offset, length)])
        assert status == p.WireStatus.OUT_OF_RANGE
        assert b"outside" in message
        assert _ping_ok(sock)


def test_rejected_write_payload_is_drained(target: TransferEngine) -> None:
    seg_id = target.lookup("remote").seg_id
    with _raw(target) as sock:
        status, _, _ = _request(sock, p.FrameType.WRITE, [(seg_id, SIZE - 2, 4)], b"zzzz")
        assert status == p.WireStatus.OUT_OF_RANGE
        status, _, _ = _request(sock, p.FrameType.WRITE, [(999, 0, 4)], b"zzzz")
        assert status == p.WireStatus.NO_SEGMENT
        assert _ping_ok(sock)  # the stream is still in sync
    assert bytes(target.local_view("remote")[SIZE - 2 :]) == b"\0\0"


def _send_and_expect_close(target: TransferEngine, data: bytes) -> None:
    with _raw(target) as bad, _raw(target) as good:
        bad.sendall(data)
        assert _closed(bad)
        assert _ping_ok(good)  # other connections are served as before


def test_garbage_closes_only_that_connection(target: TransferEngine) -> None:
    _send_and_expect_close(target, b"\xde\xad\xbe\xef" * 16)


def test_oversized_frames_are_refused(target: TransferEngine) -> None:
    seg_id = target.lookup("remote").seg_id
    entry = p.ENTRY.pack(seg_id, 0, 4)
    huge = p.HEADER.pack(p.FrameType.WRITE, 0, 0, 1, 1, 2**40) + entry
    _send_and_expect_close(target, huge)
    many = p.HEADER.pack(p.FrameType.READ, 0, 0, 1, p.MAX_ENTRIES + 1, 0)
    _send_and_expect_close(target, many)
    empty = p.HEADER.pack(p.FrameType.READ, 0, 0, 1, 0, 0)
    _send_and_expect_close(target, empty)
    notify = p.HEADER.pack(p.FrameType.NOTIFY, 0, 0, 1, 0, p.MAX_NOTIFY_BYTES + 1)
    _send_and_expect_close(target, notify)


def test_write_payload_must_match_entries(target: TransferEngine) -> None:
    seg_id = target.lookup("remote").seg_id
    frame = (p.HEADER.pack(p.FrameType.WRITE, 0, 0, 1, 1, 3) + p.ENTRY.pack(seg_id, 0, 4)
             + b"abc")
    _send_and_expect_close(target, frame)


def test_read_over_the_frame_limit_is_refused(url: str) -> None:
    with TransferEngine("small", url, max_frame_bytes=4096) as engine:
        engine.register_segment("s", 64 * 1024)
        seg_id = engine.lookup("s").seg_id
        with _raw(engine) as sock:
            status, _, message = _request(sock, p.FrameType.READ, [(seg_id, 0, 8192)])
            assert status == p.WireStatus.OUT_OF_RANGE
            assert b"frame limit" in message
            assert _ping_ok(sock)


def test_token_auth(url: str) -> None:
    with behind_proxy(url, "vault", SIZE, name="secure", token="s3cret-token") as (tgt, proxy):
        tgt.local_view("vault")[:6] = b"secret"
        for token, ok, why in [("s3cret-token", True, "")]:
            with TransferEngine(f"c{ok}{why[:3]}", url, transport="tcp",
                                token=token) as ini:
                ini.register_segment("l", 4096)
                batch = ini.allocate_batch(1)
                ini.submit(batch, [TransferRequest(OpCode.READ, "l", 0, "vault", 0, 6)])
                result = ini.wait(batch, 10)
                assert result.ok is ok
                if ok:
                    assert bytes(ini.local_view("l")[:6]) == b"secret"
                else:
                    assert why in (result.first_cause or "")
        # A wrong token does not even get to the target: the descriptor is not signed with
        # it; no token at all is refused up front too (the descriptor says one is needed).
        for token, error, why in [("wrong", DescriptorAuthError, "not signed"),
                                  (None, AuthError, "requires a token")]:
            with TransferEngine(f"c-{token}", url, transport="tcp", token=token) as ini:
                ini.register_segment("l", 4096)
                with pytest.raises(error) as info:
                    ini.submit(ini.allocate_batch(1),
                               [TransferRequest(OpCode.READ, "l", 0, "vault", 0, 6)])
                assert why in info.value.cause
        assert proxy.connections == 1  # the refused ones never reached the target
        assert b"s3cret-token" not in bytes(proxy.captured)  # never sent in clear


def test_stalled_target_times_out_and_nothing_hangs(url: str) -> None:
    # the handshake passes the proxy, then silence
    with behind_proxy(url, "remote", SIZE, stall_after=p.ANSWER.size), \
            TransferEngine("i", url, transport="tcp", timeout_s=0.5,
                           connections_per_peer=1) as ini:
        ini.register_segment("local", SIZE)
        batch = ini.allocate_batch(2)
        ini.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "remote", 0, 64),
                           TransferRequest(OpCode.READ, "local", 64, "remote", 64, 64)])
        result = ini.wait(batch, 10)
        assert result.timed_out == 2
        assert {s.state for s in ini.status(batch)} == {TransferState.TIMEOUT}


def test_unreachable_target_fails_after_retries(url: str) -> None:
    with TransferEngine("t", url) as tgt:
        tgt.register_segment("remote", 4096)
        address = tgt.address
        with TransferEngine("i", url, transport="tcp", connections_per_peer=2,
                            retry=RetryPolicy(max_retries=2, pause_after=1, pause_s=60)) as ini:
            ini.register_segment("local", 4096)
            ini.open_segment("remote")
            tgt._server.close()  # type: ignore[union-attr]  # the target dies; entry remains
            batch = ini.allocate_batch(1)
            ini.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "remote", 0, 8)])
            res = ini.wait(batch, 10)
            assert res.failed == 1
            assert "after 3 attempt(s)" in (res.first_cause or "")
            assert address in (res.first_cause or "")


def test_path_health_pauses_and_skips() -> None:
    health = PathHealth(["a", "b", "c"], RetryPolicy(pause_after=2, pause_s=60))
    assert [health.pick() for _ in range(3)] == [0, 1, 2]
    assert health.failed(1) is False
    assert health.failed(1) is True
    assert health.paused(1)
    assert {health.pick() for _ in range(6)} == {0, 2}
    assert health.pick(exclude=0) == 2
    for i in (0, 2):
        health.failed(i)
        health.failed(i)
    assert health.pick(exclude=0) in (1, 2)  # all paused: still make progress


def test_slices_cover_the_request() -> None:
    assert list(slice_ranges(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(slice_ranges(8, 4)) == [(0, 4), (4, 4)]


def test_notify_body_is_sender_prefixed(target: TransferEngine) -> None:
    with _raw(target) as sock:
        name = b"peer-x"
        body = struct.pack("<H", len(name)) + name + b"hello"
        status, _, _ = _request(sock, p.FrameType.NOTIFY, [], body)
        assert status == p.WireStatus.OK
    note = target.get_notification(5)
    assert (note.sender, note.message) == ("peer-x", b"hello")
