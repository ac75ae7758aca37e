"""Placement and allocation of puts, and their commit.

Rules (tests/store/test_master.py):

- ``replicas`` copies on distinct *alive* nodes (suspect and restored nodes take none),
  most free space first; more replicas than alive nodes is an error, not a downgrade.
- Allocations on a node never overlap and never exceed its capacity.
- A put is *pending* until committed: invisible to ``exists``, not evictable; a pending
  put that is never committed is released after ``pending_ttl_s``.
- A put of the same size and checksum as the stored object is skipped.
- A put that can never fit (larger than ``replicas`` of the live nodes' whole memory) is
  refused up front with the sizes, evicting nothing.
"""

from __future__ import annotations

import logging

from kvctl.store import protocol as p
from kvctl.store.master.base import MasterBase, err
from kvctl.store.master.records import Node, Obj, Replica
from kvctl.units import format_size

_log = logging.getLogger("kvctl.store.master")


class PlacementMixin(MasterBase):
    """Puts: placement, pending objects, commits."""

    def put(self, msg: p.Put) -> list[p.PutSlot | p.ErrorInfo]:
        """Allocate space for each item on ``replicas`` distinct live nodes."""
        replicas = msg.replicas or self.config.default_replicas
        out: list[p.PutSlot | p.ErrorInfo] = []
        with self._cond:
            now = self._clock()
            touched: set[Node] = set()
            unsure = self._nodes_refused("puts")
            refused = self.state.refusal() if unsure is None else unsure.cause
            for item in msg.items:
                out.append(self._put_one(item, replicas, now, touched, refused))
            for node in touched:
                if node.alive:
                    self._watermark(node, now)
        return out

    def _put_one(self, item: p.PutItem, replicas: int, now: float, touched: set[Node],
                 refused: str | None) -> p.PutSlot | p.ErrorInfo:
        bad = p.check_key(item.key)
        if bad is not None:
            return bad
        if item.size < 0 or not 0 <= item.checksum < 1 << 64:
            return err("bad_request", f"bad size or checksum for {item.key!r}")
        if item.key in self._pending:
            return err("busy", f"another put of {item.key!r} is in flight",
                       "retry after it commits")
        if refused is not None:
            return err("unavailable", refused, "the master takes puts again once its state "
                       "can be written; see its log")
        cur = self._index.get(item.key)
        if cur is not None and cur.size == item.size and cur.checksum == item.checksum and (
                cur.replicas):
            self.state.wait_for_key(item.key)  # its record may still be on its way
            return p.PutSlot(key=item.key, version=cur.version, locations=[], skip=True)
        if replicas < 1:
            return err("bad_request", f"{replicas} replicas asked for {item.key!r}",
                       "ask for 1 or more replicas")
        live = [n for n in self._nodes.values() if n.alive]
        if replicas > len(live):
            return err("unavailable",
                       f"{replicas} replica(s) asked for {item.key!r}, "
                       f"{len(live)} live node(s)",
                       "start more storage nodes or ask for fewer replicas")
        roomy = sum(1 for n in live if n.alloc.rounded(item.size) <= n.alloc.capacity_bytes)
        if roomy < replicas:  # refused before anything is evicted for it
            largest = max(n.alloc.capacity_bytes for n in live)
            return err("full", f"{item.key!r} of {format_size(item.size)} can never fit: "
                       f"{replicas} replica(s) need {replicas} node(s) at least that large, "
                       f"and {roomy} of the {len(live)} live node(s) are (the largest holds "
                       f"{format_size(largest)}); nothing was evicted",
                       "store it in smaller parts, or add nodes with more memory")
        live.sort(key=lambda n: n.alloc.free_bytes, reverse=True)
        placed = self._place(live, item.size, replicas, now)
        if placed is None:
            freeing = sum(n.freeing_bytes for n in live)
            if freeing:
                return err("busy", f"no room for {item.size} bytes of {item.key!r} yet: "
                           f"{freeing} bytes are being written back to SSD to make room",
                           "retry shortly (StoreClient retries until its timeout)")
            return err("full", f"no room for {item.size} bytes of {item.key!r} on "
                       f"{replicas} node(s) (everything left is leased, pinned or pending)",
                       "add capacity, unpin objects, or retry when leases expire")
        obj = Obj(item.key, item.size, item.checksum, next(self._versions),
                  tuple(Replica(n, off) for n, off in placed), created=now,
                  pending_until=now + self.config.pending_ttl_s)
        self._pending[item.key] = obj
        touched.update(n for n, _ in placed)
        return p.PutSlot(key=item.key, version=obj.version, locations=[
            p.Location(n.node_id, n.segment, off, item.size) for n, off in placed])

    def _place(self, nodes: list[Node], size: int, replicas: int, now: float
               ) -> list[tuple[Node, int]] | None:
        """``size`` bytes on each of ``replicas`` of ``nodes`` (in that order, evicting as
        needed), as ``(node, offset)``; ``None`` (and nothing held) when fewer fit."""
        placed: list[tuple[Node, int]] = []
        for node in nodes:
            if len(placed) == replicas:
                break
            offset = self._allocate(node, size, now)
            if offset is not None:
                placed.append((node, offset))
        if len(placed) < replicas:
            for node, offset in placed:
                node.alloc.free(offset, size)
            return None
        return placed

    def _expire_pending(self, now: float) -> None:
        """Release puts never committed within ``pending_ttl_s``."""
        pending = self._pending
        while pending:
            key, obj = next(iter(pending.items()))
            if obj.pending_until > now:
                return
            _log.warning("put of %r was never committed; releasing its space", key)
            del pending[key]
            self._release(obj, now)

    def commit(self, msg: p.Commit) -> list[tuple[int, p.ErrorInfo]]:
        """Make written puts visible (or release abandoned ones); the index and reason of
        each put not committed. A put whose allocation is gone (expired, its node dropped)
        is not committed, nor one whose replicas are all on nodes not alive (suspect: its
        bytes would be unreadable; it is released and the client puts again)."""
        refused: list[tuple[int, p.ErrorInfo]] = []
        with self._cond:
            now = self._clock()
            for i, (key, version) in enumerate(zip(msg.keys, msg.versions, strict=False)):
                obj = self._pending.get(key)
                if obj is None or obj.version != version:
                    cur = self._index.get(key)
                    if msg.ok and (cur is None or cur.version != version):
                        refused.append((i, err(
                            "unavailable", f"the put of {key!r} was not committed: its "
                            "allocation is gone (no commit within "
                            f"{self.config.pending_ttl_s:g} s, or its node was dropped)",
                            "put it again")))
                    continue
                del self._pending[key]
                down = [r.node for r in obj.replicas if not r.node.alive]
                if msg.ok and len(down) == len(obj.replicas):  # readable from none
                    self._release(obj, now)
                    refused.append((i, err(
                        "busy", f"the put of {key!r} was not committed: node(s) "
                        + ", ".join(f"{n.node_id} ({n.state})" for n in down)
                        + " stopped answering heartbeats while it was written",
                        "put it again (StoreClient retries, on live nodes)")))
                    continue
                if not msg.ok:
                    self._release(obj, now)
                    continue
                obj.pending_until = 0.0
                self._install(obj, now)
        return refused

    def _install(self, obj: Obj, now: float) -> None:
        """Make a written object the current value of its key (lock held)."""
        key = obj.key
        old = self._index.install(obj)
        self._evicted.forget(key)
        if old is not None:
            for rep in old.replicas:
                self._lru_remove(rep.node, old)
            self._release(old, now)
        for rep in obj.replicas:
            node = rep.node
            self._lru_add(node, obj)
            if node.ssd_policy == "write-through" and not node.offload_paused(now):
                self._task(node, "persist", obj, rep.offset)
        self._shared_write_through(obj, now)
        self.state.put_object(obj.record())
