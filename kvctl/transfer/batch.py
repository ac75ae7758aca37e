"""Requests, batches and per-request status.

A :class:`Batch` has a fixed capacity of request slots. Each :meth:`TransferEngine.submit
<kvctl.transfer.engine.TransferEngine.submit>` fills the next slots; transports settle
requests slice by slice. A request is settled when its last slice finished: ``COMPLETED``
when every slice succeeded, otherwise ``FAILED`` or ``TIMEOUT`` with the first cause. The
per-request records are plain lists indexed by slot, so the hot path creates no objects per
request; :class:`RequestStatus` objects are built only when asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvctl.errors import UsageError
from kvctl.transfer.errors import BusyError, TransferTimeoutError

if TYPE_CHECKING:
    from kvctl.transfer.segments import LocalSegment


class OpCode(enum.Enum):
    """Direction of a request, seen from the initiator."""

    READ = "read"  # target segment → local buffer
    WRITE = "write"  # local buffer → target segment


class TransferState(enum.Enum):
    """Where a request stands."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"


_PENDING, _COMPLETED, _FAILED, _TIMEOUT = 0, 1, 2, 3
#: ``failure`` values for :meth:`Batch.settle` (used by transports).
SETTLE_FAILED = _FAILED
SETTLE_TIMEOUT = _TIMEOUT
_STATES = (TransferState.PENDING, TransferState.COMPLETED, TransferState.FAILED,
           TransferState.TIMEOUT)


@dataclasses.dataclass(frozen=True, slots=True)
class TransferRequest:
    """One READ or WRITE between a local segment and a target segment.

    Attributes:
        op: :class:`OpCode` (READ pulls from the target, WRITE pushes to it).
        local_segment: name of a segment registered in this engine.
        local_offset: byte offset in the local segment's address space.
        target_segment: name of the (usually remote) segment.
        target_offset: byte offset in the target segment's address space.
        length: bytes to move (> 0); the range must lie inside one buffer on each side.
    """

    op: OpCode
    local_segment: str
    local_offset: int
    target_segment: str
    target_offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class RequestStatus:
    """Status of one request of a batch.

    Attributes:
        index: slot in the batch (submission order).
        state: PENDING, COMPLETED, FAILED or TIMEOUT.
        transport: transport that moved (or tried to move) it: ``shm``, ``tcp``, ``rdma``.
        path: path(s) used, e.g. ``127.0.0.1->127.0.0.1:4001#2`` (comma-joined if sliced).
        cause: why it failed or timed out; ``None`` otherwise.
        length: request length in bytes.
    """

    index: int
    state: TransferState
    transport: str
    path: str
    cause: str | None
    length: int


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """Summary of a settled batch.

    Attributes:
        total: requests submitted.
        completed / failed / timed_out: counts by final state.
        bytes_moved: sum of the lengths of completed requests.
        first_cause: cause of the first failed or timed-out request, if any.
        retries: slices (frames) retried on another path after a failure, over the whole
            batch; a batch that completed with retries > 0 hit a broken path.
    """

    total: int
    completed: int
    failed: int
    timed_out: int
    bytes_moved: int
    first_cause: str | None
    retries: int = 0

    @property
    def ok(self) -> bool:
        """Every request completed."""
        return self.completed == self.total


class _Group:
    """One submission: how many of its requests are pending, and what to call at the end."""

    __slots__ = ("ok", "on_done", "pending")

    def __init__(self, pending: int, on_done: Callable[[bool], None] | None) -> None:
        self.pending = pending
        self.ok = True
        self.on_done = on_done


