"""LeaseKeeper: heartbeats, crash cleanup across processes, recovery after server restarts."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.metadata import (
    LeaseKeeper,
    MetadataClient,
    MetadataError,
    MetadataServer,
    key_prefix,
    open_metadata,
)
from tests.fixtures.servers import ServerProcess
from tests.metadata._util import start_publisher, wait_until


def _key() -> str:
    return key_prefix(f"k-{uuid.uuid4().hex[:10]}") + "segment"


def test_keeper_outlives_the_ttl_and_stop_revokes(client: MetadataClient) -> None:
    key = _key()
    keeper = LeaseKeeper(client, ttl_s=1.0).start()
    keeper.publish(key, b"v1")
    keeper.publish(key, b"v2")  # republishing replaces the value
    time.sleep(1.6)  # past the TTL: only the heartbeat keeps it
    assert client.get(key) == b"v2"
    assert keeper.healthy
    assert keeper.regrants == 0
    keeper.stop()
    assert client.get(key) is None  # revoked at once, not after the TTL
    keeper.stop()  # idempotent
    assert keeper.lease is None


def test_unpublish_deletes_and_forgets(tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c, LeaseKeeper(c, ttl_s=5) as keeper:
        keeper.publish("kvctl/a", b"1")
        keeper.publish("kvctl/b", b"2")
        assert keeper.unpublish("kvctl/a") is True
        assert keeper.unpublish("kvctl/a") is False
        assert c.list("kvctl/") == {"kvctl/b": b"2"}


def test_keeper_regrants_and_republishes_when_the_lease_is_lost(tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c:
        keeper = LeaseKeeper(c, ttl_s=0.9).start()
        keeper.publish("kvctl/x", b"v")
        lost = keeper.lease
        assert lost is not None
        c.revoke(lost)  # as if the service forgot it
        assert c.get("kvctl/x") is None
        wait_until(lambda: c.get("kvctl/x") == b"v", 3.0)
        assert keeper.regrants == 1
        assert keeper.lease != lost
        keeper.stop()


def test_keeper_validates_its_settings(tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c:
        with pytest.raises(UsageError):
            LeaseKeeper(c, ttl_s=0)
        with pytest.raises(UsageError):
            LeaseKeeper(c, ttl_s=1, interval_s=2)
        keeper = LeaseKeeper(c, ttl_s=1)
        with pytest.raises(UsageError):
            keeper.publish("kvctl/x", b"v")  # not started
        keeper.start().stop()
        with pytest.raises(UsageError):
            keeper.start()


def test_keeper_start_raises_when_the_service_is_down() -> None:
    with open_metadata("http://127.0.0.1:1", timeout_s=1) as c, pytest.raises(MetadataError):
        LeaseKeeper(c, ttl_s=1).start()


# -- a crashed process's entries vanish ---------------------------------------------------

CRASH_BACKENDS = [
    pytest.param("file", id="file"),
    pytest.param("http", id="http", marks=pytest.mark.integration),
    pytest.param("etcd", id="etcd", marks=pytest.mark.integration),
    pytest.param("redis", id="redis", marks=pytest.mark.integration),
]


@pytest.mark.parametrize("kind", CRASH_BACKENDS)
def test_sigkilled_publishers_entry_vanishes_within_ttl(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from tests.metadata.conftest import url_for

    url = url_for(kind, request, tmp_path)
    ttl_s = 1.5  # margin for a loaded CI machine: the child must renew every 0.5 s
    key = _key()
    proc = start_publisher(url, key, ttl_s)
    try:
        with open_metadata(url) as c:
            assert c.get(key) == b"alive"
            time.sleep(ttl_s * 1.2)  # past one TTL: the child's heartbeat keeps it
            assert c.get(key) == b"alive"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            took = wait_until(lambda: c.get(key) is None, ttl_s + 3.0)
            assert took <= ttl_s + 3.0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


# -- recovery after the server restarts ---------------------------------------------------


def _recovers(server_url: str, restart: Callable[[], None]) -> None:
    key = _key()
    with open_metadata(server_url, timeout_s=2) as c:
        keeper = LeaseKeeper(c, ttl_s=1.0).start()
        keeper.publish(key, b"v")
        restart()
        # A plain call works again on the next try (stale connections are replaced)...
        c.put(key + "-plain", b"p")
        assert c.get(key + "-plain") == b"p"
        # ...and the keeper notices its lease is gone and publishes again.
        wait_until(lambda: c.get(key) == b"v", 6.0)
        assert keeper.regrants >= 1
        assert keeper.healthy
        keeper.stop()
        assert c.get(key) is None


@pytest.mark.integration
def test_redis_restart_keeper_republishes(spawn_redis: Callable[[], ServerProcess]) -> None:
    server = spawn_redis()
    _recovers(server.url, lambda: server.restart(wipe=True))


@pytest.mark.integration
def test_etcd_restart_keeper_republishes(spawn_etcd: Callable[[], ServerProcess]) -> None:
    server = spawn_etcd()
    _recovers(server.url, lambda: server.restart(wipe=True))


@pytest.mark.integration
def test_etcd_restart_with_data_keeps_entries(spawn_etcd: Callable[[], ServerProcess]) -> None:
    server = spawn_etcd()
    with open_metadata(server.url) as c:
        c.put("kvctl/persistent", b"v")
        server.restart()
        assert c.get("kvctl/persistent") == b"v"


@pytest.mark.integration
def test_http_server_restart_keeper_republishes() -> None:
    server = MetadataServer(port=0).start()
    port = server.port

    def restart() -> None:
        server.stop()
        server.port = port
        server.start()

    try:
        _recovers(server.url, restart)
    finally:
        server.stop()


@pytest.mark.integration
def test_http_server_with_data_dir_keeps_state_across_restart(tmp_path: Path) -> None:
    with MetadataServer(port=0, data_dir=tmp_path) as first, open_metadata(first.url) as c:
        lease = c.grant_lease(30)
        c.put("kvctl/a", b"1", lease=lease)
        c.put("kvctl/b", b"2")
        port = first.port
    with MetadataServer(port=port, data_dir=tmp_path) as second, open_metadata(second.url) as c:
        assert c.list("kvctl/") == {"kvctl/a": b"1", "kvctl/b": b"2"}
        c.keepalive(lease)  # leases survive too
        c.revoke(lease)
        assert c.list("kvctl/") == {"kvctl/b": b"2"}


@pytest.mark.integration
def test_etcd_fails_over_to_the_next_endpoint(etcd_url: str) -> None:
    from tests.fixtures.servers import free_port

    live = etcd_url.removeprefix("etcd://")
    url = f"etcd://127.0.0.1:{free_port()},{live}"
    with open_metadata(url, timeout_s=2) as c:
        c.put("kvctl/failover", b"v")
        assert c.get("kvctl/failover") == b"v"
        assert c.delete("kvctl/failover")


def test_unreachable_servers_name_the_url_with_a_hint() -> None:
    from tests.fixtures.servers import free_port

    for url in (f"http://127.0.0.1:{free_port()}", f"etcd://127.0.0.1:{free_port()}",
                f"redis://127.0.0.1:{free_port()}"):
        with open_metadata(url, timeout_s=1) as c, pytest.raises(MetadataError) as info:
            c.get("kvctl/x")
        assert url in info.value.cause
        assert info.value.hint
        assert int(info.value.exit_code) == 3
