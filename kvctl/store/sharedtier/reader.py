"""The client's side of the shared tier: read an object's file directly, verified.

A get whose answer names a shared-tier file and no DRAM location (or whose DRAM reads all
failed: the node just died) opens the file at the master's path mapped to this host's
mount, checks its header against the answer (key, size, checksum, version) and its bytes
against the checksum. Anything else is a miss (:class:`ObjectNotFoundError`, evicted):
never served.

A batched get reads its files together (:meth:`SharedReader.read_many`): with enough of
them, on a few threads (``open``, ``pread`` and the checksum release the GIL), so one master
round trip and the file reads of N keys overlap what one thread would do in turn. What is
read is always the version the master's answer names: there is no location cache here.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.sharedtier.config import map_path
from kvctl.store.sharedtier.fileformat import (
    SharedMissError,
    open_pack,
    read_entry,
    read_object,
    read_record,
)

#: Most threads a batch's files are read on (the caller's own included); more than the
#: cores pays only on a file system whose reads wait on the network.
MAX_THREADS = 8
#: Least work (seconds of reading) one thread's share of a batch must be: waking a pool
#: thread and handing the GIL back and forth costs up to ~0.1 ms on a virtual machine, so
#: 64 KiB files from the page cache (~15 us each) go to threads only by the hundred, 1 MiB
#: ones by the handful, and files on a network file system (a round trip per open) soon.
MIN_SHARE_S = 1e-3
#: How a batch's reading is estimated: in units of a file plus one per UNIT_BYTES of it,
#: at UNIT_S seconds a unit until batches have been timed (then what they took).
UNIT_BYTES = 64 << 10
UNIT_S = 10e-6

#: Most pack files one thread of a batch keeps open (its records are read with one open
#: per pack; a batch over more packs opens them again).
MAX_OPEN_PACKS = 16

Want = tuple[str, p.GetSlot, memoryview | None]
Got = bytes | int | KvctlError

#: every reader of this process, so that a forked child gets fresh locks (below)
_READERS: weakref.WeakSet[SharedReader] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A fork while another thread held a reader's lock (counting a read, starting the
    pool) left it held for good in the child, whose first get then hung."""
    for reader in list(_READERS):
        reader._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SharedReader:
    """Read shared-tier files named in get answers.

    Args:
        path_map: ``(master prefix, local prefix)`` pairs (where this host mounts the
            tier, when not at the master's path).
        threads: most threads a batch's files are read on (1: the caller's only);
            default this host's cores, at most :data:`MAX_THREADS`.
    """

    def __init__(self, path_map: tuple[tuple[str, str], ...] = (),
                 threads: int | None = None) -> None:
        self.path_map = path_map
        #: most threads one batch's files are read on (the caller's included)
        self.threads = max(1, threads if threads is not None
                           else min(MAX_THREADS, os.cpu_count() or 1))
        #: reads served / misses (torn, missing, mismatched files)
        self.reads = 0
        self.misses = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        #: set by :meth:`close`: batches read on their caller's thread from then on
        self._closed = False
        #: seconds a unit of reading takes (see UNIT_BYTES), as recent batches took it
        self._unit_s = UNIT_S
        self._lock = threading.Lock()
        _READERS.add(self)

    def read(self, key: str, slot: p.GetSlot, dest: memoryview | None) -> Got:
        """``slot``'s object: its bytes, or the size once in ``dest``; a miss as an error
        naming why (``key``: as the caller named it)."""
        got = self._read(key, slot, dest)
        with self._lock:
            if isinstance(got, KvctlError):
                self.misses += 1
            else:
                self.reads += 1
        return got

    def read_many(self, wanted: Sequence[Want]) -> list[Got]:
        """:meth:`read` of each ``(key, slot, dest)``, in order; split over up to
        :attr:`threads` threads (this one reads the first share) when each share is worth
        :data:`MIN_SHARE_S` of reading, judged by how long this reader's recent batches
        took (per file and per :data:`UNIT_BYTES`, so a batch of larger files splits
        sooner)."""
        n = len(wanted)
        if n <= 1:  # a single get: nothing to split, nothing to learn
            return [self.read(*wanted[0])] if n else []
        units = len(wanted) + sum(w[1].size for w in wanted) / UNIT_BYTES
        ways = max(1, min(self.threads, n, int(units * self._unit_s / MIN_SHARE_S)))
        bounds = [n * j // ways for j in range(ways + 1)]
        started = time.perf_counter()
        rest = [self._submit(wanted, bounds[j], bounds[j + 1]) for j in range(1, ways)]
        try:
            out = self._read_range(wanted, 0, bounds[1])
            for j, future in enumerate(rest, 1):
                out.extend(future.result() if future is not None
                           else self._read_range(wanted, bounds[j], bounds[j + 1]))
        except BaseException:  # no thread may still write into the caller's buffers
            wait([f for f in rest if f is not None and not f.cancel()])
            raise
        # Thread-seconds per unit. A batch on threads counts only when it lowers the
        # estimate: its time includes the threads' wake-ups and their contention for the
        # GIL, which would otherwise argue for threads on their own.
        took = (time.perf_counter() - started) * ways / units
        if ways == 1 or took < self._unit_s:
            self._unit_s = 0.7 * self._unit_s + 0.3 * took
        self._count(out)
        return out

    def close(self) -> None:
        """Stop the reading threads; a later batch (one racing the close of its client)
        reads on its caller's thread and starts none that nobody would stop."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            mine = self._pool_pid == os.getpid()
        if pool is not None and mine:  # (a forked child's copy has no threads to stop,
            pool.shutdown(wait=True)  # and its locks may have been copied held)

    def _submit(self, wanted: Sequence[Want], start: int, end: int
                ) -> Future[list[Got]] | None:
        """``wanted[start:end]`` handed to a reading thread, or ``None`` once the reader
        is closed (the caller reads that share itself)."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None or self._pool_pid != os.getpid():
                # Started on first use, and again in a forked child: the parent's threads
                # are not there, and a pool that believes it has idle ones would never run
                # the share (as many threads as :attr:`threads` then asks for besides the
                # caller's; a batch asking for more queues its shares).
                self._pool = ThreadPoolExecutor(max(1, self.threads - 1),
                                                thread_name_prefix="kvctl-shared-read")
                self._pool_pid = os.getpid()
            pool = self._pool
        try:
            return pool.submit(self._read_range, wanted, start, end)
        except RuntimeError:  # closed meanwhile (close() from another thread)
            return None

    def _read_range(self, wanted: Sequence[Want], start: int, end: int) -> list[Got]:
        packs: dict[str, int] = {}  # pack files this share has open: one open for its records
        try:
            return [self._read(*wanted[i], packs) for i in range(start, end)]
        finally:
            for fd in packs.values():
                os.close(fd)

    def _read(self, key: str, slot: p.GetSlot, dest: memoryview | None,
              packs: dict[str, int] | None = None) -> Got:
        path = map_path(slot.shared, self.path_map) if self.path_map else slot.shared
        try:
            if slot.shared_at >= 0:  # a record in a pack file
                view = dest if dest is None or dest.nbytes == slot.size else dest[:slot.size]
                if packs is None:
                    data = read_entry(path, slot.shared_at, slot.key, slot.version,
                                      slot.checksum, slot.size, view)
                    return slot.size if data is None else data
                fd = packs.get(slot.shared)
                if fd is None:
                    if len(packs) >= MAX_OPEN_PACKS:
                        for other in packs.values():
                            os.close(other)
                        packs.clear()
                    fd = packs[slot.shared] = open_pack(path, slot.key)
                data = read_record(fd, slot.shared_at, slot.key, slot.version, slot.checksum,
                                   slot.size, view)
                return slot.size if data is None else data
            if dest is None:
                data = read_object(path, slot.key, slot.version, slot.checksum, slot.size)
                assert data is not None
                return data
            read_object(path, slot.key, slot.version, slot.checksum, slot.size,
                        dest if dest.nbytes == slot.size else dest[:slot.size])
        except SharedMissError as exc:
            return ObjectNotFoundError(key, evicted=True, why=exc.cause.replace(
                repr(slot.key), "its copy"))
        return slot.size

    def _count(self, got: Sequence[Got]) -> None:
        misses = sum(isinstance(g, KvctlError) for g in got)
        with self._lock:
            self.reads += len(got) - misses
            self.misses += misses
