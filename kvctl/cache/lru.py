"""Least-recently-used bookkeeping: an index that proposes victims, and a bounded cache.

Both hold keys with a size in *units* (blocks or bytes: the caller decides, the classes only
add them up). Every operation is O(1) except :meth:`LruIndex.victims`, which walks from the
least recent key until it has enough units. Neither class is thread-safe: callers that share
one across threads hold their own lock.

:class:`LruIndex` never drops anything by itself; the KV store uses it to pick eviction
victims while skipping objects under lease. :class:`LruCache` has a fixed capacity and evicts
on insert; the simulators use it as an instance's prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from kvctl.errors import UsageError

K = TypeVar("K", bound=Hashable)


def _check_size(size_units: int, what: str) -> None:
    if isinstance(size_units, bool) or not isinstance(size_units, int) or size_units < 0:
        raise UsageError(
            f"{what} size {size_units!r} is not a whole number of units >= 0",
            "give sizes as non-negative integers (blocks or bytes)",
        )


class LruIndex(Generic[K]):
    """Keys in recency order, each with a size in units (blocks or bytes)."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[K, int] = OrderedDict()
        self._used_units = 0

    @property
    def used_units(self) -> int:
        """Sum of the sizes of all keys, in units."""
        return self._used_units

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recent."""
        return iter(list(self._sizes))

    def size_of(self, key: K) -> int | None:
        """The size of ``key`` in units, or ``None`` when absent (recency unchanged)."""
        return self._sizes.get(key)

    def add(self, key: K, size_units: int = 1) -> None:
        """Insert ``key`` as most recent; if present, update its size and make it most recent."""
        _check_size(size_units, "LRU entry")
        old = self._sizes.get(key)
        if old is not None:
            self._used_units -= old
            self._sizes.move_to_end(key)
        self._sizes[key] = size_units
        self._used_units += size_units

    def touch(self, key: K) -> bool:
        """Make ``key`` most recent; ``False`` when it is absent."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def remove(self, key: K) -> int | None:
        """Drop ``key`` and return its size, or ``None`` when it is absent."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used_units -= size
        return size

    def victims(
        self, need_units: int, *, keep: Callable[[K], bool] | None = None
    ) -> list[K]:
        """Keys to evict to free ``need_units``: least recent first, skipping ``keep(key)``.

        Stops as soon as the sizes of the chosen keys add up to ``need_units`` or more; returns
        fewer when not enough keys are evictable. Nothing is removed: the caller removes what it
        actually evicts (it may fail to free some, e.g. a write in flight).
        """
        chosen: list[K] = []
        if need_units <= 0:
            return chosen
        freed = 0
        for key, size in self._sizes.items():
            if keep is not None and keep(key):
                continue
            chosen.append(key)
            freed += size
            if freed >= need_units:
                break
        return chosen


class LruCache(Generic[K]):
    """Fixed capacity in units; evicts least recent on insert."""

    def __init__(self, capacity_units: int) -> None:
        if isinstance(capacity_units, bool) or not isinstance(capacity_units, int) or (
            capacity_units < 0
        ):
            raise UsageError(
                f"LRU capacity {capacity_units!r} is not a whole number of units >= 0",
                "give the capacity as a non-negative integer (blocks or bytes)",
            )
        self.capacity_units = capacity_units
        self._index: LruIndex[K] = LruIndex()

    @property
    def used_units(self) -> int:
        """Units held now; never more than :attr:`capacity_units`."""
        return self._index.used_units

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recent."""
        return iter(self._index)

    def lookup(self, key: K) -> bool:
        """A hit makes ``key`` most recent and returns ``True``; a miss returns ``False``."""
        return self._index.touch(key)

    def insert(self, key: K, size_units: int = 1) -> list[K]:
        """Store ``key`` as most recent (re-sizing it if present); return the keys evicted.

        Raises:
            UsageError: ``size_units`` is larger than the whole capacity.
        """
        _check_size(size_units, "LRU entry")
        if size_units > self.capacity_units:
            raise UsageError(
                f"an entry of {size_units} units does not fit a cache of "
                f"{self.capacity_units} units",
                "raise the capacity or split the entry",
            )
        self._index.add(key, size_units)
        excess = self._index.used_units - self.capacity_units
        if excess <= 0:
            return []
        # ``key`` is now the most recent and fits, so the older keys always free enough.
        evicted = self._index.victims(excess)
        for victim in evicted:
            self._index.remove(victim)
        return evicted

    def remove(self, key: K) -> bool:
        """Drop ``key``; ``True`` if it was present."""
        return self._index.remove(key) is not None
