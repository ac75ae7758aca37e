"""``kvctl store top --once --json`` against kvctl's store and a real mooncake_master."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore, metrics_url
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.settings import StoreSettings
from tests.fixtures.schemas import validate_document

MiB = 1 << 20


@contextlib.contextmanager
def busy(work: Callable[[], None]) -> Iterator[None]:
    """Run ``work`` again and again in a thread until the block ends (bounded: 2000 runs)."""
    stop = threading.Event()

    def loop() -> None:
        for _ in range(2000):
            if stop.is_set():
                return
            work()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture
def store() -> Iterator[EmbeddedStore]:
    settings = StoreSettings(listen="127.0.0.1:0", capacity=16 * MiB, metrics_port=0)
    with EmbeddedStore(settings) as running:
        yield running


def test_kvctl_store_once_json_has_nodes_tiers_rates_latency_and_errors(
        kvctl: Callable[..., Any], store: EmbeddedStore) -> None:
    url = metrics_url(store.server)
    assert url is not None
    with StoreClient(store.address) as client:
        client.put("hot", b"h" * 4096)

        def work() -> None:
            client.get("hot")
            with contextlib.suppress(ObjectNotFoundError):
                client.get("cold")
            with contextlib.suppress(ObjectNotFoundError):
                client.stat("cold")  # an error reply: counted as not_found

        with busy(work):
            r = kvctl("store", "top", "--master", store.address, "--metrics", url,
                      "--interval", "1s", "--once", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "store.top"
    assert doc["backend"] == "kvctl"
    assert doc["metrics_url"] == url
    assert doc["interval_s"] >= 0.9
    assert [n["name"] for n in doc["nodes"]] == [store.node.node_id]
    assert doc["nodes"][0]["state"] == "alive"
    dram = next(t for t in doc["tiers"] if t["tier"] == "dram")
    assert dram["capacity_bytes"] == 16 * MiB
    assert dram["used_bytes"] >= 4096
    lookups = doc["lookups"]
    assert lookups["hits_per_s"] > 0
    assert lookups["misses_per_s"] > 0
    # One hit and one miss per round: the ratio is a half, whatever the speed.
    assert lookups["hit_ratio"] == pytest.approx(0.5, abs=0.1)
    ops = {o["op"]: o for o in doc["ops"]}
    assert ops["get"]["ops_per_s"] > 0
    assert 0 < ops["get"]["p99_s"] < 1.0
    assert ops["stat"]["errors_per_s"] > 0
    assert ops["get"]["errors_per_s"] == 0  # a miss is an answer, not an error
    errors = {(e["op"], e["outcome"]): e for e in doc["errors"]}
    assert errors[("stat", "not_found")]["recent"] > 0
    assert not doc["problems"]


def test_kvctl_store_without_metrics_says_how_to_get_rates(
        kvctl: Callable[..., Any]) -> None:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=4 * MiB)) as running:
        r = kvctl("store", "top", "--master", running.address, "--interval", "0.2s",
                  "--once", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "store.top"
    assert doc["lookups"] is None
    assert doc["ops"] == []
    assert any("--metrics-port" in note for note in doc["notes"])
    assert doc["tiers"][0]["capacity_bytes"] == 4 * MiB


def test_once_without_json_prints_the_tables(kvctl: Callable[..., Any],
                                             store: EmbeddedStore) -> None:
    r = kvctl("store", "top", "--master", store.address, "--metrics",
              metrics_url(store.server) or "", "--interval", "0.2s", "--once")
    assert r.exit_code == 0, r.stderr
    for text in ("kvctl store top: kvctl master", "tiers", "nodes (1)", store.node.node_id,
                 "operations"):
        assert text in r.stdout


def test_a_dead_master_fails_with_error_and_hint(kvctl: Callable[..., Any]) -> None:
    r = kvctl("store", "top", "--master", "127.0.0.1:1", "--once", "--json")
    assert r.exit_code != 0
    assert "Error:" in r.stderr
    assert "Hint:" in r.stderr


def test_live_view_needs_a_terminal(kvctl: Callable[..., Any], store: EmbeddedStore) -> None:
    r = kvctl("store", "top", "--master", store.address)
    assert r.exit_code == 2
    assert "--once --json" in r.stderr


def test_bad_interval_is_refused(kvctl: Callable[..., Any], store: EmbeddedStore) -> None:
    r = kvctl("store", "top", "--master", store.address, "--interval", "0s", "--once")
    assert r.exit_code == 2
    assert "--interval" in r.stderr


@pytest.mark.integration
def test_mooncake_master_once_json(kvctl: Callable[..., Any]) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeMaster, MooncakeStore, MooncakeUnavailableError

    try:
        master = MooncakeMaster(storage_bytes=64 * MiB)
    except MooncakeUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc.cause}")
    with master, MooncakeStore(master.address) as client:
        client.put("hot", b"m" * 4096)

        def work() -> None:
            client.get("hot")
            with contextlib.suppress(ObjectNotFoundError):
                client.get("cold")

        with busy(work):
            r = kvctl("store", "top", "--backend", "mooncake", "--master", master.address,
                      "--metrics", master.metrics_url, "--interval", "1s", "--once",
                      "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "store.top"
    assert doc["backend"] == "mooncake"
    assert doc["health"].startswith("ok")
    assert doc["objects"] == 1
    assert len(doc["nodes"]) == 1
    assert doc["nodes"][0]["dram_capacity_bytes"] == 64 * MiB
    memory = next(t for t in doc["tiers"] if t["tier"] == "memory")
    assert memory["capacity_bytes"] == 64 * MiB
    assert memory["used_bytes"] >= 4096
    assert doc["lookups"]["hits_per_s"] > 0
    assert doc["lookups"]["misses_per_s"] > 0
    assert doc["lookups"]["evicted_per_s"] is None
    ops = {o["op"]: o for o in doc["ops"]}
    assert ops["get_replica_list"]["ops_per_s"] > 0
    assert ops["get_replica_list"]["p99_s"] is None
    assert ops["get_replica_list"]["errors_per_s"] > 0
    assert any("latency" in note for note in doc["notes"])
    assert not doc["problems"]
