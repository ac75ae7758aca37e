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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.sharedtier.config import map_path
from kvctl.store.sharedtier.fileformat import SharedMissError, read_object

#: Most threads a batch's files are read on (the caller's own included); more than the
#: cores pays only on a file system whose reads wait on the network.
MAX_THREADS = 8
#: Fewest files, or bytes, that a batch reads on more than one thread: below this, handing
#: work to a thread costs more than it saves.
PARALLEL_FILES = 8
PARALLEL_BYTES = 1 << 20

Want = tuple[str, p.GetSlot, memoryview | None]
Got = bytes | int | KvctlError


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
        self._lock = threading.Lock()

    def read(self, key: str, slot: p.GetSlot, dest: memoryview | None) -> Got:
        """``slot``'s object: its bytes, or the size once in ``dest``; a miss as an error
        naming why (``key``: as the caller named it)."""
        got = self._read(key, slot, dest)
        self._count((got,))
        return got

    def read_many(self, wanted: Sequence[Want]) -> list[Got]:
        """:meth:`read` of each ``(key, slot, dest)``, in order; with at least
        :data:`PARALLEL_FILES` files or :data:`PARALLEL_BYTES` bytes, split over up to
        :attr:`threads` threads (this one reads the first share)."""
        n = len(wanted)
        ways = min(self.threads, n)
        if ways > 1 and n < PARALLEL_FILES and sum(w[1].size for w in wanted) < PARALLEL_BYTES:
            ways = 1
        if ways <= 1:
            out = [self._read(*w) for w in wanted]
        else:
            bounds = [n * j // ways for j in range(ways + 1)]
            pool = self._executor()
            rest = [pool.submit(self._read_range, wanted, bounds[j], bounds[j + 1])
                    for j in range(1, ways)]
            out = self._read_range(wanted, 0, bounds[1])
            for future in rest:
                out.extend(future.result())
        self._count(out)
        return out

    def close(self) -> None:
        """Stop the reading threads (a later batch starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        """The reading threads, started on first use (as many as :attr:`threads` then
        asked for besides the caller's; a batch asking for more queues its shares)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(1, self.threads - 1),
                                                thread_name_prefix="kvctl-shared-read")
            return self._pool

    def _read_range(self, wanted: Sequence[Want], start: int, end: int) -> list[Got]:
        return [self._read(*wanted[i]) for i in range(start, end)]

    def _read(self, key: str, slot: p.GetSlot, dest: memoryview | None) -> Got:
        path = map_path(slot.shared, self.path_map) if self.path_map else slot.shared
        try:
            if dest is None:
                data = read_object(path, slot.key, slot.version, slot.checksum, slot.size)
                assert data is not None
                return data
            read_object(path, slot.key, slot.version, slot.checksum, slot.size,
                        dest[:slot.size])
        except SharedMissError as exc:
            return ObjectNotFoundError(key, evicted=True, why=exc.cause.replace(
                repr(slot.key), "its copy"))
        return slot.size

    def _count(self, got: Sequence[Got]) -> None:
        misses = sum(isinstance(g, KvctlError) for g in got)
        with self._lock:
            self.reads += len(got) - misses
            self.misses += misses
