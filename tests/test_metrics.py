import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.errors import UsageError
from kvctl.metadata import open_metadata
from kvctl.metadata.server import MetadataServer
from kvctl.metrics import ServerMetrics


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the exposition text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def test_metadata_server_counts_hits_misses_and_value_bytes() -> None:
    metrics = ServerMetrics("kvctl_metadata")
    with MetadataServer(metrics=metrics) as server:
        with open_metadata(server.url) as client:
            client.put("kvctl/a", b"x" * 100)
            client.put("kvctl/b", b"y")
            assert client.get("kvctl/a") == b"x" * 100
            assert client.get("kvctl/missing") is None
            assert client.list("kvctl/") == {"kvctl/a": b"x" * 100, "kvctl/b": b"y"}
            with pytest.raises(Exception):  # noqa: B017 - any refusal; counted below
                client.keepalive(123456789)  # type: ignore[arg-type]
        text = metrics.render()
    assert sample(text, "kvctl_metadata_operations_total", op="put", outcome="ok") == 2
    # A get that found nothing is a miss, not "ok".
    assert sample(text, "kvctl_metadata_operations_total", op="get", outcome="hit") == 1
    assert sample(text, "kvctl_metadata_operations_total", op="get", outcome="miss") == 1
    assert sample(text, "kvctl_metadata_operations_total", op="get", outcome="ok") == 0
    assert sample(text, "kvctl_metadata_operations_total", op="lease/keepalive",
                  outcome="lease_expired") == 1
    assert sample(text, "kvctl_metadata_operation_latency_seconds_count", op="put") == 2
    # Values' bytes exactly, both ways: not the JSON and base64 around them.
    assert sample(text, "kvctl_metadata_bytes_total", op="put", direction="in") == 101
    assert sample(text, "kvctl_metadata_bytes_total", op="get", direction="out") == 100
    assert sample(text, "kvctl_metadata_bytes_total", op="list", direction="out") == 101
    assert sample(text, "kvctl_metadata_entries") == 2


def test_metrics_endpoint_serves_the_exposition_on_loopback() -> None:
    metrics = ServerMetrics("kvctl_test")
    metrics.record("get", 0.001, bytes_out=4096)
    evictions = metrics.counter("evictions", "Objects evicted.", ("tier",))
    evictions.labels("dram").inc(3)
    port = metrics.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        metrics.close()
        metrics.close()  # idempotent
    assert sample(text, "kvctl_test_operations_total", op="get", outcome="ok") == 1
    assert sample(text, "kvctl_test_bytes_total", op="get", direction="out") == 4096
    assert sample(text, "kvctl_test_evictions_total", tier="dram") == 3


def test_each_server_has_its_own_registry() -> None:
    a, b = ServerMetrics("kvctl_x"), ServerMetrics("kvctl_x")
    a.record("put", 0.01)
    assert sample(b.render(), "kvctl_x_operations_total", op="put", outcome="ok") == 0


def test_duplicate_gauge_is_refused() -> None:
    metrics = ServerMetrics("kvctl_y")
    metrics.gauge("usage", "Bytes used.", lambda: 1.0)
    with pytest.raises(UsageError):
        metrics.gauge("usage", "Bytes used.", lambda: 2.0)


def test_store_master_exports_requests_capacity_and_evictions(tmp_path) -> None:
    from kvctl.store.client import StoreClient
    from kvctl.store.embedded import EmbeddedStore
    from kvctl.store.settings import StoreSettings

    settings = StoreSettings(listen="127.0.0.1:0", capacity=8 << 20, metrics_port=0)
    with EmbeddedStore(settings) as store:
        port = store.server.metrics_port
        assert port
        with StoreClient(store.address) as client:
            client.put("a", b"x" * 4096)
            assert client.get("a") == b"x" * 4096
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    assert sample(text, "kvctl_store_operations_total", op="put", outcome="ok") == 1
    assert sample(text, "kvctl_store_operations_total", op="get", outcome="hit") == 1
    assert sample(text, "kvctl_store_capacity_bytes") == 8 << 20
    assert sample(text, "kvctl_store_used_bytes") >= 4096
    assert sample(text, "kvctl_store_objects", tier="dram") == 1
    assert sample(text, "kvctl_store_nodes", alive="true") == 1
    assert sample(text, "kvctl_store_evictions_total", tier="dram") == 0


MiB = 1 << 20


def test_store_counts_hits_misses_evictions_and_payload_bytes_both_ways() -> None:
    from kvctl.store.client import StoreClient
    from kvctl.store.embedded import EmbeddedStore
    from kvctl.store.errors import ObjectNotFoundError
    from kvctl.store.settings import StoreSettings

    settings = StoreSettings(listen="127.0.0.1:0", capacity=8 * MiB, metrics_port=0)
    with EmbeddedStore(settings) as store, StoreClient(store.address) as client:
        client.put("one", b"1" * MiB)
        client.put("two", b"2" * MiB)
        assert client.get("one") == b"1" * MiB
        with pytest.raises(ObjectNotFoundError):
            client.get("never-put")
        text = store.server.metrics.render() if store.server.metrics else ""
    ops = "kvctl_store_operations_total"
    assert sample(text, ops, op="get", outcome="hit") == 1
    assert sample(text, ops, op="get", outcome="miss") == 1
    assert sample(text, ops, op="get", outcome="ok") == 0
    assert sample(text, "kvctl_store_get_keys_total", outcome="hit") == 1
    assert sample(text, "kvctl_store_get_keys_total", outcome="miss") == 1
    # Payload: two 1 MiB objects in, one out; not the few dozen bytes of control messages.
    assert sample(text, "kvctl_store_bytes_total", op="put", direction="in") == 2 * MiB
    assert sample(text, "kvctl_store_bytes_total", op="get", direction="out") == MiB


