"""Store fixtures: an in-process master + node on free loopback ports."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer


class Cluster:
    """A master and nodes in this process (closed in reverse order)."""

    def __init__(self, config: MasterConfig | None = None) -> None:
        self.server = MasterServer(MasterCore(config or MasterConfig()))
        self.nodes: dict[str, StorageNode] = {}

    @property
    def address(self) -> str:
        return self.server.address

    def add_node(self, node_id: str, capacity_bytes: int = 32 << 20, *,
                 ssd_dir: Path | None = None, ssd_policy: str = "write-through",
                 ssd_capacity_bytes: int = 1 << 30) -> StorageNode:
        node = StorageNode(self.address, node_id=node_id, capacity_bytes=capacity_bytes,
                           ssd_dir=ssd_dir, ssd_policy=ssd_policy,
                           ssd_capacity_bytes=ssd_capacity_bytes, heartbeat_s=0.2)
        self.nodes[node_id] = node
        return node

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
        self.server.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster(MasterConfig(node_timeout_s=2.0))
    yield c
    c.close()


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition"
             ) -> None:
    """Poll ``cond`` until true or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
