"""Rebuild a master's tables from its state backend.

Nodes come back *restored* (no placements, no reads) until they register again with the
same epoch, or are dropped after their grace. A replica or SSD copy recorded under another
epoch than its node's record is gone (the node restarted since) and is left out. Each
node's allocator is built in one pass over its replicas (:meth:`ExtentAllocator.from_ranges`),
whatever order the records come in; of two overlapping replicas the one at the lower
offset is kept.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvctl.store.allocator import ExtentAllocator
from kvctl.store.master.records import RESTORED, Node, Obj, Replica

if TYPE_CHECKING:
    from kvctl.store.master.base import MasterBase

_log = logging.getLogger("kvctl.store.master")


def restore(core: MasterBase) -> int:
    """Fill ``core``'s (empty) tables from ``core.state``; the highest version seen."""
    loaded = core.state.load()
    now = core._clock()
    nodes: dict[str, Node] = {}
    for rec in loaded.nodes:
        nodes[rec.node_id] = Node(rec.node_id, rec.epoch, rec.segment, rec.endpoint,
                                  rec.host_id, rec.capacity_bytes, rec.ssd_capacity_bytes,
                                  rec.ssd_policy, last_seen=0.0, state=RESTORED)
    ranges: dict[Node, list[tuple[int, int]]] = {n: [] for n in nodes.values()}
    owners: dict[Node, list[Obj]] = {n: [] for n in nodes.values()}
    objects: list[Obj] = []
    max_version = 0
    for orec in loaded.objects:
        max_version = max(max_version, orec.version)
        replicas: list[Replica] = []
        for r in orec.replicas:
            node = nodes.get(r.node_id)
            if node is None or (r.epoch and r.epoch != node.epoch):
                continue
            replicas.append(Replica(node, r.offset))
            ranges[node].append((r.offset, orec.size))
        ssd: list[Node] = []
        for i, nid in enumerate(orec.ssd_replicas):
            node = nodes.get(nid)
            epoch = orec.ssd_epochs[i] if i < len(orec.ssd_epochs) else ""
            if node is None or (epoch and epoch != node.epoch) or node in ssd:
                continue
            ssd.append(node)
        obj = Obj(orec.key, orec.size, orec.checksum, orec.version, tuple(replicas),
                  tuple(ssd), created=now, pinned=orec.pinned)
        for rep in replicas:
            owners[rep.node].append(obj)
        objects.append(obj)
    for node in nodes.values():
        node.alloc, rejected = ExtentAllocator.from_ranges(node.capacity_bytes, ranges[node])
        for i in rejected:
            obj = owners[node][i]
            _log.warning("master state: replica of %r on %s overlaps another; dropped",
                         obj.key, node.node_id)
            obj.replicas = tuple(r for r in obj.replicas if r.node is not node)
    kept: list[Obj] = []
    for obj in objects:
        if not obj.replicas and not obj.ssd:
            continue
        kept.append(obj)
        for rep in obj.replicas:
            rep.node.lru[obj.key] = obj
        for node in obj.ssd:
            node.ssd_lru[obj.key] = obj
            node.ssd_used_bytes += obj.size
    core._index.load(kept)
    core._nodes.update(nodes)
    if kept or nodes:
        _log.info("master state: restored %d objects on %d nodes (nodes must register "
                  "again within %.1f s)", len(kept), len(nodes), core.config.drop_after_s)
    return max_version
