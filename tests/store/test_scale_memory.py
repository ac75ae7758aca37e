"""The master's memory at scale: compact records the garbage collector never walks."""

from __future__ import annotations

import gc
import tracemalloc

from kvctl.store import protocol as p
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.sortedchunks import SortedChunks

N = 20_000


def fill(core: MasterCore, n: int, *, prefix: str = "model/layer/") -> None:
    for i in range(0, n, 1000):
        keys = [f"{prefix}{j:012d}" for j in range(i, min(n, i + 1000))]
        slots = core.put(p.Put(items=[p.PutItem(k, 1024 + j % 3072, j) for j, k in
                                      enumerate(keys, start=i)]))
        core.commit(p.Commit(keys=keys, versions=[s.version for s in slots
                                                  if isinstance(s, p.PutSlot)]))


def new_core() -> MasterCore:
    core = MasterCore(MasterConfig(node_timeout_s=1e6))
    assert core.register_node(p.RegisterNode(
        node_id="n0", epoch="e", segment="s", endpoint="127.0.0.1:1", host_id="h",
        capacity_bytes=N * 8192)) is None
    return core


def test_objects_add_nothing_the_collector_tracks() -> None:
    """Per-object records, replica tuples, LRU maps, the key index and the allocator are
    all invisible to the cyclic GC: 20,000 objects add (almost) no tracked object, so a
    full collection costs the same at 10^7 objects as at 10^3 (the old master added four
    tracked objects per object: 1.4 us of GC each, a 3 s pause at 2 million)."""
    core = new_core()
    gc.collect()
    before = len(gc.get_objects())
    fill(core, N)
    gc.collect()
    added = len(gc.get_objects()) - before
    assert added < N / 20, f"{added} tracked objects for {N} objects"
    assert core.status().objects == N


def test_bytes_per_object_stay_small() -> None:
    """Python heap per object (record, key, replica, index, LRU entry, sorted key) as
    tracemalloc counts it: at most 600 bytes (the old master: about 1.1 KB)."""
    core = new_core()
    fill(core, 1000, prefix="warm/")  # containers past their first growth steps
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        fill(core, N)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_object = (end - start) / N
    assert per_object < 600, f"{per_object:.0f} bytes per object"


def test_sorted_chunks_against_a_sorted_list() -> None:
    import random

    rng = random.Random(7)
    seq: SortedChunks[int] = SortedChunks()
    ref: list[int] = []
    for step in range(20_000):
        x = rng.randrange(3000)
        if ref and rng.random() < 0.45:
            y = ref[rng.randrange(len(ref))]
            seq.remove(y)
            ref.remove(y)
        else:
            seq.add(x)
            ref.append(x)
            ref.sort()
        if step % 500 == 0:
            assert list(seq) == ref
            for probe in (x, x + 1, -1, 3001):
                below = [v for v in ref if v < probe]
                atmost = [v for v in ref if v <= probe]
                above = [v for v in ref if v >= probe]
                assert seq.lt(probe) == (below[-1] if below else None)
                assert seq.le(probe) == (atmost[-1] if atmost else None)
                assert seq.ge(probe) == (above[0] if above else None)
                assert list(seq.iter_from(probe)) == above
                assert list(seq.iter_from(probe, inclusive=False)) == [v for v in ref
                                                                        if v > probe]
    assert len(seq) == len(ref)
    assert not seq.discard(-5)
