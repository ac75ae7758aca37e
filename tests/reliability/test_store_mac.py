"""With a token, a store control connection is bound to its login: every message after it
carries a MAC keyed by both nonces and numbered per direction, so a relay that passed a
real login through (issue 15.6: "relaying the real master's challenge gave the attacker an
admin session that removed 20/20 objects") can neither inject, alter nor replay requests."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import msgspec
import pytest

from kvctl.net import auth
from kvctl.net.framing import FrameReader
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import ProtocolError
from kvctl.store.master import MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer
from kvctl.store.tenants import parse_tenants

TOKEN = "store-mac-token-0123"
TENANT = "tenant-mac-token-4567"


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = MasterServer(MasterCore(), token=TOKEN, tenants=parse_tenants([f"t={TENANT}"]))
    node = StorageNode(server.address, node_id="n", capacity_bytes=8 << 20, token=TOKEN,
                       heartbeat_s=0.1)
    yield server
    node.close()
    server.close()


class _Raw:
    """A hand-driven connection: the real client's login, then whatever a relay sends."""

    def __init__(self, address: str, token: str, *, client_nonce: bytes | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.codec = p.Codec()
        self.reader = FrameReader(self.sock, self.codec.frames)
        hello_payload = self.reader.recv().payload
        hello = self.codec.decode_reply(hello_payload)
        assert isinstance(hello, p.Hello)
        mine = auth.new_nonce() if client_nonce is None else client_nonce
        login = msgspec.msgpack.encode(p.Login(answer=auth.respond(token, hello.nonce,
                                                                   p.AUTH_CONTEXT),
                                               client_nonce=mine))
        self.codec.frames.send(self.sock, p.PROTOCOL_VERSION, login)
        self.reply = self.codec.decode_reply(self.reader.recv().payload)
        bound = (p.login_transcript(hello_payload, login, self.reply)
                 if isinstance(self.reply, p.Ok) else b"")
        self.key = auth.session_key(token, hello.nonce, mine, p.AUTH_CONTEXT, bound)

    def closed(self) -> bool:
        self.sock.settimeout(5)
        try:
            while chunk := self.sock.recv(65536):
                del chunk  # a Fail before the close is fine; the connection must end
            return True
        except (ConnectionResetError, TimeoutError):
            return True

    def close(self) -> None:
        self.sock.close()


def test_a_request_injected_after_a_relayed_login_is_refused(master: MasterServer) -> None:
    with StoreClient(master.address, token=TOKEN) as client:
        client.put("precious", b"x" * 1000)
    raw = _Raw(master.address, TOKEN)  # the victim's login, relayed
    assert isinstance(raw.reply, p.Ok)
    # The relay has no session key: a Remove in plain msgpack, as before the MAC.
    with contextlib.suppress(OSError):
        raw.sock.sendall(p.Codec().encode(p.Remove(keys=["precious"])))
    assert raw.closed()
    raw.close()
    with StoreClient(master.address, token=TOKEN) as client:
        assert client.get("precious") == b"x" * 1000


def test_a_sealed_request_is_served_and_a_replayed_one_closes_the_connection(
        master: MasterServer) -> None:
    raw = _Raw(master.address, TOKEN)
    raw.codec.mac = auth.FrameMac(raw.key, client=True)
    frame = raw.codec.encode(p.Exists(keys=["nothing"]))
    raw.sock.sendall(frame)
    assert isinstance(raw.codec.decode_reply(raw.reader.recv().payload), p.Bools)
    with contextlib.suppress(OSError):
        raw.sock.sendall(frame)  # the same bytes again: its number is spent
    assert raw.closed()
    raw.close()


def test_a_login_without_the_clients_challenge_is_refused(master: MasterServer) -> None:
    """Stripping the client's nonce from a relayed login would give the relay a session
    without MACs."""
    raw = _Raw(master.address, TOKEN, client_nonce=b"")
    assert isinstance(raw.reply, p.Fail)
    assert raw.reply.error.code == "unauthorized"
    raw.close()


def test_a_forged_reply_is_refused_by_the_client() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    def fake() -> None:
        conn, _ = listener.accept()
        codec = p.Codec()
        reader = FrameReader(conn, codec.frames)
        nonce = auth.new_nonce()
        with conn:
            hello = msgspec.msgpack.encode(p.Hello(
                version=p.PROTOCOL_VERSION, auth=True, nonce=nonce,
                max_frame_bytes=p.DEFAULT_MAX_FRAME_BYTES, login_binding=p.LOGIN_BINDING))
            codec.frames.send(conn, p.PROTOCOL_VERSION, hello)
            payload = reader.recv().payload
            login = codec.decode_request(payload)
            assert isinstance(login, p.Login)
            # It knows the token (a real master's answer, relayed), so the proof passes...
            bound = p.login_transcript(hello, payload, p.Ok())
            codec.send(conn, p.Ok(proof=auth.server_proof(TOKEN, nonce, login.client_nonce,
                                                          p.AUTH_CONTEXT, bound)))
            reader.recv()
            codec.send(conn, p.Bools(values=[True]))  # ...but this reply is unsealed
            with contextlib.suppress(OSError):
                conn.recv(100)

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    conn = MasterConnection(address, token=TOKEN, timeout_s=5)
    with pytest.raises(ProtocolError, match="MAC"):
        conn.call(p.Exists(keys=["k"]))
    conn.close()
    thread.join(5)
    listener.close()


def test_tenants_and_nodes_work_with_macs(master: MasterServer) -> None:
    with StoreClient(master.address, token=TENANT) as tenant:
        tenant.put("doc", b"tenant bytes")
        assert tenant.get("doc") == b"tenant bytes"
    with StoreClient(master.address, token=TOKEN) as admin:
        assert admin.get("t/doc") == b"tenant bytes"
