"""The shared KV pool as an interface, and its in-memory LRU implementation.

The simulator talks to the pool only through :class:`PoolBackend`, batch by batch, the way
an inference instance talks to a KV store: ask which of a prompt's block keys are present,
read the ones it uses, and offer the blocks it computed. :class:`LruPool` is the in-memory
backend (the same :class:`~kvctl.cache.LruCache` the store evicts with); a backend that
replays against a running ``kvctl store`` (``--store ADDR``) implements the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvctl.cache import LruCache
from kvctl.errors import UsageError


@runtime_checkable
class PoolBackend(Protocol):
    """A shared pool of KV blocks, addressed by block key; every block is one unit."""

    name: str

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the pool holds it now (no recency change)."""
        ...

    def read_many(self, keys: Sequence[bytes]) -> None:
        """Read these blocks back (they were just reported present); counts as a use."""
        ...

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """Offer blocks an instance computed; the pool may evict others to make room."""
        ...


class LruPool:
    """In-memory pool of ``capacity_blocks`` blocks with LRU eviction."""

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise UsageError(
                f"pool capacity {capacity_blocks} blocks is not positive",
                "give --pool-blocks 1 or more",
            )
        self._cache: LruCache[bytes] = LruCache(capacity_blocks)
        self.evicted_blocks = 0

    @property
    def capacity_blocks(self) -> int:
        """Capacity in blocks."""
        return self._cache.capacity_units

    @property
    def used_blocks(self) -> int:
        """Blocks held now."""
        return self._cache.used_units

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the pool holds it now."""
        cache = self._cache
        return [key in cache for key in keys]

    def read_many(self, keys: Sequence[bytes]) -> None:
        """Mark the blocks read as most recently used."""
        for key in keys:
            self._cache.lookup(key)

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """Store the blocks as most recent, evicting least recent ones past capacity."""
        for key in keys:
            self.evicted_blocks += len(self._cache.insert(key))
