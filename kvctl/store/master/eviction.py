"""Eviction and freeing: watermark eviction in slices, replica frees, leased space.

Rules (tests/store/test_master.py, tests/store/test_scale_lock.py):

- When a node's usage passes ``high_watermark`` of its capacity, least recently used
  objects are evicted until usage is at most ``high_watermark - evict_ratio``; at most
  ``slice_objects`` of them while the put that crossed the mark holds the lock, the rest by
  a background job, a slice at a time with the lock released between slices.
- An allocation that does not fit evicts what it needs, right away.
- Leased (being read), pinned and pending objects are never evicted; the space of a removed
  or overwritten object under lease is reused only after the lease.
- A write-back node copies an object to SSD before its DRAM is freed (``freeing_bytes``
  counts what such copies in flight will free).
"""

from __future__ import annotations

import heapq

from kvctl.store.master.base import Job, MasterBase
from kvctl.store.master.records import Node, Obj, Replica


class EvictJob(Job):
    """Bring one node below its watermark target, a slice at a time."""

    def __init__(self, core: EvictionMixin, node: Node) -> None:
        self._core = core
        self.node = node

    def step(self, budget: int) -> bool:
        core = self._core
        done = self.node.dropped or core._evict_to_target(self.node, core._clock(), budget)
        if done:
            core._evicting.discard(self.node)
        return done


class EvictionMixin(MasterBase):
    """Watermark eviction, replica frees, deferred (leased) frees."""

    #: nodes with a watermark eviction job scheduled
    _evicting: set[Node]

    def _watermark(self, node: Node, now: float) -> None:
        """After an allocation on ``node``: evict down to the target if past the mark."""
        cap = node.alloc.capacity_bytes
        if node.alloc.used_bytes <= self.config.high_watermark * cap or node in self._evicting:
            return
        if not self._evict_to_target(node, now, self.config.slice_objects):
            self._evicting.add(node)
            self._schedule(EvictJob(self, node))

    def _evict_to_target(self, node: Node, now: float, budget: int) -> bool:
        """Evict up to ``budget`` objects toward the watermark target; ``True`` when the
        target is reached or nothing more can be evicted."""
        cap = node.alloc.capacity_bytes
        target = (self.config.high_watermark - self.config.evict_ratio) * cap
        need = int(node.alloc.used_bytes - node.freeing_bytes - target)
        if need <= 0:
            return True
        victims = self._victims(node, need, now, budget)
        for obj in victims:
            self._evict_replica(obj, node, now)
        return len(victims) < budget

    def _victims(self, node: Node, need_bytes: int, now: float, limit: int) -> list[Obj]:
        """Least recently used objects on ``node`` worth ``need_bytes`` (at most ``limit``),
        skipping pinned and leased ones (those move to the most recent end, so the next
        walk does not step over them again)."""
        chosen: list[Obj] = []
        kept: list[str] = []
        freed = 0
        rounded = node.alloc.rounded
        for key, obj in node.lru.items():
            if obj.pinned or obj.leased(now):
                kept.append(key)
                if len(kept) > 4 * limit:
                    break
                continue
            chosen.append(obj)
            freed += rounded(obj.size)
            if freed >= need_bytes or len(chosen) >= limit:
                break
        lru = node.lru
        for key in kept:
            lru[key] = lru.pop(key)
        return chosen

    def _allocate(self, node: Node, size: int, now: float) -> int | None:
        offset = node.alloc.allocate(size)
        if offset is not None:
            return offset
        need = node.alloc.rounded(size)
        # Evict least recent first until a contiguous extent fits: in a fragmented segment
        # free bytes alone do not make room, so keep going while anything is evictable
        # (each round evicts at least `need` bytes, so this ends).
        while True:
            victims = self._victims(node, max(need - node.alloc.free_bytes, need), now,
                                    self.config.slice_objects)
            if not victims:
                return None
            for obj in victims:
                self._evict_replica(obj, node, now)
            offset = node.alloc.allocate(size)
            if offset is not None:
                return offset

    def _evict_replica(self, obj: Obj, node: Node, now: float) -> None:
        """Evict ``obj``'s DRAM replica on ``node`` (write-back persists it first)."""
        self._lru_remove(node, obj)
        rep = obj.replica_on(node)
        if rep is None or not self._index.holds(obj):
            return
        self.evictions += 1
        if self._shared_write_back(obj, node, rep, now):
            return  # written to the shared tier first, freed when that lands
        if node.ssd_policy == "write-back" and node not in obj.ssd and not (
                obj.evicting and node in obj.evicting) and not node.offload_paused(now):
            task = self._task(node, "persist", obj, rep.offset, free_after=True)
            if obj.evicting is None:
                obj.evicting = {}
            obj.evicting[node] = task.task_id
            node.freeing_bytes += node.alloc.rounded(obj.size)
            return
        self._free_replica(obj, rep, now)

    def _free_replica(self, obj: Obj, rep: Replica, now: float) -> None:
        node = rep.node
        self._set_replicas(obj, tuple(r for r in obj.replicas if r is not rep))
        self._lru_remove(node, obj)
        self._free_space(node, rep.offset, obj.size, obj, now)
        if obj.replicas or obj.ssd or obj.shared:
            self._persist(obj)
            return
        self._forget(obj, "evicted from DRAM with no SSD copy")

    def _free_space(self, node: Node, offset: int, size: int, obj: Obj, now: float) -> None:
        if node.dropped:
            return  # that memory is gone with the node
        if obj.leased(now):
            heapq.heappush(self._deferred,
                           (obj.lease_until, next(self._deferred_seq), node, offset, size))
        else:
            node.alloc.free(offset, size)

    def _free_deferred(self, now: float) -> None:
        """Free leased space whose lease has ended."""
        heap = self._deferred
        while heap and heap[0][0] <= now:
            _, _, node, offset, size = heapq.heappop(heap)
            if not node.dropped and self._nodes.get(node.node_id) is node:
                node.alloc.free(offset, size)

    def _release(self, obj: Obj, now: float) -> None:
        """Free every replica and SSD copy of an object no longer in the tables (the caller
        has already removed its LRU entries)."""
        for rep in obj.replicas:
            if obj.evicting is not None and rep.node in obj.evicting:
                continue  # freed when the persist task reports
            self._free_space(rep.node, rep.offset, obj.size, obj, now)
        self._set_replicas(obj, ())
        for node in obj.ssd:
            if node.dropped:
                continue
            self._ssd_lru_remove(node, obj)
            self._task(node, "drop", obj, 0)
        self._set_ssd(obj, ())
        self._shared_drop(obj, now)