class Batch:
    """A set of request slots submitted and waited on together.

    Create with :meth:`TransferEngine.allocate_batch`; release with ``free_batch``.
    Thread-safe: transports settle slices from their worker threads.
    """

    def __init__(self, capacity: int, owner: object) -> None:
        if capacity <= 0:
            raise UsageError(f"batch capacity {capacity} is not positive",
                             "allocate a batch with capacity >= 1")
        self.capacity = capacity
        self._owner = owner
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._submit_lock = threading.Lock()
        self._count = 0
        self._pending = 0
        self._state = bytearray(capacity)
        self._bad = bytearray(capacity)
        self._left = [0] * capacity
        self._length = [0] * capacity
        self._transport = [""] * capacity
        self._path = [""] * capacity
        self._cause: list[str | None] = [None] * capacity
        self._local: list[LocalSegment | None] = [None] * capacity
        self._group = [0] * capacity
        self._groups: dict[int, _Group] = {}
        self._next_group = 0
        self._holds = 0  # completion callbacks (notifications) still running
        self._retries = 0
        self.freed = False
        #: Causes of notifications that could not be delivered, in order.
        self.notify_errors: list[str] = []

    def __repr__(self) -> str:
        return f"Batch(capacity={self.capacity}, submitted={self._count}, pending={self._pending})"

    @property
    def submitted(self) -> int:
        """Requests submitted so far."""
        return self._count

    @property
    def pending(self) -> int:
        """Requests not settled yet."""
        return self._pending

    @property
    def retries(self) -> int:
        """Slices (frames) retried on another path so far."""
        return self._retries

    def add_retries(self, count: int) -> None:
        """Transport side: ``count`` slices (frames) of this batch are being retried."""
        with self._lock:
            self._retries += count

    # -- engine side ------------------------------------------------------------------

    def _reserve(self, lengths: list[int], slices: list[int], local: list[LocalSegment],
                 transports: list[str], on_done: Callable[[bool], None] | None) -> int:
        """Claim slots for a submission; returns the first slot index."""
        n = len(lengths)
        with self._lock:
            if self.freed:
                raise UsageError("batch was freed", "allocate a new batch")
            if self._count + n > self.capacity:
                raise UsageError(
                    f"batch of capacity {self.capacity} has {self.capacity - self._count} free "
                    f"slot(s), {n} request(s) submitted",
                    "allocate a larger batch or submit to a new one",
                )
            start = self._count
            gid = self._next_group
            self._next_group += 1
            self._groups[gid] = _Group(n, on_done)
            end = start + n
            self._length[start:end] = lengths
            self._left[start:end] = slices
            self._local[start:end] = local
            self._transport[start:end] = transports
            self._group[start:end] = [gid] * n
            self._count = end
            self._pending += n
        return start

    def settle(self, indices: list[int], *, path: str, failure: int = _PENDING,
               cause: str | None = None) -> None:
        """Transport side: finish one slice of each request in ``indices``.

        ``failure`` is 0 for success, :data:`SETTLE_FAILED` or :data:`SETTLE_TIMEOUT` with a
        ``cause``; ``path`` names the path that moved (or failed to move) the slice.
        """
        callbacks: list[tuple[Callable[[bool], None], bool]] = []
        released: dict[LocalSegment, int] = {}
        with self._lock:
            paths, bad, left = self._path, self._bad, self._left
            finished: list[int] = []
            for i in indices:
                known = paths[i]
                if known != path:
                    if not known:
                        paths[i] = path
                    elif path not in known.split(","):
                        paths[i] = f"{known},{path}"
                if failure and not bad[i]:
                    bad[i] = failure
                    self._cause[i] = cause
                n = left[i] - 1
                left[i] = n
                if not n:
                    finished.append(i)
            if finished:
                self._pending -= len(finished)
                state, local, group_of = self._state, self._local, self._group
                done_per_group: dict[int, int] = {}
                for i in finished:
                    failed = bad[i]
                    state[i] = failed or _COMPLETED
                    seg = local[i]
                    if seg is not None:
                        released[seg] = released.get(seg, 0) + 1
                        local[i] = None
                    gid = group_of[i]
                    done_per_group[gid] = done_per_group.get(gid, 0) + 1
                    if failed:
                        self._groups[gid].ok = False
                for gid, count in done_per_group.items():
                    group = self._groups[gid]
                    group.pending -= count
                    if group.pending == 0:
                        del self._groups[gid]
                        if group.on_done is not None:
                            callbacks.append((group.on_done, group.ok))
            self._holds += len(callbacks)
            if self._pending == 0 and not self._holds:
                self._cond.notify_all()
        for seg, count in released.items():
            seg.release(count)
        for callback, ok in callbacks:
            try:
                callback(ok)
            finally:
                with self._lock:
                    self._holds -= 1
                    if self._pending == 0 and not self._holds:
                        self._cond.notify_all()

    # -- user side --------------------------------------------------------------------

    def wait(self, timeout_s: float | None = None) -> BatchResult:
        """Block until every submitted request is settled; see TransferEngine.wait."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._holds:
                if deadline is None:
                    self._cond.wait(1.0)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(
                        f"{self._pending} of {self._count} request(s) still pending after "
                        f"{timeout_s:g} s",
                        "wait again, or check the target with 'kvctl segment show'",
                    )
                self._cond.wait(left)
            return self._summary()

    def _summary(self) -> BatchResult:
        completed = failed = timed_out = moved = 0
        first: str | None = None
        for i in range(self._count):
            state = self._state[i]
            if state == _COMPLETED:
                completed += 1
                moved += self._length[i]
            elif state in (_FAILED, _TIMEOUT):
                if state == _FAILED:
                    failed += 1
                else:
                    timed_out += 1
                if first is None:
                    first = self._cause[i]
        return BatchResult(self._count, completed, failed, timed_out, moved, first,
                           self._retries)

    def statuses(self) -> list[RequestStatus]:
        """Per-request status, in submission order."""
        with self._lock:
            return [
                RequestStatus(i, _STATES[self._state[i]], self._transport[i], self._path[i],
                              self._cause[i], self._length[i])
                for i in range(self._count)
            ]

    def _check_free(self) -> None:
        with self._lock:
            if self._pending or self._holds:
                raise BusyError(
                    f"batch has {self._pending} request(s) in flight",
                    "wait for the batch (engine.wait) before freeing it",
                )
            self.freed = True

