"""A storage node's default name (issue 30.8): its host's name, unique per node."""

from __future__ import annotations

import re
import socket

from kvctl.store.client import StoreClient
from kvctl.store.node import HOST_LABEL_CHARS, StorageNode, default_node_id
from tests.store.conftest import Cluster, wait_for


def test_the_default_name_is_the_hosts_first_label_and_a_random_suffix() -> None:
    assert re.fullmatch(r"gpu07-[0-9a-f]{6}", default_node_id("gpu07.cluster.local"))
    assert re.fullmatch(r"a-b-c-[0-9a-f]{6}", default_node_id("a b/c"))  # a valid name
    assert re.fullmatch(r"node-[0-9a-f]{6}", default_node_id("---"))  # nothing usable
    assert len(default_node_id("x" * 200)) == HOST_LABEL_CHARS + 7
    assert default_node_id("h1") != default_node_id("h1")


def test_two_default_named_nodes_on_one_host_are_two_live_nodes(cluster: Cluster) -> None:
    # the master takes a second registration under a live node's name as that node
    # restarting (it drops the first): default names must differ on one host
    label = socket.gethostname().split(".", 1)[0]
    nodes = [StorageNode(cluster.address, capacity_bytes=8 << 20, heartbeat_s=0.2)
             for _ in range(2)]
    explicit = cluster.add_node("n-explicit", 8 << 20)
    try:
        names = [n.node_id for n in nodes]
        assert names[0] != names[1]
        assert all(name.startswith(re.sub(r"[^A-Za-z0-9_-]+", "-", label)) for name in names)
        assert explicit.node_id == "n-explicit"
        with StoreClient(cluster.address) as client:
            def alive() -> set[str]:
                return {n.node_id for n in client.status().nodes if n.state == "alive"}
            wait_for(lambda: alive() == {*names, "n-explicit"}, what="three live nodes")
    finally:
        for node in nodes:
            node.close()
