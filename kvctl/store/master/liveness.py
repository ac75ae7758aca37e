"""Node liveness: registration, heartbeats, suspicion and (much later) dropping.

Rules (tests/store/test_liveness.py):

- A node silent past ``node_timeout_s`` is *suspect*: it gets no new placements or
  reservations, gets are answered with its objects' other replicas (or ``unavailable`` when
  it holds the only ones), and its objects stay in the index. A heartbeat with the same
  epoch makes it alive again with every object it had.
- Only a node silent past ``node_grace_s`` (or removed by a ``DropNode`` request, or
  registering again with new memory) is *dropped*: its epoch is remembered (the node must
  come back with new memory) and its objects lose their copies on it; objects with no copy
  left are lost. Dropping is O(the node's objects), in slices of ``slice_objects`` with the
  lock released between them.
- An elected master that is not sure it leads (its lease not renewed for its TTL:
  :meth:`LivenessMixin.fence_nodes`) refuses registrations and heartbeats with
  ``not_leader`` (the node goes to the leader the leader key names) and judges no node
  meanwhile.
- Silence is measured on the master's *observed* clock (:class:`ObservedClock`): a gap
  between two of the master's own observations longer than ``observed_step_s`` counts only
  that much, so the master's own pauses (a garbage collection, a SIGSTOP, a restore, a
  busy lock) are never held against its nodes. A restarted master starts that clock when
  its restore has finished: restored nodes get the whole timeout and grace from then.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from kvctl.store import protocol as p
from kvctl.store.master.base import Job, MasterBase, err
from kvctl.store.master.records import ALIVE, DROPPED, RESTORED, SUSPECT, Node, Obj

_log = logging.getLogger("kvctl.store.master")


class ObservedClock:
    """Seconds as the master saw them pass: real time, except that one gap between two
    calls counts at most ``max_step_s`` (the rest was the master's own pause).

    Args:
        clock: the real monotonic clock, seconds.
        max_step_s: the most one gap between calls counts, seconds.
    """

    def __init__(self, clock: Callable[[], float], max_step_s: float) -> None:
        self._clock = clock
        self._max_step = max_step_s
        self._last = clock()
        self._now = self._last
        #: seconds of gaps not counted (the master's own pauses), in all.
        self.paused_s = 0.0

    def __call__(self) -> float:
        t = self._clock()
        step = t - self._last
        if step > 0:
            counted = min(step, self._max_step)
            self._now += counted
            self.paused_s += step - counted
            self._last = t
        return self._now

    def restart(self) -> None:
        """Count nothing of the time since the last call (e.g. a restore just finished)."""
        t = self._clock()
        self.paused_s += max(0.0, t - self._last)
        self._last = t


class DropJob(Job):
    """Take a dropped node's copies out of every object that had one, a slice at a time."""

    def __init__(self, core: LivenessMixin, node: Node, why: str) -> None:
        self._core = core
        self._node = node
        self._why = why
        self.lost = 0

    @property
    def node(self) -> Node:
        """The node being dropped (its copies not yet taken out are unreadable now)."""
        return self._node

    def step(self, budget: int) -> bool:
        core, node = self._core, self._node
        done = 0
        while done < budget and node.lru:
            _, obj = node.lru.popitem()
            self.lost += core._drop_copies(obj, node, self._why)
            done += 1
        while done < budget and node.ssd_lru:
            _, obj = node.ssd_lru.popitem()
            node.ssd_used_bytes -= obj.size
            self.lost += core._drop_copies(obj, node, self._why)
            done += 1
        if node.lru or node.ssd_lru:
            return False
        _log.info("node %s: drop finished (%d objects lost with it)", node.node_id, self.lost)
        return True


#: How many dropped nodes ``status`` remembers (most recent).
RECENT_DROPS = 64


class LivenessMixin(MasterBase):
    """Registration, heartbeats, suspicion and dropping of nodes."""

    def register_node(self, msg: p.RegisterNode) -> p.ErrorInfo | None:
        """Add (or re-adopt after a master restart or a stall) a storage node."""
        if msg.ssd_policy not in p.SSD_POLICIES:
            return err("bad_request", f"unknown SSD policy {msg.ssd_policy!r}",
                       f"use one of {', '.join(p.SSD_POLICIES)}")
        if msg.capacity_bytes <= 0 or msg.ssd_capacity_bytes < 0:
            return err("bad_request", "node capacity must be positive")
        refused = self._nodes_refused()
        if refused is not None:
            return refused
        with self._cond:
            now = self._observed()
            if self._dropped.get(msg.node_id) == msg.epoch:
                return err("node_dropped", f"node {msg.node_id} was declared dead; its "
                           "memory may still be written by clients holding old locations",
                           "register again with new memory (a new epoch and segment)")
            old = self._nodes.get(msg.node_id)
            if old is not None and old.epoch == msg.epoch and (
                    old.capacity_bytes == msg.capacity_bytes):
                was = old.state
                old.state = ALIVE
                old.last_seen = now
                old.endpoint, old.segment, old.host_id = msg.endpoint, msg.segment, msg.host_id
                old.ssd_capacity_bytes, old.ssd_policy = msg.ssd_capacity_bytes, msg.ssd_policy
                old.descriptor = msg.descriptor
                if msg.running is not None:  # tasks it never got (a reply lost): failed
                    running = set(msg.running)
                    for task in [t for t in old.inflight.values()
                                 if t.task_id not in running]:
                        self._apply_report(old, p.TaskReport(
                            task_id=task.task_id, ok=False,
                            error="LOST: the node never got this task (a reply lost)"))
                self.state.put_node(old.record())
                _log.info("node %s re-registered (%s, epoch kept: %d objects adopted)",
                          msg.node_id, was, len(old.lru))
                self._cond.notify_all()
                return None
            if old is not None:
                self._start_drop(old, why="it restarted with new memory")
            node = Node(msg.node_id, msg.epoch, msg.segment, msg.endpoint, msg.host_id,
                        msg.capacity_bytes, msg.ssd_capacity_bytes, msg.ssd_policy,
                        last_seen=now, descriptor=msg.descriptor)
            self._nodes[msg.node_id] = node
            self._recent_drops.pop(msg.node_id, None)
            self.state.put_node(node.record())
            _log.info("node %s registered: %d bytes DRAM, SSD %s", msg.node_id,
                      msg.capacity_bytes, msg.ssd_policy)
            return None

    def heartbeat(self, msg: p.Heartbeat) -> list[p.Task] | p.ErrorInfo:
        """Record liveness and task reports; return new tasks (waiting up to ``wait_s``)."""
        refused = self._nodes_refused()
        if refused is not None:
            return refused  # its reports come again with its registration elsewhere
        with self._cond:
            node = self._nodes.get(msg.node_id)
            if node is None and self._dropped.get(msg.node_id) == msg.epoch:
                return err("node_dropped", f"node {msg.node_id} was declared dead",
                           "register again with new memory (a new epoch and segment)")
            if node is None or node.epoch != msg.epoch or node.state == RESTORED:
                return err("unknown_node", f"node {msg.node_id} is not registered",
                           "register again")
            now = self._observed()
            if node.state == SUSPECT:
                _log.warning("node %s answers again after %.1f s of silence (same epoch): "
                             "its %d objects are served again", node.node_id,
                             now - node.last_seen, len(node.lru))
                node.state = ALIVE
                self._cond.notify_all()
            node.last_seen = now
            for report in msg.reports:
                self._apply_report(node, report)
            if not node.tasks and msg.wait_s > 0:
                self._cond.wait_for(lambda: bool(node.tasks) or not node.alive,
                                    timeout=min(msg.wait_s, 5.0))
                if node.alive:
                    node.last_seen = self._observed()
            tasks = _take_tasks(node.tasks, TASK_REPLY_BYTES)
            for t in tasks:
                node.inflight[t.task_id] = t
            return tasks

    def drop_node(self, node_id: str) -> p.ErrorInfo | None:
        """Drop a node now (a ``DropNode`` request): as if its grace had run out. If it is
        still running it comes back with new memory."""
        with self._cond:
            node = self._nodes.get(node_id)
            if node is None:
                return err("not_found", f"no node {node_id!r} is registered",
                           "see kvctl store status for the registered nodes")
            self._dropped[node_id] = node.epoch
            self._start_drop(node, why="removed by an operator")
            return None

    def _judge_nodes(self) -> None:
        """Mark silent nodes suspect, drop those silent past their grace (lock held)."""
        now = self._observed()
        cfg = self.config
        if self._nodes_leading is not None and self._nodes_leading() is not None:
            for node in self._nodes.values():  # refused by us: not their silence
                node.last_seen = max(node.last_seen, now)
            return
        for node in list(self._nodes.values()):
            silent = now - node.last_seen
            if node.state == ALIVE and silent > cfg.node_timeout_s:
                node.state = SUSPECT
                _log.warning("node %s is suspect: no heartbeat for %.1f s; no new placements, "
                             "reads go to other replicas, its %d objects are kept (dropped "
                             "after %.0f s of silence, or when an operator removes it)",
                             node.node_id, silent, len(node.lru), cfg.drop_after_s)
                self._cond.notify_all()
            if node.state in (SUSPECT, RESTORED) and silent > cfg.drop_after_s:
                self._dropped[node.node_id] = node.epoch
                self._start_drop(node, why=f"no heartbeat for {silent:.1f} s")

    def _start_drop(self, node: Node, *, why: str) -> None:
        """Drop ``node``: it leaves the tables now, its objects' copies on it go a slice at
        a time (the first slice right here)."""
        _log.warning("node %s dropped: %s (%d objects had a copy on it)", node.node_id, why,
                     len(node.lru) + len(node.ssd_lru))
        node.state = DROPPED
        if self._nodes.get(node.node_id) is node:
            del self._nodes[node.node_id]
        drops = self._recent_drops
        drops.pop(node.node_id, None)
        drops[node.node_id] = (node.last_seen, self._observed(), why)
        while len(drops) > RECENT_DROPS:
            del drops[next(iter(drops))]
        self.state.delete_node(node.node_id)
        self._leave_reservations(node)
        for key, obj in list(self._pending.items()):
            if obj.replica_on(node) is not None:
                obj.replicas = tuple(r for r in obj.replicas if r.node is not node)
                if not obj.replicas:
                    del self._pending[key]
        self._shared_node_gone(node)  # its write-through copies in flight never report
        node.tasks.clear()
        node.inflight.clear()
        node.freeing_bytes = 0
        job = DropJob(self, node, f"its only node {node.node_id} was dropped: {why}")
        if not job.step(self.config.slice_objects):
            self._schedule(job)
        self._cond.notify_all()

    def _drop_copies(self, obj: Obj, node: Node, why: str) -> int:
        """Take ``node``'s copies out of ``obj``; 1 if that lost the object, else 0."""
        if obj.evicting is not None and obj.evicting.pop(node, None) is not None and (
                not obj.evicting):
            obj.evicting = None
        if obj.loading is not None and obj.loading.pop(node, None) is not None and (
                not obj.loading):
            obj.loading = None
        replicas = tuple(r for r in obj.replicas if r.node is not node)
        ssd = tuple(n for n in obj.ssd if n is not node)
        if len(replicas) == len(obj.replicas) and len(ssd) == len(obj.ssd):
            return 0
        self._index.set_copies(obj, replicas=replicas, ssd=ssd)
        if not self._index.holds(obj):
            return 0
        if replicas or ssd or obj.shared:
            self._persist(obj)
            return 0
        self._forget(obj, why, lost=True)
        return 1


#: Task bytes one heartbeat answer carries at most (a quarter of a master frame: tasks name
#: keys, up to 4 KiB each, and a pack task up to 4,096 of them); the rest go with the next.
TASK_REPLY_BYTES = 1 << 20


def _task_bytes(task: p.Task) -> int:
    """About what ``task`` takes in a reply, bytes (keys at 4 bytes a character at most)."""
    return 64 + 4 * (len(task.key) + len(task.path)) + sum(
        48 + 4 * len(e.key) for e in task.entries)


def _take_tasks(queue: deque[p.Task], budget: int) -> list[p.Task]:
    """The oldest tasks of ``queue`` that fit ``budget`` bytes (at least one), taken off."""
    out: list[p.Task] = []
    while queue:
        budget -= _task_bytes(queue[0])
        if out and budget < 0:
            break
        out.append(queue.popleft())
    return out
