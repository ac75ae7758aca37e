"""The committed objects: by key, in key order, and counted per tier.

Everything a status or a prefix listing needs is kept up to date as objects change, so
neither ever walks the whole store: :attr:`ObjectIndex.tiers` is four counters, and
:meth:`ObjectIndex.prefix` is a bisection into the sorted keys
(:class:`~kvctl.store.sortedchunks.SortedChunks`: O(log n) search, invisible to the garbage
collector) followed by at most ``limit + 1`` steps. The dict of objects holds only strings
and ``gc=False`` records, so the collector does not track it either.

Every change to an indexed object's replicas or SSD copies goes through
:meth:`ObjectIndex.set_copies` so the tier counters stay exact (tests check them against a
full count).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvctl.store.master.config import EVICTED_MEMORY
from kvctl.store.master.records import Node, Obj, Replica
from kvctl.store.sortedchunks import SortedChunks

TIERS = ("dram", "ssd", "dram+ssd")
#: The tier of an object with no DRAM nor SSD copy: its only copy is in the shared tier.
SHARED_ONLY = "shared"


def _tier(obj: Obj) -> int:
    """0 none, 1 dram, 2 ssd, 3 dram+ssd."""
    return (1 if obj.replicas else 0) | (2 if obj.ssd else 0)


class ObjectIndex:
    """Committed objects by key (not thread-safe: the master's lock guards it)."""

    def __init__(self) -> None:
        self._by_key: dict[str, Obj] = {}
        self._keys: SortedChunks[str] = SortedChunks()
        self._tiers = [0, 0, 0, 0]

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def get(self, key: str) -> Obj | None:
        return self._by_key.get(key)

    def holds(self, obj: Obj) -> bool:
        """Whether ``obj`` is the current object of its key."""
        return self._by_key.get(obj.key) is obj

    def values(self) -> Iterator[Obj]:
        """Every object (tests and restore only: O(n))."""
        return iter(list(self._by_key.values()))

    def install(self, obj: Obj) -> Obj | None:
        """Make ``obj`` the current object of its key; the one it replaces, if any."""
        old = self._by_key.get(obj.key)
        if old is None:
            self._keys.add(obj.key)
        else:
            self._tiers[_tier(old)] -= 1
        self._by_key[obj.key] = obj
        self._tiers[_tier(obj)] += 1
        return old

    def pop(self, key: str) -> Obj | None:
        """Forget ``key``; its object, or ``None`` when absent."""
        obj = self._by_key.pop(key, None)
        if obj is not None:
            self._keys.remove(key)
            self._tiers[_tier(obj)] -= 1
        return obj

    def discard(self, obj: Obj) -> bool:
        """Forget ``obj`` if it is still the current object of its key."""
        if self._by_key.get(obj.key) is not obj:
            return False
        self.pop(obj.key)
        return True

    def set_copies(self, obj: Obj, *, replicas: tuple[Replica, ...] | None = None,
                   ssd: tuple[Node, ...] | None = None) -> None:
        """Change ``obj``'s DRAM replicas and/or SSD copies (indexed or not)."""
        indexed = self._by_key.get(obj.key) is obj
        if indexed:
            self._tiers[_tier(obj)] -= 1
        if replicas is not None:
            obj.replicas = replicas
        if ssd is not None:
            obj.ssd = ssd
        if indexed:
            self._tiers[_tier(obj)] += 1

    @property
    def tiers(self) -> dict[str, int]:
        """Objects per tier: ``dram``, ``ssd``, ``dram+ssd``, and ``shared``: objects whose
        only copy is in the shared tier (a copy there besides DRAM or SSD is not counted
        apart). The counts add up to the objects indexed."""
        return {**dict(zip(TIERS, self._tiers[1:], strict=True)), SHARED_ONLY: self._tiers[0]}

    def prefix(self, prefix: str, limit: int) -> tuple[list[Obj], bool]:
        """Objects whose key starts with ``prefix`` in key order, at most ``limit``, and
        whether more matched."""
        out: list[Obj] = []
        for key in self._keys.iter_from(prefix):
            if not key.startswith(prefix):
                break
            if len(out) == limit:
                return out, True
            out.append(self._by_key[key])
        return out, False

    def keys_after(self, after: str | None, count: int) -> list[str]:
        """Up to ``count`` keys in order, strictly after ``after`` (from the first when
        ``None``): a walk in slices that stays valid while keys come and go between them."""
        it = iter(self._keys) if after is None else self._keys.iter_from(after, inclusive=False)
        out: list[str] = []
        for key in it:
            out.append(key)
            if len(out) == count:
                break
        return out

    def load(self, objects: Iterable[Obj]) -> None:
        """Bulk insert into an empty index (a restore): one sort instead of n inserts."""
        if self._by_key:
            raise RuntimeError("ObjectIndex.load needs an empty index")
        by_key = self._by_key
        for obj in objects:
            by_key[obj.key] = obj
        tiers = self._tiers
        for obj in by_key.values():
            tiers[_tier(obj)] += 1
        self._keys.update(by_key)


class EvictedMemory:
    """The last :data:`EVICTED_MEMORY` keys that left the store other than by a remove, with
    why (a get of one answers "evicted" instead of "not found")."""

    def __init__(self, size: int = EVICTED_MEMORY) -> None:
        self._size = size
        self._why: OrderedDict[str, str] = OrderedDict()

    def remember(self, key: str, why: str) -> None:
        self._why[key] = why
        self._why.move_to_end(key)
        while len(self._why) > self._size:
            self._why.popitem(last=False)

    def forget(self, key: str) -> None:
        self._why.pop(key, None)

    def get(self, key: str) -> str | None:
        return self._why.get(key)
