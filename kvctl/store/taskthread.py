"""A storage node's slow tasks on a thread of their own, in order.

SSD writes and reads (and the shared tier's file writes, :mod:`kvctl.store.sharedtier.writer`)
can take seconds on a loaded disk. Run on the node's heartbeat loop they made the master
judge a healthy node dead. :meth:`TaskThread.run` hands a task to the thread and waits a
little; a task not done by then is reported ``pending`` (the master keeps it in flight) and
its real report goes with a later heartbeat (:meth:`TaskThread.finished`). Tasks run one at
a time in the order given, as they did on the heartbeat loop, so a ``drop`` never overtakes
the ``persist`` of the same key.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvctl.store import protocol as p

_log = logging.getLogger("kvctl.store")

#: Seconds :meth:`TaskThread.run` waits for a task before reporting it pending.
WAIT_S = 0.25


class _Job:
    __slots__ = ("done", "generation", "late", "report", "task_id", "work")

    def __init__(self, task_id: int, work: Callable[[], p.TaskReport], generation: int
                 ) -> None:
        self.task_id = task_id
        self.work = work
        self.generation = generation
        self.done = threading.Event()
        self.report: p.TaskReport | None = None
        self.late = False


class TaskThread:
    """Run tasks on one thread, FIFO (started on first use).

    Args:
        name: the thread's name.
        wait_s: how long :meth:`run` waits for a task before reporting it pending.
    """

    def __init__(self, name: str, *, wait_s: float = WAIT_S) -> None:
        self.name = name
        self.wait_s = wait_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._late: list[p.TaskReport] = []
        #: tasks reported ``pending`` whose report :meth:`finished` has not handed out yet
        self._open: set[int] = set()
        self._generation = 0
        self._thread: threading.Thread | None = None

    def run(self, task_id: int, work: Callable[[], p.TaskReport]) -> p.TaskReport:
        """``work()``'s report (it runs on the thread, after every task given before), or
        a ``pending`` report for ``task_id`` when it takes longer than ``wait_s``."""
        with self._lock:
            job = _Job(task_id, work, self._generation)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name,
                                                daemon=True)
                self._thread.start()
        self._jobs.put(job)
        job.done.wait(self.wait_s)
        with self._lock:
            if job.report is not None:
                return job.report
            job.late = True
            self._open.add(task_id)
        return p.TaskReport(task_id=task_id, ok=False, pending=True)

    def finished(self) -> list[p.TaskReport]:
        """Reports of tasks that were pending and have ended since the last call."""
        with self._lock:
            done, self._late = self._late, []
            self._open.difference_update(r.task_id for r in done)
        return done

    def unreported(self) -> list[int]:
        """Task ids reported ``pending`` whose real report :meth:`finished` has not handed
        out yet (still running, or ended since its last call): what a node re-registering
        tells the master it still owes."""
        with self._lock:
            return list(self._open)

    def discard(self) -> None:
        """Forget the reports of every task given so far (the master dropped this node:
        they are moot); tasks already queued still run, in order, before any new one."""
        with self._lock:
            self._generation += 1
            self._late = []
            self._open.clear()

    def idle(self, timeout_s: float) -> bool:
        """Wait until every task given so far has ended (``False``: still busy after
        ``timeout_s``)."""
        marker = threading.Event()
        with self._lock:
            if self._thread is None:
                return True
        self._jobs.put(_Job(-1, lambda: _set(marker), self._generation))
        return marker.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread once the tasks queued have ended (waits up to ``timeout_s``)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                report = job.work()
            except Exception as exc:  # noqa: BLE001  # a bug in one must not end the rest
                _log.exception("%s: task %d failed", self.name, job.task_id)
                report = p.TaskReport(task_id=job.task_id, ok=False, error=f"{exc!r}")
            with self._lock:
                job.report = report
                if job.late and job.generation == self._generation and job.task_id >= 0:
                    self._late.append(report)
            job.done.set()


def _set(event: threading.Event) -> p.TaskReport:
    event.set()
    return p.TaskReport(task_id=-1, ok=True)
