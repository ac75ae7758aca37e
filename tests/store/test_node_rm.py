"""``StoreClient.drop_node`` and dropped nodes in ``status`` (the CLI: test_node_rm_cli.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvctl.errors import NotFoundError, UsageError
from kvctl.store.client import StoreClient
from kvctl.store.embedded import master_config
from kvctl.store.master import MasterConfig
from kvctl.store.settings import StoreSettings
from tests.store.conftest import Cluster, wait_for


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    c = Cluster(MasterConfig(node_timeout_s=0.6, node_grace_s=600))
    c.add_node("a", 8 << 20)
    c.add_node("b", 8 << 20)
    try:
        yield c
    finally:
        c.close()


def test_drop_node_drops_a_suspect_node_and_status_lists_it(two_nodes: Cluster) -> None:
    """A stopped node is suspect and keeps its objects; ``drop_node`` drops it now: status
    lists it among the dropped, with why and when it was last heard from; objects with a
    copy elsewhere stay readable, nothing is lost; an unknown name is ``NotFoundError``."""
    with StoreClient(two_nodes.address, replicas=2, transport="tcp") as client:
        wait_for(lambda: len(client.status().nodes) == 2, what="two nodes")
        for i in range(10):
            client.put(f"k{i}", bytes([i]) * 5000)
        two_nodes.nodes.pop("a").close()
        wait_for(lambda: {n.node_id: n.state for n in client.status().nodes}
                 == {"a": "suspect", "b": "alive"}, what="node a suspect")
        client.drop_node("a")
        st = client.status()
        assert [n.node_id for n in st.nodes] == ["b"]
        assert [(n.node_id, n.state) for n in st.dropped] == [("a", "dropped")]
        assert "removed by an operator" in st.dropped[0].dropped_why
        assert st.dropped[0].last_heartbeat_s >= 0.6
        assert st.lost == 0
        assert client.batch_get([f"k{i}" for i in range(10)]) == [
            bytes([i]) * 5000 for i in range(10)]
        with pytest.raises(NotFoundError) as info:
            client.drop_node("nope")
        assert "no node 'nope'" in info.value.cause
        assert len(client.status().nodes) == 1


def test_node_grace_setting_reaches_the_master() -> None:
    """``store.node_grace`` (``KVCTL_STORE_NODE_GRACE``, ``--node-grace``) sets the master's
    grace; a grace shorter than the node timeout is refused, naming both."""
    assert master_config(StoreSettings(node_grace=120.0)).node_grace_s == 120.0
    assert master_config(StoreSettings()).node_grace_s == 60.0
    with pytest.raises(UsageError) as info:
        master_config(StoreSettings(node_grace=1.0, node_timeout=3.0))
    assert "node grace 1 s / node timeout 3 s" in info.value.cause
