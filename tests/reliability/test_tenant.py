"""Tenant namespaces: a tenant's token reaches only keys under ``<tenant>/``, whatever it
sends; the shared (admin) token sees everything."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvctl.config import load_section, redacted
from kvctl.errors import ConfigError
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import (
    ObjectNotFoundError,
    StoreAuthError,
    StoreForbiddenError,
    StoreUnavailableError,
)
from kvctl.store.master import MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer
from kvctl.store.settings import StoreSettings
from kvctl.store.tenants import parse_tenants
from tests.fixtures.cli import CliResult
from tests.reliability.conftest import kept_logging

ADMIN = "admin-token-0123"
TOKENS = {"alpha": "alpha-token-4567", "beta": "beta-token-89ab"}


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = MasterServer(MasterCore(), token=ADMIN,
                          tenants=parse_tenants(f"{n}={t}" for n, t in TOKENS.items()))
    node = StorageNode(server.address, node_id="n", capacity_bytes=16 << 20, token=ADMIN,
                       heartbeat_s=0.1)
    yield server
    node.close()
    server.close()


def _forbidden(conn: MasterConnection, msg: p.Request) -> str:
    reply = conn.call(msg)
    assert isinstance(reply, p.Fail), reply
    assert reply.error.code == "forbidden", reply.error
    return reply.error.cause


def test_tenant_cannot_reach_another_tenants_objects(master: MasterServer) -> None:
    with StoreClient(master.address, token=TOKENS["alpha"]) as alpha, \
            StoreClient(master.address, token=TOKENS["beta"]) as beta, \
            StoreClient(master.address, token=ADMIN) as admin:
        assert (alpha.namespace, beta.namespace, admin.namespace) == ("alpha/", "beta/", "")
        # Same client API: the prefix is added and stripped transparently.
        alpha.put("doc", b"alpha secret")
        beta.put("doc", b"beta data")
        assert alpha.get("doc") == b"alpha secret"
        assert beta.get("doc") == b"beta data"
        assert [o.key for o in alpha.list("")[0]] == ["doc"]
        assert alpha.stat("doc").key == "doc"
        # Through its client, beta reaches only beta/...: alpha's keys do not exist for it.
        with pytest.raises(ObjectNotFoundError):
            beta.get("alpha/doc")
        assert not beta.exists("alpha/doc")
        assert beta.remove("alpha/doc") is False
        # The admin token sees every tenant's keys under their prefixes.
        assert [o.key for o in admin.list("")[0]] == ["alpha/doc", "beta/doc"]
        assert admin.get("alpha/doc") == b"alpha secret"

    # On the wire, whatever beta sends about alpha's keys is refused: read, list, stat,
    # remove, overwrite, pin, release; and beta cannot pose as a storage node.
    conn = MasterConnection(master.address, token=TOKENS["beta"])
    try:
        assert conn.namespace == "beta/"
        cause = _forbidden(conn, p.Get(keys=["alpha/doc"]))
        assert "outside tenant 'beta'" in cause
        _forbidden(conn, p.Get(keys=["beta/doc", "alpha/doc"]))  # one bad key: all refused
        _forbidden(conn, p.Get(keys=["beta/doc"], release_keys=["alpha/doc"],
                               release_versions=[1]))
        _forbidden(conn, p.Exists(keys=["alpha/doc"]))
        _forbidden(conn, p.Stat(key="alpha/doc"))
        _forbidden(conn, p.Remove(keys=["alpha/doc"]))
        _forbidden(conn, p.Put(items=[p.PutItem("alpha/doc", 5, 1)]))
        _forbidden(conn, p.Pin(key="alpha/doc"))
        _forbidden(conn, p.ListKeys(prefix=""))
        _forbidden(conn, p.ListKeys(prefix="alpha/"))
        _forbidden(conn, p.RegisterNode(node_id="evil", epoch="e", segment="s", endpoint="x:1",
                                        host_id="h", capacity_bytes=1 << 20))
        _forbidden(conn, p.Heartbeat(node_id="n", epoch="e"))
        conn.send(p.Commit(keys=["alpha/doc"], versions=[1], ok=False))  # no reply: dropped
        # Its own reservation does not let beta place alpha's keys (or beta's keys at
        # offsets it does not own): the report is dropped, the connection stays in sync.
        grant = conn.call(p.Reserve(size=64 << 10))
        assert isinstance(grant, p.Reservation)
        conn.send(p.PutAt(reservation=grant.reservation, keys=["alpha/doc", "beta/x"],
                          sizes=[5, 5], checksums=[1, 1], offsets=[0, 1 << 30]))
        listed = conn.call(p.ListKeys(prefix="beta/"))  # still in sync, own keys only
        assert isinstance(listed, p.KeyList)
        assert [o.key for o in listed.objects] == ["beta/doc"]
    finally:
        conn.close()
    with StoreClient(master.address, token=ADMIN) as admin:
        assert admin.get("alpha/doc") == b"alpha secret"  # untouched by all of the above
        assert admin.remove("beta/doc")


def test_forbidden_surfaces_as_a_typed_error(master: MasterServer) -> None:
    with StoreClient(master.address, token=TOKENS["alpha"]) as alpha:
        alpha.namespace = "beta/"  # a client that tries to step outside on its own
        with pytest.raises(StoreForbiddenError) as info:
            alpha.get("doc")
        assert info.value.hint
    with pytest.raises(StoreAuthError):
        StoreClient(master.address, token="not-a-tenant")


def test_tenant_settings_are_validated_and_never_shown() -> None:
    settings = load_section(StoreSettings, env={"KVCTL_STORE_TENANTS": "a=tok1,b=tok2"})
    assert [t.name for t in parse_tenants(settings.tenants)] == ["a", "b"]
    assert redacted(settings)["tenants"] == "***"
    assert "tok1" not in repr(parse_tenants(settings.tenants))
    for bad, needle in [(["a"], "no token"), (["a/b=t"], "not valid"), (["=t"], "not valid"),
                        (["a=t", "a=u"], "twice"), (["a=t", "b=t"], "reuses")]:
        with pytest.raises(ConfigError, match=needle):
            parse_tenants(bad)
    with pytest.raises(ConfigError, match="no shared token"):
        MasterServer(MasterCore(), tenants=parse_tenants(["a=t"]))
    with pytest.raises(ConfigError, match="uses the shared token"):
        MasterServer(MasterCore(), token="t", tenants=parse_tenants(["a=t"]))


def test_cli_tenant_flag(kvctl: Callable[..., CliResult], master: MasterServer) -> None:
    with kept_logging():
        r = kvctl("store", "master", "--listen", "127.0.0.1:0", "--tenant", "a=x")
        assert r.exit_code == 2
        assert "no shared token" in r.stderr
        r = kvctl("store", "master", "--listen", "127.0.0.1:0", "--tenant", "nope",
                  env={"KVCTL_TOKEN": ADMIN})
        assert r.exit_code == 2
        assert "has no token" in r.stderr
        # A tenant's CLI put lands under its prefix; the admin sees it there.
        r = kvctl("store", "ls", "--master", master.address, "--json",
                  env={"KVCTL_TOKEN": TOKENS["alpha"]})
        assert r.exit_code == 0, r.stderr
        assert r.json()["objects"] == []
    with StoreClient(master.address, token=TOKENS["alpha"]) as alpha:
        alpha.put("cli", b"x")
    with kept_logging():
        r = kvctl("store", "ls", "--master", master.address, "--json",
                  env={"KVCTL_TOKEN": ADMIN})
        assert [o["key"] for o in r.json()["objects"]] == ["alpha/cli"]
        r = kvctl("store", "stat", "alpha/cli", "--master", master.address,
                  env={"KVCTL_TOKEN": TOKENS["beta"]})
        assert r.exit_code == 1  # beta/alpha/cli: not there for beta


def test_tenant_token_does_not_open_the_nodes_tcp_data_path(master: MasterServer) -> None:
    """Documented limit: node segments are guarded by the shared token over tcp, so a
    tenant's client cannot use that path (it never reaches node memory with its token)."""
    with StoreClient(master.address, token=TOKENS["alpha"], transport="tcp",
                     timeout_s=5) as alpha:
        with pytest.raises(StoreUnavailableError) as info:
            alpha.put("over-tcp", b"x" * 4096)
        assert "token" in info.value.cause
        assert not alpha.exists("over-tcp")  # the failed put was revoked, not half-visible


