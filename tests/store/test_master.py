"""Master policy: allocation, placement, leases, eviction, liveness, persistence."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store import protocol as p
from kvctl.store.allocator import AllocatorInvariantError, ExtentAllocator
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.state import JournalState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def node(core: MasterCore, nid: str, capacity: int = 1 << 20, *, epoch: str = "e1",
         ssd: str = "off") -> None:
    err = core.register_node(p.RegisterNode(
        node_id=nid, epoch=epoch, segment=f"seg-{nid}", endpoint="127.0.0.1:1", host_id="h",
        capacity_bytes=capacity, ssd_capacity_bytes=1 << 30 if ssd != "off" else 0,
        ssd_policy=ssd))
    assert err is None


def put(core: MasterCore, key: str, size: int, *, replicas: int = 1, checksum: int = 7
        ) -> p.PutSlot | p.ErrorInfo:
    slot = core.put(p.Put(items=[p.PutItem(key, size, checksum)], replicas=replicas))[0]
    if isinstance(slot, p.PutSlot) and not slot.skip:
        core.commit(p.Commit(keys=[key], versions=[slot.version]))
    return slot


def assert_no_overlap(core: MasterCore) -> None:
    usage = core.node_usage()
    for nid, ranges in core.live_allocations().items():
        ranges.sort()
        for (o1, s1), (o2, _) in itertools.pairwise(ranges):
            assert o1 + s1 <= o2, f"overlap on {nid}: {o1}+{s1} > {o2}"
        used, cap = usage[nid]
        assert used <= cap
        assert sum(s for _, s in ranges) == used


# ---------------------------------------------------------------- allocator


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=120))
def test_allocator_never_overlaps_and_coalesces(ops: list[tuple[bool, int]]) -> None:
    alloc = ExtentAllocator(64 * 1024)
    live: list[tuple[int, int]] = []
    for is_alloc, size in ops:
        if is_alloc or not live:
            off = alloc.allocate(size)
            if off is None:
                assert alloc.largest_free_bytes < alloc.rounded(size)
                continue
            live.append((off, alloc.rounded(size)))
        else:
            off, length = live.pop(size % len(live))
            alloc.free(off, length)
        spans = sorted(live + alloc.extents())
        pos = 0
        for off, length in spans:  # live and free extents tile the segment exactly
            assert off == pos
            pos += length
        assert pos == alloc.capacity_bytes
        assert alloc.used_bytes == sum(n for _, n in live)
    for off, length in live:
        alloc.free(off, length)
    assert alloc.extents() == [(0, alloc.capacity_bytes)]


def test_allocator_rejects_double_free() -> None:
    alloc = ExtentAllocator(4096)
    off = alloc.allocate(100)
    assert off is not None
    alloc.free(off, 100)
    with pytest.raises(AllocatorInvariantError):
        alloc.free(off, 100)


# ---------------------------------------------------------------- master properties


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "rm", "tick"]),
                          st.integers(0, 30), st.integers(1, 40_000)), max_size=80))
def test_master_invariants(ops: list[tuple[str, int, int]]) -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(lease_ttl_s=5.0, high_watermark=0.9, evict_ratio=0.2),
                      clock=clock)
    node(core, "a", 128 * 1024)
    node(core, "b", 96 * 1024)
    leased: dict[str, float] = {}
    for op, k, size in ops:
        key = f"k{k}"
        if op == "put":
            put(core, key, size, replicas=1 + k % 2, checksum=size)
        elif op == "get":
            slot = core.get(p.Get(keys=[key])).slots[0]
            if isinstance(slot, p.GetSlot):
                leased[key] = clock.now + 5.0
        elif op == "rm":
            core.remove([key])
            leased.pop(key, None)
        else:
            clock.now += 1.0
            core.tick()
            core.heartbeat(p.Heartbeat(node_id="a", epoch="e1"))
            core.heartbeat(p.Heartbeat(node_id="b", epoch="e1"))
        assert_no_overlap(core)
        for lkey, until in leased.items():
            if until > clock.now and core.stat(lkey) is not None:
                # A leased object is never evicted (it may have been overwritten by a put).
                assert core.exists([lkey]) == [True], f"leased {lkey} was evicted"


def test_watermark_eviction_is_lru_and_reports_evicted() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(high_watermark=0.8, evict_ratio=0.3, lease_ttl_s=1.0),
                      clock=clock)
    node(core, "a", 100 * 1024)
    for i in range(8):
        put(core, f"k{i}", 10 * 1024)
    core.get(p.Get(keys=["k0"], lease=False))  # k0 becomes most recent
    put(core, "k8", 10 * 1024)  # 90% > 80%: evict down to 50%
    used, cap = core.node_usage()["a"]
    assert used <= 0.5 * cap + 10 * 1024
    assert core.exists(["k0", "k1"]) == [True, False]
    slot = core.get(p.Get(keys=["k1"])).slots[0]
    assert isinstance(slot, p.ErrorInfo)
    assert slot.code == "evicted"
    assert core.status().evictions >= 4
    never = core.get(p.Get(keys=["nope"])).slots[0]
    assert isinstance(never, p.ErrorInfo)
    assert never.code == "not_found"


def test_full_when_everything_is_leased_or_pinned() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(lease_ttl_s=10.0), clock=clock)
    node(core, "a", 64 * 1024)
    put(core, "pinned", 32 * 1024)
    assert core.pin("pinned", True) is None
    put(core, "leased", 30 * 1024)
    core.get(p.Get(keys=["leased"]))
    slot = put(core, "big", 16 * 1024)
    assert isinstance(slot, p.ErrorInfo)
    assert slot.code == "full"
    clock.now += 11  # lease over: now "leased" can go
    slot = put(core, "big", 16 * 1024)
    assert isinstance(slot, p.PutSlot)
    assert core.exists(["pinned", "leased", "big"]) == [True, False, True]


def test_removed_leased_space_is_not_reused_until_lease_ends() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(lease_ttl_s=5.0, node_timeout_s=60), clock=clock)
    node(core, "a", 8 * 1024)
    put(core, "x", 8 * 1024)
    core.get(p.Get(keys=["x"]))
    assert core.remove(["x"]) == [True]
    assert isinstance(put(core, "y", 8 * 1024), p.ErrorInfo)
    clock.now += 6
    core.tick()
    assert isinstance(put(core, "y", 8 * 1024), p.PutSlot)


def advance(core: MasterCore, clock: Clock, seconds: float, *, beating: tuple[str, ...] = ()
            ) -> None:
    """Let ``seconds`` pass in half-second steps (the master observing all along), the
    ``beating`` nodes heartbeating at each step."""
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for nid in beating:
            core.heartbeat(p.Heartbeat(node_id=nid, epoch="e1"))
        core.tick()


def test_replicas_on_distinct_nodes_and_dead_node_failover() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=3.0, node_grace_s=20.0), clock=clock)
    node(core, "a")
    node(core, "b")
    slot = put(core, "k", 4096, replicas=2)
    assert isinstance(slot, p.PutSlot)
    assert sorted(loc.node_id for loc in slot.locations) == ["a", "b"]
    too_many = put(core, "k3", 4096, replicas=3)
    assert isinstance(too_many, p.ErrorInfo)
    assert too_many.code == "unavailable"
    put(core, "only-a", 4096, replicas=2)
    core.remove(["only-a"])
    slot = put(core, "only-a", 4096)
    assert isinstance(slot, p.PutSlot)
    assert [loc.node_id for loc in slot.locations] == ["a"]
    advance(core, clock, 4, beating=("b",))  # a silent for 4 s: suspect, kept
    got = core.get(p.Get(keys=["k"])).slots[0]
    assert isinstance(got, p.GetSlot)
    assert [loc.node_id for loc in got.locations] == ["b"]
    kept = core.get(p.Get(keys=["only-a"])).slots[0]
    assert isinstance(kept, p.ErrorInfo)
    assert kept.code == "unavailable"
    assert core.exists(["only-a"]) == [True]
    status = core.status()
    assert [(n.node_id, n.state) for n in status.nodes] == [("a", "suspect"), ("b", "alive")]
    assert status.lost == 0
    advance(core, clock, 20, beating=("b",))  # past the grace: dropped
    status = core.status()
    assert [n.node_id for n in status.nodes] == ["b"]
    assert core.exists(["k", "only-a"]) == [True, False]
    gone = core.get(p.Get(keys=["only-a"])).slots[0]
    assert isinstance(gone, p.ErrorInfo)
    assert gone.code == "evicted"
    assert status.lost == 1


def test_pending_put_is_invisible_then_released() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(pending_ttl_s=5.0, node_timeout_s=60), clock=clock)
    node(core, "a", 16 * 1024)
    slot = core.put(p.Put(items=[p.PutItem("k", 8192, 1)]))[0]
    assert isinstance(slot, p.PutSlot)
    assert core.exists(["k"]) == [False]
    pending = core.get(p.Get(keys=["k"])).slots[0]
    assert isinstance(pending, p.GetSlot)
    assert pending.pending
    busy = core.put(p.Put(items=[p.PutItem("k", 8192, 2)]))[0]
    assert isinstance(busy, p.ErrorInfo)
    assert busy.code == "busy"
    clock.now += 6
    core.tick()
    assert core.node_usage()["a"][0] == 0


def test_same_content_put_is_skipped_and_overwrite_replaces() -> None:
    core = MasterCore(clock=Clock())
    node(core, "a")
    first = put(core, "k", 100, checksum=1)
    again = put(core, "k", 100, checksum=1)
    assert isinstance(again, p.PutSlot)
    assert again.skip
    other = put(core, "k", 200, checksum=2)
    assert isinstance(first, p.PutSlot)
    assert isinstance(other, p.PutSlot)
    info = core.stat("k")
    assert isinstance(info, p.ObjectInfo)
    assert info.size == 200
    assert info.checksum == 2
    assert_no_overlap(core)
    assert core.node_usage()["a"][0] == 256  # the old 128-byte (rounded) copy is freed


def test_bad_keys_are_rejected() -> None:
    core = MasterCore(clock=Clock())
    node(core, "a")
    for key in ("", "x" * 5000, "tab\there"):
        slot = core.put(p.Put(items=[p.PutItem(key, 10, 1)]))[0]
        assert isinstance(slot, p.ErrorInfo)
        assert slot.code == "bad_request"
    # A negative replica count is a bad request, not an unavailable store (0: the default).
    slot = core.put(p.Put(items=[p.PutItem("k", 10, 1)], replicas=-1))[0]
    assert isinstance(slot, p.ErrorInfo)
    assert slot.code == "bad_request"
    assert isinstance(core.put(p.Put(items=[p.PutItem("k", 10, 1)], replicas=0))[0], p.PutSlot)
    refused = core.reserve(p.Reserve(size=1 << 16, replicas=-2))
    assert isinstance(refused, p.ErrorInfo)
    assert refused.code == "bad_request"
    empty = core.reserve(p.Reserve(size=0))
    assert isinstance(empty, p.ErrorInfo)
    assert empty.code == "bad_request"


def test_restart_keeps_objects_and_readopts_node(tmp_path: Path) -> None:
    clock = Clock()
    core = MasterCore(state=JournalState(tmp_path / "state"), clock=clock)
    node(core, "a", 1 << 20, epoch="E")
    for i in range(20):
        put(core, f"k{i}", 1000 + i, checksum=i)
    core.remove(["k3"])
    core.close()
    # The journal may end in a torn record: it is ignored.
    with sorted((tmp_path / "state").glob("journal-*.log"))[-1].open("ab") as fh:
        fh.write(b"\x40\x00\x00\x00garbage")

    core2 = MasterCore(state=JournalState(tmp_path / "state"), clock=clock)
    assert core2.exists(["k0", "k3", "k19"]) == [True, False, True]
    node(core2, "a", 1 << 20, epoch="E")  # same process came back: objects adopted
    got = core2.get(p.Get(keys=["k5"])).slots[0]
    assert isinstance(got, p.GetSlot)
    assert got.size == 1005
    assert got.checksum == 5
    assert_no_overlap(core2)
    new = put(core2, "new", 5000)
    assert isinstance(new, p.PutSlot)
    assert_no_overlap(core2)
    core2.close()

    core3 = MasterCore(state=JournalState(tmp_path / "state"), clock=clock)
    node(core3, "a", 1 << 20, epoch="OTHER")  # node restarted: its memory is gone
    assert core3.exists(["k0"]) == [False]
    core3.close()
