import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.errors import UsageError
from kvctl.metrics import ServerMetrics
from kvctl.transfer.metadata import open_metadata
from kvctl.transfer.metadata.server import MetadataServer


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the exposition text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def test_metadata_server_counts_operations_outcomes_and_entries() -> None:
    metrics = ServerMetrics("kvctl_metadata")
    with MetadataServer(metrics=metrics) as server:
        metrics.gauge("entries", "Live entries.", server.entry_count)
        with open_metadata(server.url) as client:
            client.put("kvctl/a", b"x" * 100)
            client.put("kvctl/b", b"y")
            assert client.get("kvctl/a") == b"x" * 100
            assert client.get("kvctl/missing") is None
            with pytest.raises(Exception):  # noqa: B017 - any refusal; counted below
                client.keepalive(123456789)  # type: ignore[arg-type]
        text = metrics.render()
    assert sample(text, "kvctl_metadata_operations_total", op="put", outcome="ok") == 2
    assert sample(text, "kvctl_metadata_operations_total", op="get", outcome="ok") == 2
    assert sample(text, "kvctl_metadata_operations_total", op="lease/keepalive",
                  outcome="lease_expired") == 1
    assert sample(text, "kvctl_metadata_operation_latency_seconds_count", op="put") == 2
    assert sample(text, "kvctl_metadata_bytes_total", op="put", direction="in") > 100
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
    assert sample(text, "kvctl_store_operations_total", op="get", outcome="ok") == 1
    assert sample(text, "kvctl_store_capacity_bytes") == 8 << 20
    assert sample(text, "kvctl_store_used_bytes") >= 4096
    assert sample(text, "kvctl_store_objects", tier="dram") == 1
    assert sample(text, "kvctl_store_nodes", alive="true") == 1
    assert sample(text, "kvctl_store_evictions_total", tier="dram") == 0
