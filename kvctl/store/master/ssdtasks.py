"""SSD tasks: the master hands nodes persist, load and drop jobs through their heartbeats.

Rules (tests/store/test_ssd.py, tests/reliability/test_faults.py):

- write-through: every commit tasks each replica node with a copy to SSD; write-back: an
  object is copied to SSD only when evicted from DRAM, its DRAM freed when the copy lands.
- A get of an object with no DRAM replica on an alive node loads an SSD copy back into
  DRAM (verified by the node) and answers with it.
- A torn or flipped SSD copy fails its check: the master drops that copy; with none left
  the object is gone (a get answers "evicted").
- A node whose SSD refused a write for lack of space is marked ``full``: no offload to it
  (write-through copies are skipped, write-back evictions just free DRAM) until a retry
  after ``ssd_full_retry_s`` succeeds; its DRAM keeps serving.
- ``ssd_capacity_bytes`` bounds a node's SSD copies (least recently used dropped past it).
"""

from __future__ import annotations

import logging

import msgspec

from kvctl.store import protocol as p
from kvctl.store.master.base import MasterBase, err
from kvctl.store.master.records import Node, Obj, Replica

_log = logging.getLogger("kvctl.store.master")


class SsdTasksMixin(MasterBase):
    """Tasks for nodes' SSD tiers and what their reports change."""

    def _task(self, node: Node, op: str, obj: Obj, offset: int, *,
              free_after: bool = False) -> p.Task:
        task = p.Task(task_id=next(self._task_ids), op=op, key=obj.key, version=obj.version,
                      offset=offset, size=obj.size, checksum=obj.checksum,
                      free_after=free_after)
        node.tasks.append(task)
        self._cond.notify_all()
        return task

    def _apply_report(self, node: Node, report: p.TaskReport) -> None:
        if report.pending:
            return  # still running on the node: its report comes later
        task = node.inflight.pop(report.task_id, None)
        if task is None:
            return
        now = self._clock()
        obj = self._index.get(task.key)
        if obj is not None and obj.version != task.version:
            obj = None
        if task.op == "persist":
            self._persisted(node, task, report, obj, now)
        elif task.op == "load":
            self._loaded(node, task, report, obj)
            self._cond.notify_all()
        elif task.op == "shared":
            self._shared_persisted(node, task, report, obj, now)
        elif task.op == "pack":
            self._shared_pack_persisted(node, task, report, now)

    def _persisted(self, node: Node, task: p.Task, report: p.TaskReport, obj: Obj | None,
                   now: float) -> None:
        self._ssd_health(node, report, now)
        if task.free_after:
            node.freeing_bytes = max(0, node.freeing_bytes - node.alloc.rounded(task.size))
        if obj is None:
            if task.free_after:  # removed while its write-back ran: free the DRAM now
                node.alloc.free(task.offset, task.size)
            if report.ok:  # object gone meanwhile: drop the file just written
                node.tasks.append(msgspec.structs.replace(
                    task, task_id=next(self._task_ids), op="drop"))
            return
        if report.ok:
            if node not in obj.ssd:
                self._set_ssd(obj, (*obj.ssd, node))
            self._ssd_lru_add(node, obj)
            self._ssd_watermark(node, obj.key)
        else:
            _log.warning("node %s could not persist %r: %s", node.node_id, obj.key,
                         report.error)
        if task.free_after:
            self._write_back_done(obj, node, now)
        self._persist(obj)

    def _loaded(self, node: Node, task: p.Task, report: p.TaskReport, obj: Obj | None
                ) -> None:
        self._reports[task.task_id] = report
        if obj is None or obj.loading is None or obj.loading.get(node) != task.task_id:
            node.alloc.free(task.offset, task.size)
            return
        del obj.loading[node]
        if not obj.loading:
            obj.loading = None
        if report.ok:
            self._set_replicas(obj, (*obj.replicas, Replica(node, task.offset)))
            self._lru_add(node, obj)
            if node.ssd_lru.get(obj.key) is obj:
                node.ssd_lru[obj.key] = node.ssd_lru.pop(obj.key)
            self._persist(obj)
            return
        node.alloc.free(task.offset, task.size)
        if report.corrupt:
            _log.warning("SSD copy of %r on %s failed its checksum: dropped", obj.key,
                         node.node_id)
            self._set_ssd(obj, tuple(n for n in obj.ssd if n is not node))
            self._ssd_lru_remove(node, obj)
            if not obj.replicas and not obj.ssd:
                self._forget(obj, "its SSD copy was corrupt", lost=True)
            else:
                self._persist(obj)

    def _ssd_health(self, node: Node, report: p.TaskReport, now: float) -> None:
        """Track a node's SSD filling up (pause offload) and recovering."""
        if report.full:
            if not node.ssd_full:
                _log.warning("node %s: SSD tier full (%s); offload paused, DRAM keeps serving",
                             node.node_id, report.error)
            node.ssd_full = True
            node.ssd_retry_at = now + self.config.ssd_full_retry_s
            node.ssd_error = report.error
        elif report.ok and node.ssd_full:
            _log.info("node %s: SSD tier has room again; offload resumed", node.node_id)
            node.ssd_full = False
            node.ssd_error = ""

    def _ssd_watermark(self, node: Node, newest: str) -> None:
        over = node.ssd_used_bytes - node.ssd_capacity_bytes
        if over <= 0:
            return
        victims: list[Obj] = []
        for key, obj in node.ssd_lru.items():
            if key == newest:
                continue
            victims.append(obj)
            over -= obj.size
            if over <= 0:
                break
        for obj in victims:
            self._ssd_lru_remove(node, obj)
            if not self._index.holds(obj):
                continue
            self.ssd_evictions += 1
            self._task(node, "drop", obj, 0)
            self._set_ssd(obj, tuple(n for n in obj.ssd if n is not node))
            if not obj.replicas and not obj.ssd:
                self._forget(obj, "evicted from SSD")
            else:
                self._persist(obj)

    def _load_from_ssd(self, obj: Obj) -> p.ErrorInfo | None:
        """Bring an object with no DRAM replica on an alive node back into DRAM from one of
        its SSD copies (lock held; waits for the node, releasing the lock)."""
        deadline = self._clock() + self.config.load_timeout_s
        for node in sorted(obj.ssd, key=lambda n: n.node_id):
            if not node.alive:
                continue
            now = self._clock()
            task_id = obj.loading.get(node) if obj.loading is not None else None
            if task_id is None:
                offset = self._allocate(node, obj.size, now)
                # Write-back evictions in flight free DRAM once their persist lands: wait
                # for them (the condition releases the lock) rather than fail the get.
                while offset is None and node.freeing_bytes and self._clock() < deadline:
                    self._cond.wait(timeout=min(0.05, max(0.0, deadline - self._clock())))
                    offset = self._allocate(node, obj.size, self._clock())
                if offset is None:
                    return err("full", f"no DRAM on {node.node_id} to load {obj.key!r} from "
                               "SSD", "add DRAM capacity or unpin objects")
                task = self._task(node, "load", obj, offset)
                task_id = task.task_id
                if obj.loading is None:
                    obj.loading = {}
                obj.loading[node] = task_id
            ok = self._cond.wait_for(
                lambda tid=task_id, n=node: tid in self._reports or not n.alive,  # type: ignore[misc]
                timeout=max(0.0, deadline - self._clock()))
            if not node.alive:
                continue
            if not ok:
                return err("unavailable", f"node {node.node_id} did not load {obj.key!r} "
                           f"from SSD in {self.config.load_timeout_s:.1f} s",
                           "check the node's SSD")
            self._reports.pop(task_id, None)
            if any(r.node.alive for r in obj.replicas):
                return None
            if not self._index.holds(obj):
                return self._missing(obj.key)
        if any(r.node.alive for r in obj.replicas):
            return None
        return self._missing(obj.key)
