"""The shared tier's tables, and the master's file-system work on it: deleting files that
left the index and a bounded purge sweep for files no index names.

Everything here that touches the file system runs **without** the master's lock: the
master takes the lock only to pick what is due and to ask its index whether a file is
still named, a batch at a time.

The sweep walks the tier's 256 subdirectories ``sweep_batch`` entries per housekeeping
pass (the master's tick, every 0.1 s), starting a new walk ``sweep_interval_s`` after the
last one began. A file is an orphan when the index does not name its key at its version
with a shared copy (a master killed between a node's rename and its journal write, a lost
index, a write whose object went meanwhile) and it is older than ``orphan_grace_s`` (a
write whose report is on its way is not one); a temporary file older than that is a write
that died. Files without a valid header are orphans too. Both are deleted.

A file that leaves the index (evicted by the quota, removed, replaced, found bad) is
deleted only once the state change that stops naming it is durable (journal synced, etcd
took it): a master killed in between would otherwise restart on an index naming a file
that is gone. Deletes whose change is not durable yet (etcd stalled) wait for a later pass.

A file's name follows from its key and version, so a copy written again (an object that
left the tier while still in DRAM, evicted from DRAM since) has the name of the one whose
delete may be waiting: a write claims its name first (:meth:`SharedState.claim`), which
cancels a delete still waiting, and is refused while one is under way.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.store import protocol as p
from kvctl.store.master.records import Node, Obj
from kvctl.store.sharedtier.config import SharedTierConfig
from kvctl.store.sharedtier.fileformat import (
    COUNTED_ERRNOS,
    NAME_RE,
    PACK_DIR,
    PACK_NAME_RE,
    errno_name,
    file_bytes,
    read_header,
)
from kvctl.store.sharedtier.packs import AT_BITS
from kvctl.store.sharedtier.reports import BadFileReports

if TYPE_CHECKING:
    from kvctl.store.sharedtier.mixin import SharedTierMixin
    from kvctl.store.sharedtier.packs import Pack

_log = logging.getLogger("kvctl.store.sharedtier")

#: Most deletes one housekeeping pass makes.
UNLINK_BATCH = 512
#: Seconds between two ``statvfs`` of the tier.
STATVFS_EVERY_S = 5.0
#: Seconds a housekeeping pass waits for the state changes its deletes follow.
DURABLE_WAIT_S = 0.05
#: Seconds before deletes whose state change was not durable are tried again.
DURABLE_RETRY_S = 0.5
#: About how many distinct use stamps the tier's copies have: copies stamped in a row
#: share one (one int object for all of them: 32 bytes per copy less in a large tier), so
#: the restored LRU order is exact to 1/STAMP_BUCKETS of the tier.
STAMP_BUCKETS = 1024


class SharedState:
    """The shared tier's tables (the master's lock guards them)."""

    def __init__(self, config: SharedTierConfig) -> None:
        self.config = config
        #: ``config.root`` as a string ending in ``/``: answers name files by joining it
        #: (a pathlib join per key was half the master's per-key cost of a get)
        self.prefix = str(config.root).rstrip("/") + "/"
        #: objects with a shared copy, least recently used first (a plain dict, as the
        #: nodes' LRU maps: strings and gc=False records only).
        self.lru: dict[str, Obj] = {}
        self.used_bytes = 0
        self.files = 0
        self.writes = 0
        self.write_errors = 0
        self.evictions = 0
        self.purged = 0
        #: write-through copies skipped (too many queued on the node)
        self.skipped = 0
        self.errors: dict[str, int] = dict.fromkeys((*COUNTED_ERRNOS, "other"), 0)
        self.last_error = ""
        self.full_until = 0.0
        #: write-through copies queued or running per node: (count, bytes)
        self.queued: dict[Node, tuple[int, int]] = {}
        #: key -> (object, node, task id) of its write-through copy in flight
        self.writing: dict[str, tuple[Obj, Node, int]] = {}
        #: heap of (due, seq, path, key): files to delete once due (after a lease) and
        #: once the state change of ``key`` that stopped naming them is durable; an entry
        #: counts only while ``_doomed[path]`` is its seq (a write's claim cancels it)
        self._unlinks: list[tuple[float, int, str, str | tuple[str, ...]]] = []
        self._doomed: dict[str, int] = {}
        #: files being deleted now (taken off the heap, or found orphaned): no write may
        #: rename a new copy into their names until that is done
        self.deleting: set[str] = set()
        self._seq = itertools.count()
        self.fs_free_bytes = -1
        self.fs_total_bytes = -1
        # file-system side (housekeeping thread only)
        self.busy = threading.Lock()
        self.walk: Iterator[os.DirEntry[str]] | None = None
        self.next_sweep = 0.0
        self.next_statvfs = 0.0
        self.orphans_found = 0
        #: files clients reported bad, checked by a thread of their own
        self.reports = BadFileReports()
        #: the current use stamp (``Obj.shared``; see the mixin) and how many copies took
        #: it; 1 is what records of older kvctl versions hold
        self.stamp = 2
        self._in_bucket = 0
        self._restamp_tokens = 0.0
        self._restamp_at = 0.0
        #: pack id -> pack (being written, or landed with live entries)
        self.packs: dict[int, Pack] = {}
        #: node -> the pack being gathered for its next heartbeat
        self.open_packs: dict[Node, Pack] = {}
        #: landed packs (counted in ``files``) and the copies they hold
        self.pack_files = 0
        self.packed = 0
        #: the id the next pack gets (past any the state names, and this run's start
        #: time, so that a pack of a master killed before its record is seldom reused)
        self.next_pack = int(time.time())

    # ---- index side (lock held)

    def track(self, obj: Obj, nbytes: int, files: int = 1) -> None:
        """``obj``'s copy is in the tier (a packed one: ``nbytes`` and ``files`` 0, its
        pack counts them)."""
        self.lru[obj.key] = obj
        self.used_bytes += nbytes
        self.files += files

    def untrack(self, obj: Obj, nbytes: int, files: int = 1) -> None:
        if self.lru.get(obj.key) is obj:
            del self.lru[obj.key]
        self.used_bytes -= nbytes
        self.files -= files

    def through_landed(self, key: str, task_id: int, node: Node) -> bool:
        """Task ``task_id`` wrote (or failed) ``key``'s write-through copy: it is no
        longer being written; whether an eviction of it on ``node`` waits for it (then
        its DRAM is freed now)."""
        through = self.writing.get(key)
        if through is None or through[2] != task_id:
            return False
        del self.writing[key]
        evicting = through[0].evicting
        return evicting is not None and evicting.get(node) == task_id

    def new_pack_id(self) -> int:
        pack_id = self.next_pack
        self.next_pack += 1
        return pack_id

    def fits(self, obj: Obj) -> bool:
        return file_bytes(obj.key, obj.size) <= self.config.capacity_bytes

    def paused(self, now: float) -> bool:
        """Writes are paused: the file system refused one for lack of space lately."""
        return now < self.full_until

    def over_quota(self) -> bool:
        return (self.used_bytes > self.config.capacity_bytes
                or self.files > self.config.max_files)

    def oldest(self, newest: Obj | None) -> Obj | None:
        """The least recently used copy, never ``newest`` nor one in ``newest``'s pack."""
        pack = newest.pack >> AT_BITS if newest is not None and newest.pack else -1
        for obj in self.lru.values():
            if obj is not newest and (pack < 0 or obj.pack >> AT_BITS != pack):
                return obj
        return None

    def note_write(self, report: p.TaskReport, now: float) -> None:
        if report.ok:
            self.writes += 1
            self.full_until = 0.0
            return
        self.write_errors += 1
        self.count_error(report.error.split(":", 1)[0], report.error)
        if report.full:
            if not self.paused(now):
                _log.warning("shared tier full (%s): writes paused for %.0f s", report.error,
                             self.config.full_retry_s)
            self.full_until = now + self.config.full_retry_s

    def count_error(self, name: str, text: str) -> None:
        key = name if name in COUNTED_ERRNOS or name == "unmounted" else "other"
        self.errors[key] = self.errors.get(key, 0) + 1
        self.last_error = text

    def unlink_later(self, path: str, due: float, key: str | tuple[str, ...] = "") -> None:
        """Delete ``path`` once ``due`` and once the state change of ``key`` made so far
        (the one that stopped naming the file; a pack's: those of its keys) is durable."""
        seq = next(self._seq)
        self._doomed[path] = seq
        heapq.heappush(self._unlinks, (due, seq, path, key))

    def take_due(self, now: float, limit: int) -> list[tuple[str, str | tuple[str, ...]]]:
        """Deletes that are due, as ``(path, key)``; their paths are :attr:`deleting` until
        :meth:`deleted` (or :meth:`unlink_later` again)."""
        out: list[tuple[str, str | tuple[str, ...]]] = []
        heap = self._unlinks
        while heap and heap[0][0] <= now and len(out) < limit:
            _, seq, path, key = heapq.heappop(heap)
            if self._doomed.get(path) != seq:
                continue  # cancelled by a write, or queued again later
            del self._doomed[path]
            self.deleting.add(path)
            out.append((path, key))
        return out

    def deleted(self, paths: list[str]) -> None:
        """The deletes of ``paths`` are over (done or given up)."""
        self.deleting.difference_update(paths)

    def claim(self, path: str) -> bool:
        """A copy is about to be written at ``path``: cancel its waiting delete; ``False``
        (write nothing) while one is under way."""
        if path in self.deleting:
            return False
        self._doomed.pop(path, None)
        return True

    def next_stamp(self) -> int:
        """A use stamp for a copy landing (or used) now: the current one, shared by
        ``copies // STAMP_BUCKETS`` copies in a row (at least 1)."""
        if self._in_bucket >= self._bucket():
            self.stamp += 1
            self._in_bucket = 0
        self._in_bucket += 1
        return self.stamp

    def stamp_age(self, stamp: int) -> int:
        """About how many copies were stamped after ``stamp``."""
        return (self.stamp - stamp) * self._bucket()

    def _bucket(self) -> int:
        # copies, not files (a pack file holds many; every file holds at least one)
        return max(1, max(self.files, len(self.lru)) // STAMP_BUCKETS)

    def may_restamp(self, now: float, per_s: float) -> bool:
        """Whether a use stamp may be written into a record now (a token bucket of
        ``per_s`` a second, as many in a burst)."""
        tokens = min(per_s, self._restamp_tokens + (now - self._restamp_at) * per_s)
        self._restamp_at = now
        if tokens < 1.0:
            self._restamp_tokens = tokens
            return False
        self._restamp_tokens = tokens - 1.0
        return True

    def backlog(self) -> int:
        """Files waiting to be deleted."""
        return len(self._doomed)


def housekeeping(core: SharedTierMixin, st: SharedState) -> None:
    """One pass: due deletes, a slice of the sweep, now and then a ``statvfs``."""
    if not st.busy.acquire(blocking=False):
        return  # another thread is at it
    try:
        if not core._shared_may_delete():
            return  # deposed: the files are the new leader's now (the deletes stay queued)
        with core._lock:
            due = st.take_due(core._clock(), UNLINK_BATCH)
        taken = [path for path, _ in due]
        orphans: list[str] = []
        try:
            if due and not _durable(core, [key for _, key in due]):
                with core._lock:  # the index change is not on record yet: the file stays
                    retry = core._clock() + DURABLE_RETRY_S
                    st.deleted(taken)
                    for path, key in due:
                        st.unlink_later(path, retry, key)
                due, taken = [], []
            deleted, failures = _unlink_all(taken)
            wall = time.monotonic()
            if st.walk is not None or wall >= st.next_sweep:
                orphans = _sweep_slice(core, st, wall)
            if orphans and not core._shared_may_delete():
                return  # deposed while sweeping: its index may not name the new leader's
            purged, more_failures = _unlink_all(orphans)
        finally:
            if taken or orphans:
                with core._lock:
                    st.deleted([*taken, *orphans])
        if wall >= st.next_statvfs:
            st.next_statvfs = wall + STATVFS_EVERY_S
            try:
                vfs = os.statvfs(st.config.root)
                free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
            except OSError as exc:
                more_failures.append((errno_name(exc), f"statvfs {st.config.root}: {exc}"))
                free = total = -1
        else:
            free, total = st.fs_free_bytes, st.fs_total_bytes
        with core._lock:
            st.purged += deleted + purged
            st.orphans_found += len(orphans)
            st.fs_free_bytes, st.fs_total_bytes = free, total
            for name, text in (*failures, *more_failures):
                st.count_error(name, text)
        if orphans:
            _log.info("shared tier: purged %d orphan files", purged)
    finally:
        st.busy.release()


def _durable(core: SharedTierMixin, keys: list[str | tuple[str, ...]]) -> bool:
    """Whether every state change made so far to ``keys`` is durable (waits a little,
    without the master's lock)."""
    state = core.state
    flat = (k for item in keys for k in ((item,) if isinstance(item, str) else item))
    for key in dict.fromkeys(flat):
        if key:
            state.wait_for_key(key)
    return state.ack(timeout_s=DURABLE_WAIT_S) is None


def _unlink_all(paths: list[str]) -> tuple[int, list[tuple[str, str]]]:
    done = 0
    failures: list[tuple[str, str]] = []
    for path in paths:
        try:
            Path(path).unlink()
            done += 1
        except FileNotFoundError:
            continue
        except OSError as exc:
            failures.append((errno_name(exc), f"delete {path}: {exc.strerror or exc}"))
    return done, failures


def _walk(root: str) -> Iterator[os.DirEntry[str]]:
    """Every entry of the tier's subdirectories (``xx/``), lazily."""
    with os.scandir(root) as top:
        subdirs = sorted(e.path for e in top if len(e.name) == 2 and e.is_dir(
            follow_symlinks=False))
    for sub in subdirs:
        with contextlib.suppress(FileNotFoundError), os.scandir(sub) as entries:
            yield from entries


def _sweep_slice(core: SharedTierMixin, st: SharedState, wall: float) -> list[str]:
    """Examine up to ``sweep_batch`` entries; the orphans among them (lock taken once)."""
    cfg = st.config
    if st.walk is None:
        st.walk = _walk(str(cfg.root))
        st.next_sweep = wall + cfg.sweep_interval_s
    now = time.time()
    orphans: list[str] = []
    named: list[tuple[str, str, int]] = []
    packs: list[tuple[str, int]] = []
    try:
        for _ in range(cfg.sweep_batch):
            entry = next(st.walk, None)
            if entry is None:
                st.walk = None
                break
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if age < cfg.orphan_grace_s:
                continue
            name = entry.name
            if name.startswith(".") and name.endswith(".tmp"):
                orphans.append(entry.path)  # a write that died before its rename
                continue
            match = NAME_RE.match(name)
            if match is None:
                match = PACK_NAME_RE.match(name)
                if match is not None and Path(entry.path).parent.name == PACK_DIR:
                    packs.append((entry.path, int(match.group(1), 16)))
                continue  # else not ours: left alone
            header = read_header(entry.path)
            if header is None or header[1] != int(match.group(2), 16):
                orphans.append(entry.path)
                continue
            named.append((entry.path, header[0], header[1]))
    except OSError as exc:  # the directory went stale under us: start again next time
        st.walk = None
        with core._lock:
            st.count_error(errno_name(exc), f"sweep of {cfg.root}: {exc.strerror or exc}")
    if named or orphans or packs:
        with core._lock:
            orphans.extend(path for path, key, version in named
                           if not core._shared_current(key, version))
            orphans.extend(path for path, pack_id in packs if pack_id not in st.packs)
            # a file whose delete is queued waits for it (its readers' leases, the state
            # change that dropped it being durable): it is no orphan to delete now
            orphans = [path for path in orphans if path not in st._doomed]
            st.deleting.update(orphans)  # no write renames a copy into them until gone
    return orphans
