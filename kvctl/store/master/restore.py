"""Rebuild a master's tables from its state backend.

The backend's changes are replayed in order (a journal's segments hold the same key many
times; only the last record counts), each object built as its record comes. A node's
record seen again with the same epoch and capacity (each master run that the node
registered with writes it) updates that node: objects recorded earlier keep their copies
on it (replacing it lost every object of the earlier runs once a master had restarted
twice). Nodes come
back *restored* (no placements, no reads) until they register again with the same epoch,
or are dropped after their grace. A replica or SSD copy recorded under another epoch than
its node's record is gone (the node restarted since) and is left out. Each node's
allocator is built in one pass over its replicas (:meth:`ExtentAllocator.from_ranges`),
whatever order the records come in; of two overlapping replicas the one at the lower
offset is kept.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

from kvctl.store.allocator import ExtentAllocator
from kvctl.store.master.records import RESTORED, Node, Obj, Replica
from kvctl.store.state.base import (
    LOAD_ATTEMPTS,
    DeleteObject,
    NodeRecord,
    ObjectRecord,
    StateMovedError,
)

if TYPE_CHECKING:
    from kvctl.store.master.base import MasterBase

_log = logging.getLogger("kvctl.store.master")


def restore(core: MasterBase) -> int:
    """Fill ``core``'s (empty) tables from ``core.state``; the highest version seen.

    The garbage collector waits meanwhile: the tables are records it never walks, but the
    state's records decoded on the way are not (with etcd state at 10^6 objects its
    collections took 2.3 s of a 5.4 s load)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                return _restore(core)
            except StateMovedError as exc:  # (the tables are filled only at the end)
                if attempt == LOAD_ATTEMPTS:
                    raise
                _log.warning("master state: %s; loading again", exc.cause)
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        if collecting:
            gc.enable()


def _restore(core: MasterBase) -> int:
    now = core._clock()
    nodes: dict[str, Node] = {}
    objects: dict[str, Obj] = {}
    max_version = 0
    #: one int object per shared-tier use stamp (copies stamped in a row share one)
    stamps: dict[int, int] = {}
    #: a node's record was replaced or deleted: copies resolved before may name a node gone
    replaced = False
    for entry in core.state.replay():
        if isinstance(entry, ObjectRecord):
            max_version = max(max_version, entry.version)
            objects[entry.key] = _object(entry, nodes, now, stamps)
        elif isinstance(entry, NodeRecord):
            same = nodes.get(entry.node_id)
            if same is not None and same.epoch == entry.epoch and (
                    same.capacity_bytes == entry.capacity_bytes):
                # The same node again (it re-registered with a later master run, or changed
                # its endpoint): objects recorded before keep their copies on it.
                same.segment, same.endpoint, same.host_id = (entry.segment, entry.endpoint,
                                                             entry.host_id)
                same.ssd_capacity_bytes, same.ssd_policy = (entry.ssd_capacity_bytes,
                                                            entry.ssd_policy)
                continue
            replaced = replaced or same is not None
            nodes[entry.node_id] = Node(
                entry.node_id, entry.epoch, entry.segment, entry.endpoint, entry.host_id,
                entry.capacity_bytes, entry.ssd_capacity_bytes, entry.ssd_policy,
                last_seen=0.0, state=RESTORED)
        elif isinstance(entry, DeleteObject):
            objects.pop(entry.key, None)
        else:
            replaced = nodes.pop(entry.node_id, None) is not None or replaced
    known = set(nodes.values())
    ranges: dict[Node, list[tuple[int, int]]] = {n: [] for n in known}
    owners: dict[Node, list[Obj]] = {n: [] for n in known}
    for obj in objects.values():
        if replaced and any(r.node not in known for r in obj.replicas):
            obj.replicas = tuple(r for r in obj.replicas if r.node in known)
        if replaced and any(n not in known for n in obj.ssd):
            obj.ssd = tuple(n for n in obj.ssd if n in known)
        for rep in obj.replicas:
            ranges[rep.node].append((rep.offset, obj.size))
            owners[rep.node].append(obj)
    for node in known:
        node.alloc, rejected = ExtentAllocator.from_ranges(node.capacity_bytes, ranges[node])
        for i in rejected:
            obj = owners[node][i]
            _log.warning("master state: replica of %r on %s overlaps another; dropped",
                         obj.key, node.node_id)
            obj.replicas = tuple(r for r in obj.replicas if r.node is not node)
    del ranges, owners
    kept: list[Obj] = []
    for obj in objects.values():
        if not obj.replicas and not obj.ssd and not obj.shared:
            continue
        kept.append(obj)
        for rep in obj.replicas:
            rep.node.lru[obj.key] = obj
        for node in obj.ssd:
            node.ssd_lru[obj.key] = obj
            node.ssd_used_bytes += obj.size
    objects.clear()
    core._index.load(kept)
    core._nodes.update(nodes)
    if kept or nodes:
        _log.info("master state: restored %d objects on %d nodes (nodes must register "
                  "again within %.1f s)", len(kept), len(nodes), core.config.drop_after_s)
    return max_version


def _object(rec: ObjectRecord, nodes: dict[str, Node], now: float, stamps: dict[int, int]
            ) -> Obj:
    """An object from its record, its copies resolved to the nodes known at this point of
    the replay (a copy of another epoch than the node's is gone)."""
    replicas: list[Replica] = []
    for r in rec.replicas:
        node = nodes.get(r.node_id)
        if node is not None and (not r.epoch or r.epoch == node.epoch):
            replicas.append(Replica(node, r.offset))
    ssd: list[Node] = []
    for i, nid in enumerate(rec.ssd_replicas):
        node = nodes.get(nid)
        epoch = rec.ssd_epochs[i] if i < len(rec.ssd_epochs) else ""
        if node is not None and (not epoch or epoch == node.epoch) and node not in ssd:
            ssd.append(node)
    return Obj(rec.key, rec.size, rec.checksum, rec.version, tuple(replicas), tuple(ssd),
               created=now, pinned=rec.pinned,
               shared=stamps.setdefault(rec.shared, rec.shared) if rec.shared else 0,
               pack=rec.pack if rec.shared else 0)
