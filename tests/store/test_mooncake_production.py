"""The Mooncake smoke is safe against a production master, and wrong-protocol addresses fail
fast: a real ``mooncake_master`` with a real storage process (``mooncake_client``) on
loopback, its HTTP endpoint read independently of the code under test."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.server import MasterServer
from tests.fixtures.cli import CliResult
from tests.fixtures.schemas import validate_document

pytestmark = pytest.mark.integration

Kvctl = Callable[..., CliResult]
STORAGE_BYTES = 256 << 20


class Master:
    """A running mooncake_master: RPC address and HTTP base URL."""

    def __init__(self, address: str, metrics_url: str) -> None:
        self.address = address
        self.metrics_url = metrics_url

    def http(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.metrics_url}{path}", timeout=5) as reply:
            return str(reply.read().decode())

    def segments(self) -> dict[str, int]:
        """Mounted segments by name → capacity in bytes, from ``/get_segments_detail``."""
        doc = json.loads(self.http("/get_segments_detail"))
        return {s["segment_name"]: int(s["size_bytes"]) for s in doc["segments"]}

    def stored_keys(self) -> list[str]:
        """Every key the master holds, from ``/get_all_keys``."""
        return [k for k in self.http("/get_all_keys").split() if k]


def _start(storage_bytes: int) -> Iterator[Master]:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeMaster, MooncakeUnavailableError

    try:
        master = MooncakeMaster(storage_bytes=storage_bytes)
    except MooncakeUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc.cause}")
    with master:
        yield Master(master.address, master.metrics_url)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Master]:
    """mooncake_master + one storage process of 256 MiB."""
    yield from _start(STORAGE_BYTES)


@pytest.fixture(scope="module")
def bare() -> Iterator[Master]:
    """mooncake_master with no storage at all."""
    yield from _start(0)


@pytest.fixture
def kvctl_master() -> Iterator[str]:
    """A kvctl store master (no nodes) on a free loopback port."""
    server = MasterServer(MasterCore(MasterConfig()))
    try:
        yield server.address
    finally:
        server.close()


# -- client-only, storage required, keys removed, segments named -----------------------------


def test_smoke_mounts_no_segment_into_the_pool(cluster: Master) -> None:
    from kvctl.store.smoke import run_mooncake

    before = cluster.segments()
    during: list[dict[str, int]] = []

    def look(check: str) -> None:  # the smoke's client is connected while checks run
        if check in ("single", "concurrent", "exists-remove"):
            during.append(cluster.segments())

    report = run_mooncake(cluster.address, metrics_url=cluster.metrics_url, progress=look)
    assert report.failed == [], report.failed
    assert len(before) == 1
    assert next(iter(before.values())) == STORAGE_BYTES
    assert len(during) == 3
    assert all(seen == before for seen in during), (before, during)
    assert cluster.segments() == before
    status = {c.name: c for c in report.checks}
    assert status["client-only"].status == "pass"
    assert "mounted no segment" in status["client-only"].detail
    assert status["storage"].status == "pass"


def test_smoke_names_the_segments_that_held_its_objects(cluster: Master) -> None:
    from kvctl.store.smoke import run_mooncake

    report = run_mooncake(cluster.address, metrics_url=cluster.metrics_url)
    (segment,) = cluster.segments()
    assert [s.name for s in report.segments] == [segment]
    assert report.segments[0].objects > 100
    assert report.metrics_url == cluster.metrics_url
    cleanup = next(c for c in report.checks if c.name == "cleanup")
    assert cleanup.status == "pass"
    assert f"objects were on segment(s) {segment} (" in cleanup.detail


def test_smoke_removes_every_key_it_wrote(cluster: Master) -> None:
    from kvctl.store.smoke import run_mooncake

    assert not [k for k in cluster.stored_keys() if k.startswith("smoke/")]
    seen: list[str] = []

    def look(check: str) -> None:
        if check == "exists-remove":
            seen.extend(k for k in cluster.stored_keys() if k.startswith("smoke/"))

    report = run_mooncake(cluster.address, metrics_url=cluster.metrics_url, progress=look)
    assert len(seen) > 100  # the keys were there while the smoke ran ...
    assert not [k for k in cluster.stored_keys() if k.startswith("smoke/")]  # ... and gone
    cleanup = next(c for c in report.checks if c.name == "cleanup")
    assert cleanup.status == "pass"
    assert "(none left)" in cleanup.detail


class _Stop(Exception):
    pass


def test_smoke_removes_its_keys_when_it_stops_midway(cluster: Master) -> None:
    from kvctl.store.smoke import run_mooncake

    def stop_at_concurrent(check: str) -> None:
        if check == "concurrent":
            assert [k for k in cluster.stored_keys() if k.startswith("smoke/")]  # written
            raise _Stop

    with pytest.raises(_Stop):
        run_mooncake(cluster.address, metrics_url=cluster.metrics_url,
                     progress=stop_at_concurrent)
    assert not [k for k in cluster.stored_keys() if k.startswith("smoke/")]


def test_smoke_against_a_master_with_no_storage_fails_with_the_reason(bare: Master) -> None:
    from kvctl.store.mooncake_http import MooncakeNoStorageError
    from kvctl.store.smoke import run_mooncake

    assert bare.segments() == {}
    started = time.monotonic()
    with pytest.raises(MooncakeNoStorageError) as info:
        run_mooncake(bare.address, metrics_url=bare.metrics_url)
    assert time.monotonic() - started < 5
    assert info.value.cause.startswith(f"the master at {bare.address} has no storage mounted")
    assert info.value.hint is not None
    assert "start a mooncake storage process / client with global_segment_size > 0" in (
        info.value.hint)
    assert bare.segments() == {}
    assert bare.stored_keys() == []


def test_cli_smoke_no_storage_prints_error_and_hint(kvctl: Kvctl, bare: Master) -> None:
    r = kvctl("store", "smoke", "--backend", "mooncake", "--master", bare.address,
              "--metrics", bare.metrics_url)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"Error: the master at {bare.address} has no storage mounted" in r.stderr
    assert "Hint: start a mooncake storage process / client with global_segment_size > 0" in (
        r.stderr)


def test_smoke_without_the_metrics_endpoint_still_refuses_a_master_with_no_storage(
        bare: Master) -> None:
    # The default endpoint (master host, port 9003) is not this master's: the smoke says
    # so and still fails on the first put that finds no room, before any check runs.
    from kvctl.store.mooncake_http import MooncakeNoStorageError
    from kvctl.store.smoke import run_mooncake

    with pytest.raises(MooncakeNoStorageError) as info:
        run_mooncake(bare.address)
    assert "has no storage mounted" in info.value.cause
    assert bare.stored_keys() == []


def test_a_given_metrics_endpoint_that_does_not_answer_is_an_error(cluster: Master) -> None:
    from kvctl.store.mooncake_http import MooncakeMetricsUnavailableError
    from kvctl.store.smoke import run_mooncake

    with pytest.raises(MooncakeMetricsUnavailableError) as info:
        run_mooncake(cluster.address, metrics_url=cluster.address)  # the RPC port, not HTTP
    assert info.value.cause.startswith(
        f"cannot read mooncake_master's HTTP endpoint at http://{cluster.address}/health")
    assert not [k for k in cluster.stored_keys() if k.startswith("smoke/")]


def test_cli_smoke_json_names_segments_and_cleanup(kvctl: Kvctl, cluster: Master) -> None:
    r = kvctl("store", "smoke", "--backend", "mooncake", "--master", cluster.address,
              "--metrics", cluster.metrics_url, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert validate_document(doc) == "store.smoke"
    assert doc["ok"]
    (segment,) = cluster.segments()
    assert [s["name"] for s in doc["segments"]] == [segment]
    checks = {c["name"]: c["status"] for c in doc["checks"]}
    assert checks["storage"] == checks["client-only"] == checks["cleanup"] == "pass"
    r = kvctl("store", "smoke", "--backend", "mooncake", "--master", cluster.address,
              "--metrics", cluster.metrics_url)
    assert r.exit_code == 0, r.stderr
    assert "segments that held the smoke's objects" in r.stdout
    assert segment in r.stdout


# -- status ------------------------------------------------------------------------------------


def test_status_shows_health_segments_capacity_and_usage(kvctl: Kvctl, cluster: Master) -> None:
    (segment,) = cluster.segments()
    r = kvctl("store", "status", "--backend", "mooncake", "--master", cluster.address,
              "--metrics", cluster.metrics_url, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc: dict[str, Any] = r.json()
    assert validate_document(doc) == "store.status"
    assert doc["backend"] == "mooncake"
    assert doc["master"] == cluster.address
    assert doc["health"] == "ok"
    assert doc["service_ready"] is True
    assert doc["capacity_bytes"] == STORAGE_BYTES
    assert [s["name"] for s in doc["segments"]] == [segment]
    assert doc["segments"][0]["capacity_bytes"] == STORAGE_BYTES
    assert 0 <= doc["used_bytes"] <= STORAGE_BYTES
    r = kvctl("store", "status", "--backend", "mooncake", "--master", cluster.address,
              "--metrics", cluster.metrics_url)
    assert r.exit_code == 0, r.stderr
    assert f"mooncake_master {cluster.address}: ok" in r.stdout
    assert segment in r.stdout
    assert "256 MiB" in r.stdout


def test_status_of_a_master_with_no_storage_says_so(kvctl: Kvctl, bare: Master) -> None:
    r = kvctl("store", "status", "--backend", "mooncake", "--master", bare.address,
              "--metrics", bare.metrics_url)
    assert r.exit_code == 0, r.stderr
    assert "0 segments" in r.stdout
    assert f"the master at {bare.address} has no storage mounted" in r.stderr


# -- protocol mismatch, both directions ----------------------------------------------------------


def test_kvctl_client_at_a_mooncake_master_fails_fast(kvctl: Kvctl, cluster: Master) -> None:
    from kvctl.store.client import StoreClient
    from kvctl.store.errors import ProtocolError

    message = (f"{cluster.address} speaks another protocol (looks like mooncake_master's "
               "RPC); for Mooncake use --backend mooncake")
    started = time.monotonic()
    with pytest.raises(ProtocolError) as info:
        StoreClient(cluster.address)
    assert time.monotonic() - started < 3
    assert info.value.cause == message
    for args in (["store", "status"], ["store", "smoke"], ["store", "ls"]):
        started = time.monotonic()
        r = kvctl(*args, "--master", cluster.address)
        assert time.monotonic() - started < 3, args
        assert r.exit_code == 2, (args, r.stdout, r.stderr)
        assert f"Error: {message}" in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("command", ["smoke", "status", "get"])
def test_mooncake_commands_at_a_kvctl_master_fail_fast(kvctl: Kvctl, kvctl_master: str,
                                                        command: str) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    args = ["store", command, *(["some/key", "-o", "/dev/null"] if command == "get" else []),
            "--backend", "mooncake", "--master", kvctl_master]
    started = time.monotonic()
    r = kvctl(*args)
    assert time.monotonic() - started < 3
    assert r.exit_code == 2, r.stdout + r.stderr
    assert f"Error: {kvctl_master} is a kvctl store master; use --backend kvctl" in r.stderr


def test_mooncake_probe_names_a_kvctl_master(kvctl_master: str) -> None:
    from kvctl.store.mooncake import probe_master

    started = time.monotonic()
    with pytest.raises(KvctlError) as info:
        probe_master(kvctl_master)
    assert time.monotonic() - started < 3
    assert info.value.cause == f"{kvctl_master} is a kvctl store master; use --backend kvctl"


def _fake_master(greet_first: bool) -> tuple[socket.socket, threading.Thread, list[bytes]]:
    """A listener whose first connection greets only after the client's probe arrives (as
    a slow kvctl master would), and whose later ones greet at once."""
    listener = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []
    hello = p.Codec().encode(p.Hello(version=p.PROTOCOL_VERSION, auth=False, nonce=b"",
                                     max_frame_bytes=p.DEFAULT_MAX_FRAME_BYTES))

    def serve() -> None:
        first, _ = listener.accept()
        with first:
            if greet_first:
                first.sendall(hello)
            heard.append(first.recv(64))  # the probe (the client sends it after 1 s)
            if greet_first:
                return
            first.sendall(hello)  # too late: the client reconnects
        second, _ = listener.accept()
        with second:
            second.sendall(hello)
            heard.append(second.recv(64))  # blocks until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread, heard


def test_a_kvctl_master_that_greets_late_is_still_used() -> None:
    from kvctl.store.rpc import MasterConnection

    listener, thread, heard = _fake_master(greet_first=False)
    try:
        conn = MasterConnection(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=5.0)
        conn.close()
        thread.join(10)
    finally:
        listener.close()
    assert heard[0].startswith(bytes([0x15]))  # it was probed once ...
    assert heard[1] == b""  # ... then greeted on a new connection, which saw no probe


def test_a_silent_server_is_not_taken_for_a_kvctl_master() -> None:
    # Silence (a SIGSTOPped master, or something that never speaks) is "stalled": exit 3,
    # not a wrong address; the wait is bounded by the client's timeout.
    from kvctl.errors import ExitCode
    from kvctl.store.errors import StoreUnavailableError
    from kvctl.store.rpc import MasterConnection

    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            MasterConnection(address, timeout_s=0.3)
        assert time.monotonic() - started < 2
    assert info.value.cause.startswith(f"store master at {address} accepted the connection "
                                       "but said nothing for 0.6 s: it is stalled")
    assert info.value.exit_code == ExitCode.UNAVAILABLE
