"""The tables every part of the master shares, and the small helpers they all use.

:class:`MasterBase` holds the state; each concern is a mixin in its own module (liveness,
placement, eviction, reservations, SSD tasks, queries) and :class:`~kvctl.store.master.core.
MasterCore` puts them together. Methods one mixin calls on another are declared here, so
each module can be read (and type-checked) on its own.

Everything here runs with the master's lock held.
"""

from __future__ import annotations

import abc
import threading
from collections import deque
from collections.abc import Callable, Iterator

from kvctl.store import protocol as p
from kvctl.store.master.config import MasterConfig
from kvctl.store.master.index import EvictedMemory, ObjectIndex
from kvctl.store.master.records import Node, Obj, Replica, Reservation
from kvctl.store.state import StateBackend


def err(code: str, cause: str, hint: str = "") -> p.ErrorInfo:
    return p.ErrorInfo(code=code, cause=cause, hint=hint)


class Job(abc.ABC):
    """Work that grows with the store, done a slice at a time with the lock held and
    released between slices (see :meth:`MasterCore.tick`)."""

    @abc.abstractmethod
    def step(self, budget: int) -> bool:
        """Handle up to ``budget`` objects; ``True`` when the job is finished."""

    def after(self, finished: bool) -> None:  # noqa: B027 - optional hook
        """Run after each :meth:`step` once the lock is released (I/O belongs here)."""


