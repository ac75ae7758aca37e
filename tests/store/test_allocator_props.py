"""The O(log n) extent allocator against the old invariants and a reference model."""

from __future__ import annotations

import itertools
import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store.allocator import AllocatorInvariantError, ExtentAllocator


class Reference:
    """Best fit over a plain list of free extents (the obvious, slow allocator)."""

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        self.a = alignment
        self.capacity = capacity - capacity % alignment
        self.free = [(0, self.capacity)] if self.capacity else []

    def rounded(self, size: int) -> int:
        return max(self.a, (size + self.a - 1) & ~(self.a - 1))

    def allocate(self, size: int) -> int | None:
        need = self.rounded(size)
        fits = [(length, off) for off, length in self.free if length >= need]
        if not fits:
            return None
        length, off = min(fits)
        self.free.remove((off, length))
        if length > need:
            self.free.append((off + need, length - need))
        self.free.sort()
        return off

    def release(self, off: int, size: int) -> None:
        self.free.append((off, self.rounded(size)))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free = merged


def tiles(alloc: ExtentAllocator, live: list[tuple[int, int]]) -> None:
    """Live and free extents tile the segment exactly; usage matches."""
    pos = 0
    for off, length in sorted(live + alloc.extents()):
        assert off == pos, (off, pos)
        pos += length
    assert pos == alloc.capacity_bytes
    assert alloc.used_bytes == sum(n for _, n in live)
    free = alloc.extents()
    for (o1, n1), (o2, _) in itertools.pairwise(free):
        assert o1 + n1 < o2, "free neighbours are always coalesced"
    assert alloc.largest_free_bytes == max((n for _, n in free), default=0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9000)), max_size=200))
def test_same_choices_as_the_reference_best_fit(ops: list[tuple[bool, int]]) -> None:
    alloc = ExtentAllocator(128 * 1024)
    ref = Reference(128 * 1024)
    live: list[tuple[int, int]] = []
    for is_alloc, size in ops:
        if is_alloc or not live:
            got, want = alloc.allocate(size), ref.allocate(size)
            assert got == want
            if got is not None:
                live.append((got, alloc.rounded(size)))
        else:
            off, length = live.pop(size % len(live))
            alloc.free(off, length)
            ref.release(off, length)
        assert alloc.extents() == ref.free
        tiles(alloc, live)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=150), st.randoms())
def test_built_in_one_pass_equals_carving_one_by_one(sizes: list[int], rnd: random.Random
                                                     ) -> None:
    """``from_ranges`` (a restore) gives exactly the allocator that reserving each range in
    turn gives, whatever order the ranges come in, and refuses overlaps."""
    base = ExtentAllocator(1 << 20)
    ranges = []
    for size in sizes:
        off = base.allocate(size)
        if off is not None:
            ranges.append((off, size))
    for off, size in ranges[::3]:  # holes
        base.free(off, size)
    kept = [r for i, r in enumerate(ranges) if i % 3]
    rnd.shuffle(kept)
    carved = ExtentAllocator(1 << 20)
    for off, size in kept:
        carved.reserve(off, size)
    built, rejected = ExtentAllocator.from_ranges(1 << 20, kept)
    assert rejected == []
    assert built.extents() == carved.extents() == base.extents()
    assert built.used_bytes == carved.used_bytes
    if kept:
        off, size = kept[0]
        again, rejected = ExtentAllocator.from_ranges(1 << 20, [*kept, (off, size)])
        assert rejected == [len(kept)]
        assert again.extents() == built.extents()


def test_invalid_frees_and_reserves_are_refused() -> None:
    alloc = ExtentAllocator(4096)
    off = alloc.allocate(100)
    assert off is not None
    alloc.free(off, 100)
    for bad in (lambda: alloc.free(off, 100), lambda: alloc.free(4096, 64),
                lambda: alloc.free(3, 64)):
        try:
            bad()
        except AllocatorInvariantError:
            continue
        raise AssertionError("accepted")
    alloc.reserve(128, 64)
    try:
        alloc.reserve(128, 64)
    except AllocatorInvariantError:
        pass
    else:
        raise AssertionError("double reserve accepted")


def test_random_order_reserves_are_logarithmic() -> None:
    """100,000 ranges in random order (as a key-sorted etcd listing of hash keys gives
    them): reserved one by one in O(log n) each, or built in one sort as a restore does
    (the old allocator's list inserts took 26 s for 300,000)."""
    n = 100_000
    ranges = [(i * 128, 100) for i in range(n)]
    random.Random(1).shuffle(ranges)
    alloc = ExtentAllocator(n * 128 * 2)
    started = time.perf_counter()
    for off, size in ranges:
        alloc.reserve(off, size)
    carve_s = time.perf_counter() - started
    started = time.perf_counter()
    built, rejected = ExtentAllocator.from_ranges(n * 128 * 2, ranges)
    build_s = time.perf_counter() - started
    assert rejected == []
    assert built.free_extents == alloc.free_extents == 1
    assert carve_s < 10.0, carve_s
    assert build_s < 2.0, build_s
