"""A storage node's own metrics endpoint (``kvctl store node --metrics-port``)."""

import urllib.request

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.test_metrics import MiB, sample


def test_a_storage_node_serves_its_data_path_metrics() -> None:
    from kvctl.store.client import StoreClient
    from kvctl.store.embedded import start_master, start_node
    from kvctl.store.settings import StoreSettings

    with start_master(StoreSettings(listen="127.0.0.1:0"), token=None) as master:
        settings = StoreSettings(capacity=4 * MiB, metrics_port=0)
        with start_node(settings, master.address, token=None) as node, \
                StoreClient(master.address, transport="tcp") as client:
            assert node.metrics_port
            client.put("n", b"n" * MiB)
            assert client.get("n") == b"n" * MiB
            url = f"http://127.0.0.1:{node.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
    assert sample(text, "kvctl_node_bytes_total", op="write", direction="in") == MiB
    assert sample(text, "kvctl_node_bytes_total", op="read", direction="out") == MiB
    assert sample(text, "kvctl_node_operations_total", op="write", outcome="ok") >= 1
    assert sample(text, "kvctl_node_capacity_bytes") == 4 * MiB


def test_node_metrics_stay_on_loopback_with_a_token() -> None:
    from kvctl.store.embedded import start_master, start_node
    from kvctl.store.settings import StoreSettings

    token = "metrics-secret"
    with start_master(StoreSettings(listen="127.0.0.1:0"), token=token) as master:
        settings = StoreSettings(capacity=4 * MiB, metrics_port=0, node_listen="0.0.0.0:0",
                                 advertise="127.0.0.1")
        with start_node(settings, master.address, token=token) as node:
            assert node.metrics is not None
            assert node.metrics.address is not None
            assert node.metrics.address[0] == "127.0.0.1"


@pytest.mark.integration
@pytest.mark.parametrize("token", [True, False], ids=["token", "open"])
def test_a_node_on_another_host_serves_metrics_there(nshosts: MakeHosts, token: bool) -> None:
    """Master on host A, node on host B with --metrics-port: A scrapes B only without a
    token; with one, B's endpoint is on B's loopback (and still answers there)."""
    net = nshosts(2)
    env = {"KVCTL_TOKEN": "node-metrics-7c1f"} if token else None
    master = net[0].popen(["kvctl", "store", "master", "--listen", "0.0.0.0:50051",
                           "--json"], env=env)
    node = None
    try:
        read_json_doc(master)
        node = net[1].popen(["kvctl", "store", "node", "--master",
                             f"{net[0].address}:50051", "--capacity", "8MiB",
                             "--metrics-port", "9200", "--json"], env=env)
        doc = read_json_doc(node)
        assert doc["metrics_port"] == 9200
        probe = ("import sys, urllib.request\n"
                 "try:\n print('open', urllib.request.urlopen(sys.argv[1], timeout=3)"
                 ".read().decode().count('kvctl_node_capacity_bytes 8.388608e+06'))\n"
                 "except OSError as e: print('closed', e)")
        remote = net[0].run(["python3", "-c", probe, f"http://{net[1].address}:9200/metrics"])
        local = net[1].run(["python3", "-c", probe, "http://127.0.0.1:9200/metrics"])
    finally:
        if node is not None:
            stop(node)
        stop(master)
    assert (local.stdout if token else remote.stdout).startswith("open 1"), (local, remote)
    assert remote.stdout.startswith("closed" if token else "open"), remote.stdout