def test_a_get_of_an_evicted_key_counts_as_evicted() -> None:
    from kvctl.store.client import StoreClient
    from kvctl.store.embedded import EmbeddedStore
    from kvctl.store.errors import ObjectNotFoundError
    from kvctl.store.settings import StoreSettings

    settings = StoreSettings(listen="127.0.0.1:0", capacity=4 * MiB, metrics_port=0)
    with EmbeddedStore(settings) as store, StoreClient(store.address) as client:
        for i in range(12):  # three times the capacity: the first ones are evicted
            client.put(f"k{i}", bytes([i]) * (MiB // 2))
        gone: list[ObjectNotFoundError] = []
        for i in range(12):
            try:
                client.get(f"k{i}")
            except ObjectNotFoundError as exc:
                gone.append(exc)
        evicted = len(gone)
        assert evicted
        assert all(exc.evicted for exc in gone)
        text = store.server.metrics.render() if store.server.metrics else ""
    assert sample(text, "kvctl_store_operations_total", op="get", outcome="evicted") == evicted
    assert sample(text, "kvctl_store_get_keys_total", outcome="evicted") == evicted
    assert sample(text, "kvctl_store_operations_total", op="get", outcome="hit") == 12 - evicted
    assert sample(text, "kvctl_store_evictions_total", tier="dram") >= evicted


def test_heartbeat_long_polls_stay_out_of_the_request_latency() -> None:
    from kvctl.store.embedded import EmbeddedStore
    from kvctl.store.settings import StoreSettings

    settings = StoreSettings(listen="127.0.0.1:0", capacity=4 * MiB, metrics_port=0)
    with EmbeddedStore(settings) as store:
        metrics = store.server.metrics
        assert metrics is not None
        deadline = time.monotonic() + 10
        while sample(metrics.render(), "kvctl_store_long_poll_seconds_count",
                     op="heartbeat") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        text = metrics.render()
    assert sample(text, "kvctl_store_long_poll_seconds_count", op="heartbeat") >= 2
    assert sample(text, "kvctl_store_operations_total", op="heartbeat", outcome="ok") >= 2
    assert sample(text, "kvctl_store_operation_latency_seconds_count", op="heartbeat") == 0


def test_a_bench_target_counts_the_payload_it_serves(kvctl) -> None:
    from kvctl.bench.target.kvctl import BenchTarget, TargetSpec

    with BenchTarget(TargetSpec(region_bytes=64 * 4096, metrics_port=0)) as target:
        info = target.info
        assert info is not None
        assert info.metrics is not None
        r = kvctl("bench", "transfer", "-b", "4KiB", "-n", "4", "-i", "2", "-t", "tcp",
                  "--op", "write", "--role", "initiator", "--peer", info.peer, "--json")
        assert r.exit_code == 0, r.stderr
        with urllib.request.urlopen(info.metrics, timeout=5) as reply:
            text = reply.read().decode()
    written = sample(text, "kvctl_target_bytes_total", op="write", direction="in")
    assert written > 0
    assert written % 4096 == 0
    assert sample(text, "kvctl_target_bytes_total", op="read", direction="out") == 0
    assert sample(text, "kvctl_target_operations_total", op="write", outcome="ok") >= 1


@pytest.mark.parametrize("token", [None, "agent-metrics-secret"])
def test_agent_metrics_port_and_loopback_with_a_token(tmp_path, token: str | None) -> None:
    import os
    import subprocess
    import sys

    from tests.fixtures.hosts import read_json_doc, stop

    env = {k: v for k, v in os.environ.items() if k != "KVCTL_TOKEN"}
    if token:
        env["KVCTL_TOKEN"] = token
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "agent", "--metadata",
                             f"file://{tmp_path}/meta", "--metrics-port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        doc = read_json_doc(proc, timeout_s=60)
        url = doc["metrics"]
        assert url.endswith("/metrics")
        if token:
            assert url.startswith("http://127.0.0.1:")
        port = url.rsplit(":", 1)[1].split("/")[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert sample(text, "kvctl_agent_registered") == 1
    finally:
        stop(proc)


def test_metrics_port_outside_a_target_is_refused(kvctl) -> None:
    r = kvctl("bench", "transfer", "--metrics-port", "0", "-b", "4KiB", "-n", "1", "-i", "1")
    assert r.exit_code == 2
    assert "--metrics-port is for --role target" in r.stderr
