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

from kvctl.store.master.config import MasterConfig
from kvctl.store.master.eviction import EvictionMixin
from kvctl.store.master.index import EvictedMemory, ObjectIndex
from kvctl.store.master.liveness import LivenessMixin, ObservedClock
from kvctl.store.master.placement import PlacementMixin
from kvctl.store.master.queries import QueriesMixin
from kvctl.store.master.reservations import ReservationsMixin
from kvctl.store.master.restore import restore
from kvctl.store.master.ssdtasks import SsdTasksMixin
from kvctl.store.state import NoState, StateBackend


class MasterCore(LivenessMixin, PlacementMixin, EvictionMixin, ReservationsMixin,
                 SsdTasksMixin, QueriesMixin):
    """Master state machine. Thread-safe: every method takes the one lock.

    Args:
        config: policy knobs.
        state: persistence backend (its records are replayed here on start).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, config: MasterConfig | None = None, state: StateBackend | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MasterConfig()
        self.config.check()
        self.state = state or NoState()
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._index = ObjectIndex()
        self._pending = {}
        self._pending_order = deque()
        self._nodes = {}
        self._evicted = EvictedMemory()
        self._deferred = []
        self._deferred_seq = itertools.count()
        self._reservations = {}
        self._dropped = {}
        #: names this run of the master (sent in Hello): reservations die with it.
        self.instance = secrets.token_hex(8)
        self._reports = {}
        self._task_ids = itertools.count(1)
        self._jobs = deque()
        self._work = threading.Event()
        self._evicting = set()
        self.evictions = 0
        self.ssd_evictions = 0
        self.lost = 0
        max_version = restore(self)
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
        with self._cond:
            self.state.sync()
            self._judge_nodes()
            now = self._clock()
            self._expire_pending(now)
            self._expire_reservations(now)
            self._free_deferred(now)
        return self._run_jobs(budget_s)

    def _run_jobs(self, budget_s: float | None) -> bool:
        deadline = None if budget_s is None else time.monotonic() + budget_s
        while True:
            with self._cond:
                if not self._jobs:
                    self._work.clear()
                    return False
                job = self._jobs.popleft()
                if not job.step(self.config.slice_objects):
                    self._jobs.append(job)
                more = bool(self._jobs)
            if not more:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return True
            time.sleep(0)  # let threads waiting for the lock take it between slices

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until background work is scheduled or ``timeout_s`` passes."""
        self._work.wait(timeout_s)

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
        """Close the state backend. Safe to call twice."""
        self._work.set()
        with self._lock:
            self.state.close()
