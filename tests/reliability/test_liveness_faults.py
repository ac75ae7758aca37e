"""Liveness faults on real processes: a stalled node is suspect, never dropped by accident.

The master and nodes are separate processes (``store_cluster``, node timeout 1.5 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.rpc import MasterConnection
from tests.reliability.conftest import (
    NODE_TIMEOUT_S,
    StoreCluster,
    decode_value,
    make_value,
    node_states,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_puts_while_the_node_is_stopped_survive_its_stall(
        store_cluster: Callable[..., StoreCluster]) -> None:
    """A same-host client keeps putting (into its reservation, over shared memory) while
    its only node is SIGSTOPped past the node timeout: the node turns suspect, every put is
    kept, and after SIGCONT all of them read back exactly (the old master dropped the node
    and the reservation with it: 0 of 60 were readable)."""
    cluster = store_cluster()
    cluster.start_master()
    cluster.start_nodes("a")
    with StoreClient(cluster.address) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        client.put("warm", make_value("warm", 1, 4096))
        cluster.nodes["a"].suspend()
        try:
            keys = [f"stall/{i}" for i in range(60)]
            for key in keys:
                client.put(key, make_value(key, 1, 4096))
            wait_for(lambda: node_states(client) == {"a": "suspect"},
                     timeout_s=NODE_TIMEOUT_S + 5, what="node suspect")
            time.sleep(NODE_TIMEOUT_S)  # well past the timeout
            assert client.batch_exists(keys) == [True] * 60
            with pytest.raises(StoreUnavailableError):
                client.get(keys[0])  # kept, but its only node does not answer
        finally:
            cluster.nodes["a"].resume()
        wait_for(lambda: node_states(client) == {"a": "alive"}, timeout_s=15, what="node back")
        got = client.batch_get(keys)
        assert [decode_value(k, v) for k, v in zip(keys, got, strict=True)] == [1] * 60
        assert client.status().lost == 0


def test_a_killed_node_is_suspect_until_removed(
        store_cluster: Callable[..., StoreCluster]) -> None:
    """SIGKILL a node of two (replicas=2): it turns suspect, reads are served by the other
    node, nothing is lost; ``node rm`` (DropNode) drops it and its copies."""
    cluster = store_cluster()
    cluster.start_master()
    cluster.start_nodes("a", "b")
    values = {f"k{i}": make_value(f"k{i}", 1, 8192 + i) for i in range(30)}
    with StoreClient(cluster.address, replicas=2, transport="tcp", timeout_s=5) as client:
        wait_for(lambda: len(client.status().nodes) == 2, what="two nodes")
        for key, value in values.items():
            client.put(key, value)
        cluster.nodes["a"].kill()
        wait_for(lambda: node_states(client) == {"a": "suspect", "b": "alive"},
                 timeout_s=NODE_TIMEOUT_S + 5, what="node a suspect")
        assert client.batch_get(list(values)) == list(values.values())
        assert client.status().lost == 0
        conn = MasterConnection(cluster.address)
        try:
            assert isinstance(conn.call(p.DropNode(node_id="a")), p.Ok)
        finally:
            conn.close()
        wait_for(lambda: node_states(client) == {"b": "alive"}, what="node a dropped")
        for key, value in values.items():
            assert client.get(key) == value
            assert client.stat(key).replicas == ["b"]
        assert client.status().lost == 0
