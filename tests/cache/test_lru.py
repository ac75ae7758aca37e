"""LruIndex and LruCache: recency order, victims, capacity, against a list-based model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.cache import LruCache, LruIndex
from kvctl.errors import UsageError


def test_index_orders_by_recency_and_tracks_sizes() -> None:
    index: LruIndex[str] = LruIndex()
    index.add("a", 3)
    index.add("b", 1)
    index.add("c", 2)
    assert list(index) == ["a", "b", "c"]
    assert index.used_units == 6
    assert index.touch("a") is True
    assert list(index) == ["b", "c", "a"]
    assert index.touch("zz") is False
    index.add("b", 5)  # re-add: new size, most recent
    assert list(index) == ["c", "a", "b"]
    assert index.used_units == 10
    assert index.remove("c") == 2
    assert index.remove("c") is None
    assert "c" not in index
    assert "a" in index
    assert len(index) == 2
    assert index.used_units == 8


def test_victims_skip_kept_keys_and_stop_when_enough() -> None:
    index: LruIndex[int] = LruIndex()
    for key, size in [(1, 2), (2, 2), (3, 2), (4, 2)]:
        index.add(key, size)
    assert index.victims(3) == [1, 2]
    assert index.victims(3, keep=lambda k: k == 1) == [2, 3]
    assert index.victims(100, keep=lambda k: k % 2 == 0) == [1, 3]  # not enough: all evictable
    assert index.victims(0) == []
    assert len(index) == 4  # victims never removes


def test_cache_evicts_least_recent_and_lookup_refreshes() -> None:
    cache: LruCache[str] = LruCache(3)
    assert cache.insert("a") == []
    assert cache.insert("b") == []
    assert cache.insert("c") == []
    assert cache.lookup("a") is True
    assert cache.lookup("x") is False
    assert cache.insert("d") == ["b"]
    assert "b" not in cache
    assert {"a", "c", "d"} <= set(cache)
    assert cache.insert("e", 2) == ["c", "a"]
    assert cache.used_units == 3
    assert len(cache) == 2
    assert cache.remove("d") is True
    assert cache.remove("d") is False


def test_cache_rejects_entries_larger_than_capacity_and_bad_sizes() -> None:
    cache: LruCache[str] = LruCache(2)
    with pytest.raises(UsageError, match="does not fit"):
        cache.insert("big", 3)
    with pytest.raises(UsageError):
        cache.insert("neg", -1)
    with pytest.raises(UsageError):
        LruCache(-1)
    assert len(cache) == 0


_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lookup", "remove"]),
        st.integers(min_value=0, max_value=12),
        st.integers(min_value=0, max_value=4),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(min_value=4, max_value=20), ops=_ops)
def test_cache_matches_a_list_model(capacity: int, ops: list[tuple[str, int, int]]) -> None:
    cache: LruCache[int] = LruCache(capacity)
    model: list[tuple[int, int]] = []  # (key, size), least recent first
    for op, key, size in ops:
        present = [k for k, _ in model]
        if op == "insert":
            model = [(k, s) for k, s in model if k != key] + [(key, size)]
            expected_evicted = []
            while sum(s for _, s in model) > capacity:
                expected_evicted.append(model.pop(0)[0])
            assert cache.insert(key, size) == expected_evicted
            assert all(k not in cache for k in expected_evicted)
        elif op == "lookup":
            hit = key in present
            assert cache.lookup(key) is hit
            if hit:
                model = [(k, s) for k, s in model if k != key] + [
                    next((k, s) for k, s in model if k == key)
                ]
        else:
            assert cache.remove(key) is (key in present)
            model = [(k, s) for k, s in model if k != key]
        assert cache.used_units <= capacity
        assert cache.used_units == sum(s for _, s in model)
        assert list(cache) == [k for k, _ in model]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=30),
    need=st.integers(min_value=-2, max_value=60),
    kept=st.sets(st.integers(min_value=0, max_value=29)),
)
def test_victims_properties(sizes: list[int], need: int, kept: set[int]) -> None:
    index: LruIndex[int] = LruIndex()
    for key, size in enumerate(sizes):
        index.add(key, size)
    before = list(index)
    victims = index.victims(need, keep=lambda k: k in kept)
    assert list(index) == before  # nothing removed, order unchanged
    assert not set(victims) & kept  # keep respected
    evictable = [k for k in before if k not in kept]
    assert victims == evictable[: len(victims)]  # least recent first, no gaps
    freed = sum(sizes[k] for k in victims)
    if need <= 0:
        assert victims == []
    elif freed < need:
        assert victims == evictable  # not enough: everything evictable
    else:
        assert freed - sizes[victims[-1]] < need  # stops as soon as enough
