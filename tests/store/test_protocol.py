"""Master protocol robustness: bad frames get error replies; the master keeps serving."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import msgspec
import pytest

from kvctl.store import protocol as p
from kvctl.store.errors import StoreAuthError, StoreUnavailableError
from kvctl.store.master import MasterCore
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer

HEADER = struct.Struct("<4sB3xI")


@pytest.fixture
def server() -> Iterator[MasterServer]:
    srv = MasterServer(MasterCore(), max_frame_bytes=64 * 1024)
    yield srv
    srv.close()


def raw(server: MasterServer) -> tuple[socket.socket, p.Codec]:
    sock = socket.create_connection((server.host, server.port), timeout=5)
    codec = p.Codec()
    hello = codec.decode_reply(codec.frames.recv(sock).payload)
    assert isinstance(hello, p.Hello)
    assert hello.version == p.PROTOCOL_VERSION
    return sock, codec


def reply(sock: socket.socket, codec: p.Codec) -> p.Reply:
    return codec.decode_reply(codec.frames.recv(sock).payload)


def test_garbage_payload_gets_error_and_connection_survives(server: MasterServer) -> None:
    sock, codec = raw(server)
    with sock:
        sock.sendall(HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, 5) + b"\xc1\xc1\xc1\xc1\xc1")
        bad = reply(sock, codec)
        assert isinstance(bad, p.Fail)
        assert bad.error.code == "bad_request"
        # Right shape, wrong types: rejected by the typed decoder.
        wrong = msgspec.msgpack.encode(["get", "not-a-list", True])
        sock.sendall(HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, len(wrong)) + wrong)
        bad2 = reply(sock, codec)
        assert isinstance(bad2, p.Fail)
        assert bad2.error.code == "bad_request"
        # Unknown version: error, connection still usable.
        body = msgspec.msgpack.encode(p.Status())
        sock.sendall(HEADER.pack(p.MAGIC, 99, len(body)) + body)
        ver = reply(sock, codec)
        assert isinstance(ver, p.Fail)
        assert ver.error.code == "version"
        codec.send(sock, p.Exists(keys=["a"]))
        ok = reply(sock, codec)
        assert isinstance(ok, p.Bools)
        assert ok.values == [False]


def test_oversized_frame_gets_error_then_close(server: MasterServer) -> None:
    sock, codec = raw(server)
    with sock:
        sock.sendall(HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, 10 << 20))
        bad = reply(sock, codec)
        assert isinstance(bad, p.Fail)
        assert bad.error.code == "too_large"
        assert sock.recv(1) == b""  # closed
    # Others are still served.
    conn = MasterConnection(server.address)
    assert isinstance(conn.call(p.Status()), p.StatusReply)
    conn.close()


def test_bad_magic_and_too_many_keys(server: MasterServer) -> None:
    sock, codec = raw(server)
    with sock:
        codec.send(sock, p.Exists(keys=[]))
        assert isinstance(reply(sock, codec), p.Bools)
        codec.send(sock, p.Get(keys=["k"] * (p.MAX_BATCH + 1)))
        big = reply(sock, codec)
        assert isinstance(big, p.Fail)
        assert big.error.code == "too_large"
        sock.sendall(HEADER.pack(b"HTTP", 1, 0))
        bad = reply(sock, codec)
        assert isinstance(bad, p.Fail)
        assert bad.error.code == "bad_request"
    conn = MasterConnection(server.address)
    assert isinstance(conn.call(p.Exists(keys=["x"])), p.Bools)
    conn.close()


def test_token_auth() -> None:
    with MasterServer(MasterCore(), token="s3cret") as srv:
        with pytest.raises(StoreAuthError, match="requires a token"):
            MasterConnection(srv.address)
        with pytest.raises(StoreAuthError, match="refused the token"):
            MasterConnection(srv.address, token="wrong")
        conn = MasterConnection(srv.address, token="s3cret")
        assert isinstance(conn.call(p.Status()), p.StatusReply)
        conn.close()
        # A raw client that skips the login gets refused, not served.
        sock = socket.create_connection((srv.host, srv.port), timeout=5)
        codec = p.Codec()
        codec.frames.recv(sock)
        codec.send(sock, p.Status())
        refused = reply(sock, codec)
        assert isinstance(refused, p.Fail)
        assert refused.error.code == "unauthorized"
        sock.close()


def test_silent_master_times_out_with_a_clear_error() -> None:
    """A master that greets and then never answers: the wait ends at the timeout (kernel
    timeouts, even while polling first) with an error that says so."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        held.append(conn)
        p.Codec().send(conn, p.Hello(version=p.PROTOCOL_VERSION, auth=False, nonce=b"",
                                     max_frame_bytes=p.DEFAULT_MAX_FRAME_BYTES))

    t = threading.Thread(target=serve)
    t.start()
    try:
        conn = MasterConnection(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.3,
                                spin_s=0.001)
        t.join()
        with pytest.raises(StoreUnavailableError, match=r"did not answer within 0\.3 s"):
            conn.call(p.Exists(keys=["k"]))
        conn.close()
    finally:
        listener.close()
        for c in held:
            c.close()
