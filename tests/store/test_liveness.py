"""Liveness never deletes data by accident: suspect before dropped, the master's own pauses
never count, a restore does not start the clock, drops happen in slices."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.master.liveness import ObservedClock
from kvctl.store.state import JournalState
from tests.store.conftest import Cluster, wait_for
from tests.store.test_master import Clock, assert_no_overlap, node, put


def beat(core: MasterCore, *nids: str, epoch: str = "e1") -> None:
    for nid in nids:
        reply = core.heartbeat(p.Heartbeat(node_id=nid, epoch=epoch))
        assert not isinstance(reply, p.ErrorInfo), reply


def run(core: MasterCore, clock: Clock, seconds: float, *beating: str) -> None:
    """``seconds`` pass in 0.25 s steps with the master observing; ``beating`` heartbeat."""
    for _ in range(round(seconds / 0.25)):
        clock.now += 0.25
        beat(core, *beating)
        core.tick()


def states(core: MasterCore) -> dict[str, str]:
    return {n.node_id: n.state for n in core.status().nodes}


def test_observed_clock_counts_at_most_one_step_per_gap() -> None:
    clock = Clock()
    seen = ObservedClock(clock, max_step_s=0.5)
    start = seen()
    clock.now += 0.2
    assert round(seen() - start, 6) == 0.2
    clock.now += 7.0  # the master was paused: counts 0.5
    assert round(seen() - start, 6) == 0.7
    assert round(seen.paused_s, 6) == 6.5
    clock.now += 3.0
    seen.restart()  # e.g. a restore just finished: counts nothing
    assert round(seen() - start, 6) == 0.7


def test_a_master_pause_longer_than_the_timeout_is_not_held_against_nodes() -> None:
    """A 5 s pause of the master (a GC, a SIGSTOP) with a 3 s node timeout: its nodes were
    not silent, it was deaf. Nothing becomes suspect, nothing is dropped or lost."""
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=3.0), clock=clock)
    node(core, "a")
    for i in range(10):
        put(core, f"k{i}", 1000)
    run(core, clock, 2, "a")
    clock.now += 5.0  # the master paused; then its housekeeping runs before any heartbeat
    core.tick()
    assert states(core) == {"a": "alive"}
    assert core.exists([f"k{i}" for i in range(10)]) == [True] * 10
    assert core.status().lost == 0
    assert core.paused_s >= 3.9


def test_a_silent_node_is_suspect_then_readopted_with_every_object() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=3.0, node_grace_s=30.0), clock=clock)
    node(core, "a")
    node(core, "b")
    for i in range(20):
        assert isinstance(put(core, f"both{i}", 1000, replicas=2), p.PutSlot)
    core.remove(["x"])
    only_a = put(core, "only-a", 4096, replicas=2)
    assert isinstance(only_a, p.PutSlot)
    core.remove(["only-a"])
    slot = put(core, "only-a", 900_000)  # does not fit b with the rest: lands on a only
    assert isinstance(slot, p.PutSlot)
    where = slot.locations[0].node_id
    other = "b" if where == "a" else "a"
    run(core, clock, 4, other)  # `where` silent for 4 s
    assert states(core) == {where: "suspect", other: "alive"}
    # No placements on a suspect node ...
    fresh = put(core, "fresh", 1000)
    assert isinstance(fresh, p.PutSlot)
    assert [loc.node_id for loc in fresh.locations] == [other]
    assert isinstance(put(core, "two", 1000, replicas=2), p.ErrorInfo)
    refused = core.reserve(p.Reserve(size=1 << 16, replicas=2))
    assert isinstance(refused, p.ErrorInfo)
    # ... reads fail over, and an object only it holds is kept, not lost.
    got = core.get(p.Get(keys=["both3"])).slots[0]
    assert isinstance(got, p.GetSlot)
    assert [loc.node_id for loc in got.locations] == [other]
    kept = core.get(p.Get(keys=["only-a"])).slots[0]
    assert isinstance(kept, p.ErrorInfo)
    assert kept.code == "unavailable"
    assert where in kept.cause
    assert core.exists(["only-a"]) == [True]
    assert core.status().lost == 0
    # It answers again with the same epoch: everything it had is served from it again.
    run(core, clock, 20, other)
    beat(core, where)
    assert states(core) == {where: "alive", other: "alive"}
    back = core.get(p.Get(keys=["only-a"])).slots[0]
    assert isinstance(back, p.GetSlot)
    assert [loc.node_id for loc in back.locations] == [where]
    assert core.status().lost == 0
    assert_no_overlap(core)


def test_puts_reported_in_a_suspect_nodes_reservation_are_refused() -> None:
    """The stalled-node case of the reliability issue: a client's reservation puts land
    while its only node is silent past the timeout. Their bytes would be unreadable, so
    they are refused, each with why (the client puts them through the master, on live
    nodes); nothing of them is visible (the first master dropped them silently after an
    OK; the second installed them, unreadable until the node answered)."""
    clock = Clock()
    core = MasterCore(MasterConfig(reservation_share=0.25, node_timeout_s=3.0), clock=clock)
    node(core, "a", 1 << 20)
    node(core, "b", 1 << 20)
    grant = core.reserve(p.Reserve(size=64 << 10, replicas=1))
    assert isinstance(grant, p.Reservation)
    nid = grant.locations[0].node_id
    other = "b" if nid == "a" else "a"
    run(core, clock, 5, other)
    assert states(core)[nid] == "suspect"
    keys = [f"r{i}" for i in range(60)]
    refused = core.put_at(p.PutAt(reservation=grant.reservation, keys=keys, sizes=[100] * 60,
                                  checksums=list(range(60)),
                                  offsets=[128 * i for i in range(60)], ack=True))
    assert [i for i, _ in refused] == list(range(60))
    assert all(e.code == "unavailable" and f"{nid} (suspect)" in e.cause for _, e in refused)
    assert core.exists(keys) == [False] * 60
    # Back: the same reservation takes puts again, readable from its node.
    beat(core, nid)
    assert core.put_at(p.PutAt(reservation=grant.reservation, keys=keys, sizes=[100] * 60,
                               checksums=list(range(60)),
                               offsets=[128 * i for i in range(60)], ack=True)) == []
    slots = core.get(p.Get(keys=keys, lease=False)).slots
    assert all(isinstance(s, p.GetSlot) and s.locations[0].node_id == nid for s in slots)
    assert core.status().lost == 0
    assert_no_overlap(core)


def test_grace_ends_in_a_drop_done_in_slices() -> None:
    """Past the grace a node is dropped; its objects lose their copies on it in slices of
    ``slice_objects`` (one right away, the rest by housekeeping), and a heartbeat of its old
    epoch is told to come back with new memory."""
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=1.0, node_grace_s=5.0, slice_objects=100),
                      clock=clock)
    node(core, "a", 1 << 24)
    node(core, "b", 1 << 24)
    for i in range(1000):
        put(core, f"k{i:04d}", 100, replicas=1 + i % 2)
    on_a = [f"k{i:04d}" for i in range(1000)
            if (slot := core.get(p.Get(keys=[f"k{i:04d}"], lease=False)).slots[0])
            and isinstance(slot, p.GetSlot) and [loc.node_id for loc in slot.locations] == ["a"]]
    assert on_a
    assert core.drop_node("a") is None
    assert "a" not in states(core)
    assert 0 < sum(core.exists(on_a)) < len(on_a)  # the first slice only
    core.tick()
    assert sum(core.exists(on_a)) == 0
    status = core.status()
    assert status.lost == len(on_a)
    assert status.objects == 1000 - len(on_a)
    assert status.tiers["dram"] == status.objects
    assert core.drop_node("a") is not None  # gone already
    dropped = core.heartbeat(p.Heartbeat(node_id="a", epoch="e1"))
    assert isinstance(dropped, p.ErrorInfo)
    assert dropped.code == "node_dropped"
    assert_no_overlap(core)


def test_a_restore_slower_than_the_node_timeout_loses_nothing(tmp_path: Path) -> None:
    """The clock of liveness starts when the restore has finished: a restarted master whose
    restore takes longer than the node timeout keeps every object for the node to re-adopt
    (the old master stamped its nodes before an O(n) restore and dropped them at once)."""
    state = tmp_path / "state"
    core = MasterCore(state=JournalState(state), clock=time.monotonic)
    assert core.register_node(p.RegisterNode(
        node_id="a", epoch="E", segment="seg-a", endpoint="127.0.0.1:1", host_id="h",
        capacity_bytes=1 << 30)) is None
    keys = [f"obj/{i:06d}" for i in range(20_000)]
    for i in range(0, len(keys), 1000):
        slots = core.put(p.Put(items=[p.PutItem(k, 4096, 7) for k in keys[i:i + 1000]]))
        core.commit(p.Commit(keys=keys[i:i + 1000],
                             versions=[s.version for s in slots if isinstance(s, p.PutSlot)]))
    core.close()

    started = time.monotonic()
    restarted = MasterCore(MasterConfig(node_timeout_s=0.01, max_observed_step_s=0.005),
                           state=JournalState(state))
    took = time.monotonic() - started
    assert took > 0.01, "the restore must outlast the node timeout for this test"
    restarted.tick()  # the first housekeeping pass, right after listening
    assert restarted.status().lost == 0
    assert restarted.exists(keys[:100]) == [True] * 100
    assert restarted.register_node(p.RegisterNode(
        node_id="a", epoch="E", segment="seg-a", endpoint="127.0.0.1:1", host_id="h",
        capacity_bytes=1 << 30)) is None
    status = restarted.status()
    assert (status.objects, status.lost, status.nodes[0].objects) == (20_000, 0, 20_000)
    restarted.close()


def test_a_master_stall_on_a_live_cluster_drops_nothing() -> None:
    """Live: the master's lock held for 3x the node timeout (what a long GC pause or a
    blocking call looks like); the node heartbeats all along but cannot get through. When
    the master runs again its node is still alive and every object readable."""
    cluster = Cluster(MasterConfig(node_timeout_s=1.0))
    try:
        cluster.add_node("a")
        with StoreClient(cluster.address, transport="tcp") as client:
            for i in range(20):
                client.put(f"k{i}", b"v" * 1000)
            core = cluster.server.core
            with core._cond:
                time.sleep(3.0)
            time.sleep(0.5)  # housekeeping and heartbeats run again
            assert [(n.node_id, n.state) for n in client.status().nodes] == [("a", "alive")]
            assert client.batch_get([f"k{i}" for i in range(20)]) == [b"v" * 1000] * 20
            assert client.status().lost == 0
    finally:
        cluster.close()


def test_a_stopped_node_is_suspect_then_back_on_a_live_cluster() -> None:
    """Live: a node whose heartbeats stop (its control loop blocked) turns suspect, its
    objects are kept; when heartbeats resume it is re-adopted with all of them."""
    cluster = Cluster(MasterConfig(node_timeout_s=0.6))
    try:
        storage = cluster.add_node("a")
        with StoreClient(cluster.address, transport="tcp") as client:
            for i in range(10):
                client.put(f"k{i}", b"x" * 2000)
            gate = threading.Event()
            real = storage._conn.call

            def stalled(msg: object) -> p.Reply:
                gate.wait(30)
                return real(msg)  # type: ignore[arg-type]

            storage._conn.call = stalled  # type: ignore[method-assign]
            try:
                wait_for(lambda: client.status().nodes[0].state == "suspect", what="suspect")
                assert client.exists("k3")
            finally:
                storage._conn.call = real  # type: ignore[method-assign]
                gate.set()
            wait_for(lambda: client.status().nodes[0].state == "alive", what="alive again")
            assert client.batch_get([f"k{i}" for i in range(10)]) == [b"x" * 2000] * 10
            assert client.status().lost == 0
    finally:
        cluster.close()
