"""The store master's state machine: the mixins of this package behind one face.

:class:`MasterCore` is the whole policy with no I/O of its own besides its
:class:`~kvctl.store.state.StateBackend`: the listener (:mod:`kvctl.store.server`) calls it,
tests call it directly with a fake clock. The master never touches object bytes: it hands
out locations (node segment + offset), and it hands nodes *tasks* (persist to SSD, load
from SSD, drop an SSD copy) through their heartbeat long-poll.

Where each rule lives: liveness (:mod:`.liveness`), placement and commits
(:mod:`.placement`), eviction and frees (:mod:`.eviction`), reservations
(:mod:`.reservations`), SSD tasks (:mod:`.ssdtasks`), reads and metadata (:mod:`.queries`),
the index and its counters (:mod:`.index`), restore (:mod:`.restore`).

Every method takes the one lock. Work that grows with the store (dropping a node,
watermark eviction past one slice) is a :class:`~kvctl.store.master.base.Job` that
:meth:`MasterCore.tick` runs a slice at a time, releasing the lock between slices.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

from kvctl.store.master.base import Job
from kvctl.store.master.config import MasterConfig
from kvctl.store.master.eviction import EvictionMixin
from kvctl.store.master.index import EvictedMemory, ObjectIndex
from kvctl.store.master.liveness import LivenessMixin, ObservedClock
from kvctl.store.master.placement import PlacementMixin
from kvctl.store.master.queries import QueriesMixin
from kvctl.store.master.reservations import ReservationsMixin
from kvctl.store.master.restore import restore
from kvctl.store.master.ssdtasks import SsdTasksMixin
from kvctl.store.sharedtier.config import SharedTierConfig
from kvctl.store.sharedtier.mixin import SharedTierMixin
from kvctl.store.state import NoState, Snapshot, StateBackend


class MasterCore(LivenessMixin, PlacementMixin, EvictionMixin, ReservationsMixin,
                 SsdTasksMixin, QueriesMixin, SharedTierMixin):
    """Master state machine. Thread-safe: every method takes the one lock.

    Args:
        config: policy knobs.
        state: persistence backend (its records are replayed here on start).
        clock: monotonic seconds (tests pass a fake).
        shared_tier: a shared tier (a directory every node and client sees), or ``None``.
    """

    def __init__(self, config: MasterConfig | None = None, state: StateBackend | None = None,
                 *, clock: Callable[[], float] = time.monotonic,
                 shared_tier: SharedTierConfig | None = None) -> None:
        self.config = config or MasterConfig()
        self.config.check()
        self.state = state or NoState()
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._index = ObjectIndex()
        self._pending = {}
        self._nodes = {}
        self._evicted = EvictedMemory()
        self._deferred = []
        self._deferred_seq = itertools.count()
        self._reservations = {}
        self._dropped = {}
        self._recent_drops = {}
        #: names this run of the master (sent in Hello): reservations die with it.
        self.instance = secrets.token_hex(8)
        self._reports = {}
        # from this run's start (nanoseconds, an int64 until 2262): a node's late report of
        # the last run's task (a write pending across a restart) never names one of this run
        self._task_ids = itertools.count(time.time_ns())
        self._jobs = deque()
        self._jobs_runner = threading.Lock()
        self._work = threading.Event()
        self._evicting = set()
        self._snapshot: SnapshotJob | None = None
        self.evictions = 0
        self.ssd_evictions = 0
        self.lost = 0
        self._shared_setup(shared_tier)
        max_version = restore(self)
        self._shared_restored()
        self._versions = itertools.count(max_version + 1)
        # The clock of liveness starts now that the restore is done: restored nodes get
        # their whole timeout and grace from here.
        self._observed = ObservedClock(clock, self.config.observed_step_s)
        now = self._observed()
        for node in self._nodes.values():
            node.last_seen = now

    @property
    def paused_s(self) -> float:
        """Seconds of the master's own pauses not counted against its nodes, in all."""
        observed = self._observed
        return observed.paused_s if isinstance(observed, ObservedClock) else 0.0

    # ------------------------------------------------------------------ housekeeping

    def tick(self, budget_s: float | None = None) -> bool:
        """Periodic housekeeping: node liveness, expired pending puts and reservations,
        deferred frees, then background jobs a slice at a time (for at most ``budget_s``
        seconds; all of them when ``None``). ``True`` when jobs remain."""
        self.state.sync()  # the journal writes what it buffered (not under the lock)
        with self._cond:
            self._judge_nodes()
            now = self._clock()
            self._expire_pending(now)
            self._expire_reservations(now)
            self._free_deferred(now)
            if self._snapshot is None and self.state.snapshot_wanted(len(self._index)):
                snap = self.state.start_snapshot([n.record() for n in self._nodes.values()])
                if snap is not None:
                    self._snapshot = SnapshotJob(self, snap)
                    self._schedule(self._snapshot)
        self._shared_housekeeping()  # file deletes and the purge sweep, off the lock
        return self._run_jobs(budget_s)

    def _run_jobs(self, budget_s: float | None) -> bool:
        if not self._jobs_runner.acquire(blocking=False):
            return True  # another thread runs them (one at a time: a job's I/O is ordered)
        try:
            return self._run_jobs_now(budget_s)
        finally:
            self._jobs_runner.release()

    def _run_jobs_now(self, budget_s: float | None) -> bool:
        deadline = None if budget_s is None else time.monotonic() + budget_s
        while True:
            with self._cond:
                if not self._jobs:
                    self._work.clear()
                    return False
                job = self._jobs.popleft()
                done = job.step(self.config.slice_objects)
                if not done:
                    self._jobs.append(job)
                more = bool(self._jobs)
            job.after(done)
            if not more:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return True
            time.sleep(0)  # let threads waiting for the lock take it between slices

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until background work is scheduled, :meth:`wake` is called or
        ``timeout_s`` passes."""
        self._work.wait(timeout_s)

    def wake(self) -> None:
        """End a :meth:`wait_for_work` now (e.g. the server is stopping)."""
        self._work.set()

    # ------------------------------------------------------------------ test hooks

    def live_allocations(self) -> dict[str, list[tuple[int, int]]]:
        """Per node, every allocated ``(offset, rounded_size)`` range: live, pending, deferred
        and reserved (for invariant tests; O(objects))."""
        with self._lock:
            out: dict[str, list[tuple[int, int]]] = {nid: [] for nid in self._nodes}
            for obj in [*self._index.values(), *self._pending.values()]:
                for r in obj.replicas:
                    if self._nodes.get(r.node.node_id) is r.node:
                        out[r.node.node_id].append((r.offset, r.node.alloc.rounded(obj.size)))
            for _, _, node, offset, size in self._deferred:
                if self._nodes.get(node.node_id) is node:
                    out[node.node_id].append((offset, node.alloc.rounded(size)))
            for res in self._reservations.values():
                for node, start in res.starts.items():
                    if self._nodes.get(node.node_id) is node:
                        out[node.node_id].extend((start + off, length)
                                                 for off, length in res.free.extents())
            return out

    def node_usage(self) -> dict[str, tuple[int, int]]:
        """Per node ``(used_bytes, capacity_bytes)``."""
        with self._lock:
            return {n.node_id: (n.alloc.used_bytes, n.alloc.capacity_bytes)
                    for n in self._nodes.values()}

    def close(self) -> None:
        """Close the state backend (a snapshot being written is abandoned). Safe to call
        twice."""
        self._work.set()
        with self._lock:
            snapshot, self._snapshot = self._snapshot, None
            if snapshot is not None and snapshot in self._jobs:
                self._jobs.remove(snapshot)
        if snapshot is not None:
            snapshot.abort()
        self._shared_close()  # the thread checking reported shared-tier files
        self.state.close()


class SnapshotJob(Job):
    """Write a snapshot of the live state a slice of keys at a time (the state backend
    writes the files after each slice, without the lock)."""

    def __init__(self, core: MasterCore, snapshot: Snapshot) -> None:
        self._core = core
        self._snap = snapshot
        self._after: str | None = None
        self._ended = False

    def step(self, budget: int) -> bool:
        index = self._core._index
        keys = index.keys_after(self._after, budget)
        if not keys:
            return True
        records = []
        for key in keys:
            obj = index.get(key)
            if obj is not None:
                records.append(obj.record())
        self._snap.add(records)
        self._after = keys[-1]
        return False

    def after(self, finished: bool) -> None:
        if self._ended:
            return
        self._snap.write()
        if finished:
            self._ended = True
            self._snap.finish()
            with self._core._lock:
                if self._core._snapshot is self:
                    self._core._snapshot = None

    def abort(self) -> None:
        if not self._ended:
            self._ended = True
            self._snap.abort()
