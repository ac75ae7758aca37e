"""Reads and small changes: get, release, exists, remove, pin, stat, list, nodes, status.

Rules (tests/store/test_master.py, tests/store/test_liveness.py):

- A get grants a lease of ``lease_ttl_s`` (a leased object is never evicted and its space
  is not reused before the lease ends, even if it is removed or overwritten) and answers
  the replicas on alive nodes only; an object whose copies are all on suspect or restored
  nodes answers ``unavailable`` (it is kept, not lost).
- ``status`` and ``list`` cost nothing that grows with the store: counters kept as objects
  change, and a bisection into the sorted keys.
"""

from __future__ import annotations

from kvctl.store import protocol as p
from kvctl.store.master.base import MasterBase, err
from kvctl.store.master.records import Obj


class QueriesMixin(MasterBase):
    """Gets, metadata queries, removes and pins."""

    def get(self, msg: p.Get) -> p.GetReply:
        """Locations (and a lease) for each key; SSD-only objects are loaded into DRAM."""
        with self._cond:
            if msg.release_keys:
                self.release(p.Release(keys=msg.release_keys, versions=msg.release_versions))
            return p.GetReply(slots=[self._get_one(key, msg.lease) for key in msg.keys])

    def _get_one(self, key: str, lease: bool) -> p.GetSlot | p.ErrorInfo:
        obj = self._index.get(key)
        if obj is None:
            bad = p.check_key(key)
            if bad is not None:
                return bad
        now = self._clock()
        if obj is not None and obj.shared and not any(r.node.alive for r in obj.replicas) and (
                not any(n.alive for n in obj.ssd)):
            return self._shared_get(obj, lease, now)  # the client reads the file itself
        if obj is not None and not any(r.node.alive for r in obj.replicas) and any(
                n.alive for n in obj.ssd):
            loaded = self._load_from_ssd(obj)
            if isinstance(loaded, p.ErrorInfo):
                return loaded
            now = self._clock()
        if obj is None or not obj.replicas:
            pend = self._pending.get(key)
            if pend is not None:
                return p.GetSlot(key=key, size=pend.size, checksum=pend.checksum,
                                 version=pend.version, pending=True,
                                 locations=self._locations(pend))
            return self._missing(key)
        locations = self._locations(obj)
        if not locations:
            return self._unreachable(obj)
        if lease:
            obj.lease_until = max(obj.lease_until, now + self.config.lease_ttl_s)
            obj.readers += 1
        for rep in obj.replicas:
            lru = rep.node.lru
            if lru.get(key) is obj:  # most recent: re-inserted at the end
                del lru[key]
                lru[key] = obj
        return p.GetSlot(key=key, size=obj.size, checksum=obj.checksum, version=obj.version,
                         locations=locations, shared=self._shared_name(obj),
                         shared_at=self._shared_at(obj))

    def _unreachable(self, obj: Obj) -> p.ErrorInfo:
        where = ", ".join(f"{r.node.node_id} ({r.node.state})" for r in obj.replicas)
        return err("unavailable", f"key {obj.key!r} is kept, but its copies are on nodes not "
                   f"answering heartbeats: {where}",
                   "retry shortly; a node silent past its grace period (or removed by "
                   "an operator) is dropped with its objects")

    def _locations(self, obj: Obj) -> list[p.Location]:
        return [p.Location(r.node.node_id, r.node.segment, r.offset, obj.size)
                for r in obj.replicas if r.node.alive]

    def release(self, msg: p.Release) -> None:
        """End leases taken by gets whose reads finished."""
        with self._lock:
            for key, version in zip(msg.keys, msg.versions, strict=False):
                obj = self._index.get(key)
                if obj is None or obj.version != version or obj.readers <= 0:
                    continue
                obj.readers -= 1
                if obj.readers == 0:
                    obj.lease_until = 0.0

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored (in any tier, on any node not dropped)."""
        with self._lock:
            index = self._index
            return [k in index for k in keys]

    def remove(self, keys: list[str]) -> list[bool]:
        """Remove each key; ``True`` where it existed. Leased space is reused after the lease."""
        out = []
        with self._cond:
            now = self._clock()
            for key in keys:
                obj = self._index.pop(key)
                out.append(obj is not None)
                if obj is None:
                    continue
                for rep in obj.replicas:
                    self._lru_remove(rep.node, obj)
                self._release(obj, now)
                self._evicted.forget(key)
                self.state.delete_object(key)
        return out

    def pin(self, key: str, pinned: bool) -> p.ErrorInfo | None:
        """Pin (never evict) or unpin an object."""
        with self._lock:
            obj = self._index.get(key)
            if obj is None:
                return self._missing(key)
            obj.pinned = pinned
            self._persist(obj)
            return None

    def _info(self, obj: Obj, now: float) -> p.ObjectInfo:
        return p.ObjectInfo(key=obj.key, size=obj.size, checksum=obj.checksum,
                            version=obj.version,
                            replicas=[r.node.node_id for r in obj.replicas
                                      if not r.node.dropped],
                            ssd_replicas=sorted(n.node_id for n in obj.ssd if not n.dropped),
                            tier=obj.tier, pinned=obj.pinned,
                            lease_remaining_s=(max(0.0, obj.lease_until - now)
                                               if obj.readers else 0.0),
                            age_s=now - obj.created)

    def stat(self, key: str) -> p.ObjectInfo | p.ErrorInfo:
        """Metadata of one object (no lease, no recency change)."""
        with self._lock:
            obj = self._index.get(key)
            if obj is None:
                return self._missing(key)
            return self._info(obj, self._clock())

    def list_objects(self, prefix: str, limit: int) -> tuple[list[p.ObjectInfo], bool]:
        """Objects whose key starts with ``prefix``, sorted, at most ``limit``."""
        with self._lock:
            now = self._clock()
            objects, more = self._index.prefix(prefix, limit)
            return [self._info(obj, now) for obj in objects], more

    def nodes(self) -> list[p.NodeAddress]:
        """Addresses of the live nodes."""
        with self._lock:
            return [n.address() for n in self._nodes.values() if n.alive]

    def _unreadable_now(self) -> int:
        """Objects kept whose every copy is on a node that is not alive (suspect, or restored
        and not registered again), with none in the shared tier: readable again if the node
        comes back, lost if it is dropped; a node being dropped (a slice at a time, out of
        the node table already) counts until its last slice. O(objects on such nodes)."""
        from kvctl.store.master.liveness import DropJob

        found: set[str] = set()
        dropping = [j.node for j in self._jobs if isinstance(j, DropJob)]
        being_dropped = {id(n) for n in dropping}
        for n in (*self._nodes.values(), *dropping):
            if n.alive or (n.dropped and id(n) not in being_dropped):
                continue
            for obj in (*n.lru.values(), *n.ssd_lru.values()):
                if (obj.key in found or obj.shared or not self._index.holds(obj)
                        or any(r.node.alive for r in obj.replicas)
                        or any(s.alive for s in obj.ssd)):
                    continue
                found.add(obj.key)
        return len(found)

    def status(self) -> p.StoreStatus:
        """Nodes, capacity, usage, evictions and objects per tier (O(nodes + reservations +
        objects on nodes that are not alive))."""
        with self._lock:
            seen_now = self._observed()
            nodes = [p.NodeStatus(
                node_id=n.node_id, alive=n.alive, capacity_bytes=n.alloc.capacity_bytes,
                used_bytes=n.alloc.used_bytes, objects=len(n.lru),
                ssd_capacity_bytes=n.ssd_capacity_bytes, ssd_used_bytes=n.ssd_used_bytes,
                ssd_objects=len(n.ssd_lru), ssd_policy=n.ssd_policy, endpoint=n.endpoint,
                last_heartbeat_s=seen_now - n.last_seen, ssd_state=n.ssd_state,
                ssd_error=n.ssd_error, state=n.state) for n in self._nodes.values()]
            return p.StoreStatus(
                shared=self._shared_status(),
                nodes=nodes, objects=len(self._index),
                capacity_bytes=sum(n.capacity_bytes for n in nodes if n.alive),
                used_bytes=sum(n.used_bytes for n in nodes if n.alive),
                evictions=self.evictions, ssd_evictions=self.ssd_evictions, lost=self.lost,
                unreadable=self._unreadable_now(),
                tiers=self._index.tiers, state=self.state.description,
                high_watermark=self.config.high_watermark, evict_ratio=self.config.evict_ratio,
                reserved_bytes=sum(res.free.free_bytes * len(res.starts)
                                   for res in self._reservations.values()),
                dropped=[p.NodeStatus(
                    node_id=nid, alive=False, capacity_bytes=0, used_bytes=0, objects=0,
                    ssd_capacity_bytes=0, ssd_used_bytes=0, ssd_objects=0, ssd_policy="off",
                    endpoint="", last_heartbeat_s=seen_now - last, state="dropped",
                    dropped_why=why) for nid, (last, _, why) in self._recent_drops.items()])