def test_tenant_connections_get_no_attached_bytes() -> None:
    """A master hosting its node attaches object bytes to get answers, but never on a
    tenant's connection: a tenant controls the lease that protects a range while it is
    sent, so it could be handed bytes that meanwhile became another tenant's."""
    server = MasterServer(MasterCore(), token=ADMIN,
                          tenants=parse_tenants(f"{n}={t}" for n, t in TOKENS.items()))
    node = StorageNode(server.address, node_id="n", capacity_bytes=16 << 20, token=ADMIN,
                       heartbeat_s=0.1)
    server.serve_local(node.hold)
    try:
        with StoreClient(server.address, token=TOKENS["alpha"]) as alpha:
            alpha.put("doc", b"alpha secret")
            assert alpha.get("doc") == b"alpha secret"  # still served, from the node
        for token, expect in ((TOKENS["alpha"], []), (ADMIN, [0])):
            conn = MasterConnection(server.address, token=token)
            try:
                assert conn.attached_bytes > 0  # the master offers it ...
                reply = conn.call(p.Get(keys=["alpha/doc"], lease=False,
                                        attached_bytes=1 << 20))
                assert isinstance(reply, p.GetReply)
                assert reply.attached == expect  # ... to the admin token only
                views = [memoryview(bytearray(12)) for _ in reply.attached]
                conn.recv_data(views)
                assert [bytes(v) for v in views] == [b"alpha secret"] * len(expect)
            finally:
                conn.close()
    finally:
        node.close()
        server.close()