class MasterBase:
    """Shared tables (see the mixins for the rules that change them)."""

    config: MasterConfig
    state: StateBackend
    instance: str
    _clock: Callable[[], float]
    _observed: Callable[[], float]
    _lock: threading.RLock
    _cond: threading.Condition
    _index: ObjectIndex
    #: puts allocated but not committed yet, by key, in the order they expire (inserted
    #: once each, with the same TTL)
    _pending: dict[str, Obj]
    _nodes: dict[str, Node]
    _evicted: EvictedMemory
    #: heap of (free at, seq, node, offset, size): space of removed objects still leased
    _deferred: list[tuple[float, int, Node, int, int]]
    _deferred_seq: Iterator[int]
    _reservations: dict[int, Reservation]
    #: node id -> epoch of nodes declared dead: that memory must not come back (clients
    #: may still write to locations in it), the node registers new memory instead.
    _dropped: dict[str, str]
    #: node id -> (last heard from, dropped at, why) of the latest drops (observed clock),
    #: for ``status``
    _recent_drops: dict[str, tuple[float, float, str]]
    _reports: dict[int, p.TaskReport]
    _versions: Iterator[int]
    _task_ids: Iterator[int]
    _jobs: deque[Job]
    _work: threading.Event
    evictions: int
    ssd_evictions: int
    lost: int

    #: while an elected master knows it leads: ``None``, else why not (see
    #: :meth:`fence_nodes`)
    _nodes_leading: Callable[[], str | None] | None = None

    def fence_nodes(self, sure: Callable[[], str | None]) -> None:
        """Take node registrations and heartbeats only while ``sure()`` is ``None`` (an
        elected master whose lease is fresh: :meth:`~kvctl.store.master.election.
        Election.sure`); else they are answered ``not_leader``, so the node looks for the
        leader again (the leader key, or the next master it was given); reservations and
        puts too (:meth:`_nodes_refused`), so clients move with them. ``sure`` must not
        block: it is asked with the lock held.

        While the master is not sure, its nodes' silence is its own doing: it is not
        held against them (they get their whole timeout from when it is sure again)."""
        self._nodes_leading = sure

    def _nodes_refused(self, what: str = "nodes") -> p.ErrorInfo | None:
        """``not_leader`` while this master is not sure it leads (else ``None``); puts
        and reservations are refused so too (they could not be acknowledged: the state is
        out of reach), so writers move to the leader as nodes do."""
        sure = self._nodes_leading
        why = None if sure is None else sure()
        if why is None:
            return None
        return err("not_leader", f"this store master cannot take {what}: {why}",
                   "nodes and clients move to the master the leader key names (give "
                   "clients every master, --master A:PORT,B:PORT, or etcd://)")

    # ------------------------------------------------------------------ copies

    def _set_replicas(self, obj: Obj, replicas: tuple[Replica, ...]) -> None:
        self._index.set_copies(obj, replicas=replicas)

    def _set_ssd(self, obj: Obj, ssd: tuple[Node, ...]) -> None:
        self._index.set_copies(obj, ssd=ssd)

    @staticmethod
    def _lru_add(node: Node, obj: Obj) -> None:
        """``obj`` has a DRAM replica on ``node``: most recently used there (the LRU maps
        are plain dicts in insertion order: re-inserting a key makes it the most recent)."""
        node.lru.pop(obj.key, None)
        node.lru[obj.key] = obj

    @staticmethod
    def _lru_remove(node: Node, obj: Obj) -> None:
        if node.lru.get(obj.key) is obj:
            del node.lru[obj.key]

    @staticmethod
    def _ssd_lru_add(node: Node, obj: Obj) -> None:
        old = node.ssd_lru.pop(obj.key, None)
        if old is not None:
            node.ssd_used_bytes -= old.size
        node.ssd_lru[obj.key] = obj
        node.ssd_used_bytes += obj.size

    @staticmethod
    def _ssd_lru_remove(node: Node, obj: Obj) -> None:
        if node.ssd_lru.get(obj.key) is obj:
            del node.ssd_lru[obj.key]
            node.ssd_used_bytes -= obj.size

    def _write_back_done(self, obj: Obj, node: Node, now: float) -> bool:
        """A write-back copy of ``obj`` from ``node`` (SSD or shared tier) landed or failed:
        free its DRAM replica there, unless it was read meanwhile (then it is evictable
        again); ``True`` when freed (the object's record is written then)."""
        if obj.evicting is None or obj.evicting.pop(node, None) is None:
            return False
        if not obj.evicting:
            obj.evicting = None
        rep = obj.replica_on(node)
        if rep is None:
            return False
        if obj.leased(now):
            self._lru_add(node, obj)
            return False
        self._free_replica(obj, rep, now)
        return True

    # ------------------------------------------------------------------ state

    def _persist(self, obj: Obj) -> None:
        """Write ``obj``'s record if it is the current object of its key."""
        if self._index.holds(obj):
            self.state.put_object(obj.record())

    def _forget(self, obj: Obj, why: str, *, lost: bool = False) -> None:
        """``obj`` has no copy left: it leaves the index (if still current) and the state;
        a get of its key answers "evicted (why)". An object with a shared-tier copy keeps
        it and stays."""
        if obj.shared and self._index.holds(obj):
            self._persist(obj)
            return
        if not self._index.discard(obj):
            return
        if lost:
            self.lost += 1
        self._evicted.remember(obj.key, why)
        self.state.delete_object(obj.key)

    def _missing(self, key: str) -> p.ErrorInfo:
        why = self._evicted.get(key)
        if why is not None:
            return err("evicted", f"key {key!r} was evicted ({why})", "put it again")
        return err("not_found", f"key {key!r} is not in the store")

    def _schedule(self, job: Job) -> None:
        self._jobs.append(job)
        self._work.set()

    # ------------------------------------------------------------------ across mixins

    def _task(self, node: Node, op: str, obj: Obj, offset: int, *,
              free_after: bool = False) -> p.Task:
        raise NotImplementedError

    def _free_replica(self, obj: Obj, rep: Replica, now: float) -> None:
        raise NotImplementedError

    def _free_space(self, node: Node, offset: int, size: int, obj: Obj, now: float) -> None:
        raise NotImplementedError

    def _release(self, obj: Obj, now: float) -> None:
        raise NotImplementedError

    def _watermark(self, node: Node, now: float) -> None:
        raise NotImplementedError

    def _place(self, nodes: list[Node], size: int, replicas: int, now: float
               ) -> list[tuple[Node, int]] | None:
        raise NotImplementedError

    def _install(self, obj: Obj, now: float) -> None:
        raise NotImplementedError

    def _allocate(self, node: Node, size: int, now: float) -> int | None:
        raise NotImplementedError

    def _load_from_ssd(self, obj: Obj) -> p.ErrorInfo | None:
        raise NotImplementedError

    def _end_reservation(self, res: Reservation) -> None:
        raise NotImplementedError

    def _leave_reservations(self, node: Node) -> None:
        raise NotImplementedError

    def _apply_report(self, node: Node, report: p.TaskReport) -> None:
        raise NotImplementedError

    # shared tier (kvctl.store.sharedtier.mixin)

    def _shared_write_back(self, obj: Obj, node: Node, rep: Replica, now: float) -> bool:
        raise NotImplementedError

    def _shared_write_through(self, obj: Obj, now: float) -> None:
        raise NotImplementedError

    def _shared_persisted(self, node: Node, task: p.Task, report: p.TaskReport,
                          obj: Obj | None, now: float) -> None:
        raise NotImplementedError

    def _shared_pack_persisted(self, node: Node, task: p.Task, report: p.TaskReport,
                               now: float) -> None:
        raise NotImplementedError

    def _shared_drop(self, obj: Obj, now: float) -> None:
        raise NotImplementedError

    def _shared_node_gone(self, node: Node) -> None:
        raise NotImplementedError

    def _shared_name(self, obj: Obj) -> str:
        raise NotImplementedError

    def _shared_at(self, obj: Obj) -> int:
        raise NotImplementedError

    def _shared_get(self, obj: Obj, lease: bool, now: float) -> p.GetSlot:
        raise NotImplementedError

    def _shared_status(self) -> p.SharedTierStatus | None:
        raise NotImplementedError
