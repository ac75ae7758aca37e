"""A relay without the token cannot choose a store connection's namespace (issue 27.5).

It passed a real admin login through and rewrote only the login reply's ``namespace``, ""
to the namespace of a tenant whose token it holds: the admin's ``get("k")`` returned the
tenant's bytes and its acknowledged ``put("secret")`` landed at ``u/secret``. The master's
proof covered the two nonces only, and the reply came before the MACs. The proof and the
session key now cover the greeting, the login and the reply as sent, so any rewritten
field makes the client refuse the master before it sends a request."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest

from kvctl.net.framing import FrameCodec
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreAuthError
from kvctl.store.master import MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer
from kvctl.store.tenants import parse_tenants

ADMIN = "relay-admin-token-0123"
TENANT = "relay-tenant-token-4567"

Rewrite = Callable[[int, bytes], bytes]


class Relay:
    """A loopback TCP relay that holds no token: it passes every frame through, handing the
    server's ``n``-th frame (0: the greeting, 1: the login reply) to ``rewrite`` first."""

    def __init__(self, upstream: str, rewrite: Rewrite) -> None:
        self._upstream = upstream
        self._rewrite = rewrite
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.rewritten = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            host, _, port = self._upstream.rpartition(":")
            server = socket.create_connection((host, int(port)), timeout=10)
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True
                             ).start()
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True
                             ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        frames = FrameCodec(p.MAGIC)
        n = 0
        with contextlib.suppress(Exception):  # any end of either side ends the relay
            while True:
                frame = frames.recv(src)
                payload = frame.payload
                if from_server and n < 2:
                    changed = self._rewrite(n, payload)
                    self.rewritten += changed != payload
                    payload = changed
                n += 1
                frames.send(dst, frame.kind, payload)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sock.close()


def _namespace_to_tenant(n: int, payload: bytes) -> bytes:
    if n != 1:
        return payload
    reply = msgspec.msgpack.decode(payload, type=p.Reply)
    assert isinstance(reply, p.Ok)
    return msgspec.msgpack.encode(msgspec.structs.replace(reply, namespace="u/"))


def _greeting_field(n: int, payload: bytes) -> bytes:
    if n != 0:
        return payload
    hello = msgspec.msgpack.decode(payload, type=p.Reply)
    assert isinstance(hello, p.Hello)
    return msgspec.msgpack.encode(msgspec.structs.replace(hello, attached_bytes=0,
                                                          instance="relay"))


def _downgrade(n: int, payload: bytes) -> bytes:
    if n != 0:
        return payload
    hello = msgspec.msgpack.decode(payload, type=p.Reply)
    assert isinstance(hello, p.Hello)
    return msgspec.msgpack.encode(msgspec.structs.replace(hello, login_binding=0))


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = MasterServer(MasterCore(), token=ADMIN, tenants=parse_tenants([f"u={TENANT}"]))
    node = StorageNode(server.address, node_id="n", capacity_bytes=8 << 20, token=ADMIN,
                       heartbeat_s=0.1)
    yield server
    node.close()
    server.close()


def test_a_rewritten_login_reply_namespace_is_refused(master: MasterServer) -> None:
    with StoreClient(master.address, token=TENANT) as tenant:
        tenant.put("k", b"tenant bytes")
    relay = Relay(master.address, _namespace_to_tenant)
    try:
        with pytest.raises(StoreAuthError, match="did not prove") as caught:
            StoreClient(relay.address, token=ADMIN, timeout_s=5)
        assert relay.rewritten >= 1
        assert "rewrote the login" in (caught.value.hint or "")
    finally:
        relay.close()
    with StoreClient(master.address, token=ADMIN) as admin:  # nothing landed anywhere
        assert admin.namespace == ""
        assert admin.batch_exists(["secret", "u/secret"]) == [False, False]
        assert admin.get("u/k") == b"tenant bytes"


@pytest.mark.parametrize("rewrite", [_greeting_field, _downgrade], ids=["field", "binding-0"])
def test_a_rewritten_greeting_is_refused(master: MasterServer, rewrite: Rewrite) -> None:
    relay = Relay(master.address, rewrite)
    try:
        with pytest.raises(StoreAuthError):
            MasterConnection(relay.address, token=ADMIN, timeout_s=5)
        assert relay.rewritten >= 1
    finally:
        relay.close()


def test_an_untouched_relay_still_works(master: MasterServer) -> None:
    relay = Relay(master.address, lambda n, payload: payload)
    try:
        with StoreClient(relay.address, token=ADMIN, timeout_s=5) as admin:
            assert admin.namespace == ""
            admin.put("through", b"relayed")
            assert admin.get("through") == b"relayed"
    finally:
        relay.close()
