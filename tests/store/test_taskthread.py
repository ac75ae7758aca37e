"""A node's SSD tasks run off its heartbeat loop: a disk that stalls for several node
timeouts leaves the node alive, and the task's report still arrives."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.master import MasterConfig
from kvctl.store.ssd import SsdTier
from kvctl.store.taskthread import TaskThread
from tests.store.conftest import Cluster, wait_for

NODE_TIMEOUT_S = 0.6


def _ok(task_id: int, log: list[int], gate: threading.Event | None = None
        ) -> p.TaskReport:
    if gate is not None:
        gate.wait(10)
    log.append(task_id)
    return p.TaskReport(task_id=task_id, ok=True)


def test_tasks_run_in_order_and_slow_ones_report_later() -> None:
    tasks = TaskThread("test-tasks", wait_s=0.05)
    log: list[int] = []
    gate = threading.Event()
    try:
        assert tasks.run(1, lambda: _ok(1, log)).ok
        slow = tasks.run(2, lambda: _ok(2, log, gate))
        assert slow.pending
        assert not slow.ok
        queued = tasks.run(3, lambda: _ok(3, log))  # behind the slow one: never overtakes
        assert queued.pending
        assert tasks.finished() == []
        gate.set()
        assert tasks.idle(5)
        assert log == [1, 2, 3]
        assert sorted(r.task_id for r in tasks.finished()) == [2, 3]
        assert tasks.finished() == []
    finally:
        tasks.close()


def test_discarded_reports_never_come_back_and_a_failing_task_is_a_failed_report() -> None:
    tasks = TaskThread("test-tasks", wait_s=0.05)
    gate = threading.Event()
    log: list[int] = []
    try:
        assert tasks.run(1, lambda: _ok(1, log, gate)).pending
        tasks.discard()  # the master dropped the node: that report is moot
        gate.set()
        assert tasks.idle(5)
        assert log == [1]
        assert tasks.finished() == []

        def broken() -> p.TaskReport:
            raise RuntimeError("a bug")

        report = tasks.run(4, broken)
        assert not report.ok
        assert "a bug" in report.error
        assert tasks.run(5, lambda: _ok(5, log)).ok  # the thread lives on
    finally:
        tasks.close()


@pytest.fixture
def quick() -> Iterator[Cluster]:
    c = Cluster(MasterConfig(node_timeout_s=NODE_TIMEOUT_S, node_grace_s=NODE_TIMEOUT_S))
    yield c
    c.close()


def test_an_ssd_write_stalled_for_several_node_timeouts_does_not_drop_the_node(
        quick: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stall = threading.Event()
    real_write = SsdTier.write

    def stalled_write(self: SsdTier, *args: object, **kwargs: object) -> None:
        stall.wait(10)
        real_write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SsdTier, "write", stalled_write)
    node = quick.add_node("a", 8 << 20, ssd_dir=tmp_path)
    with StoreClient(quick.address) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        data = os.urandom(256 << 10)
        client.put("slow", data)
        time.sleep(4 * NODE_TIMEOUT_S)  # the persist is stuck on the "disk" all along
        status = client.status()
        assert [n.state for n in status.nodes] == ["alive"], status.nodes
        assert status.dropped == [], status.dropped
        client.put("meanwhile", b"x" * 1000)  # the node still takes puts
        assert client.get("meanwhile") == b"x" * 1000
        assert client.stat("slow").tier == "dram"
        stall.set()
        wait_for(lambda: client.stat("slow").tier == "dram+ssd", what="the late persist")
        assert node.ssd is not None
        assert node.ssd.path_for("slow").exists()
        assert client.get("slow") == data


def test_an_ssd_task_in_a_lost_heartbeat_reply_does_not_stay_in_flight(
        quick: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The master moves a reply's tasks in flight before sending it; a reply lost on its
    way left an SSD persist in flight for good (no report ever comes). The node, back with
    its epoch, names the tasks it still owes; the master fails the rest, and the next put
    is copied as usual."""
    from tests.reliability.test_shared_tier_packing import _lose_a_reply

    lost = _lose_a_reply(monkeypatch, "persist")
    quick.add_node("a", 8 << 20, ssd_dir=tmp_path)
    core = quick.server.core
    with StoreClient(quick.address) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        client.put("first", os.urandom(64 << 10))
        wait_for(lambda: bool(lost), what="the persist's reply lost")

        def settled() -> bool:
            with core._lock:
                return all(not n.inflight for n in core._nodes.values())

        wait_for(settled, what="no task left in flight")
        assert client.stat("first").tier == "dram"  # its copy was never made
        client.put("second", os.urandom(64 << 10))
        wait_for(lambda: client.stat("second").tier == "dram+ssd", what="the next copy")
