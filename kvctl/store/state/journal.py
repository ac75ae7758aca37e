"""``--state DIR``: an append-only journal of msgpack records plus snapshots.

Files in ``DIR`` (created ``0700``, files ``0600``):

- ``journal-<gen>.log``: length-prefixed records (:data:`~kvctl.store.state.base.JournalEntry`),
  one segment per master run and per snapshot; a torn last record (a crash mid-write) is
  ignored;
- ``snapshot-<gen>.msgpack``: the same records, nodes first, written *from the master's
  live view* a slice of keys at a time (the lock is released between slices) while changes
  go on into ``journal-<gen>.log``. Each key is captured at some moment after the segment
  began, so replaying that segment over the snapshot gives exactly the state at the end:
  a fuzzy checkpoint. Snapshot ``G`` (fsync'ed, then renamed into place) makes every file
  of a lower generation obsolete; they are deleted then.

A restart replays the newest snapshot and every journal segment from its generation on,
in order (``snapshot.msgpack`` + ``journal.log`` of older kvctl versions first, if present).

No copy of the state is kept in memory besides the master's own tables: changes are
encoded into a buffer with the master's lock held and written to the OS at the next
housekeeping pass, or when the request that made them is acknowledged
(:meth:`JournalState.ack`, outside the lock), which also waits for ``fdatasync``: nothing
acknowledged is lost to a killed master process or to a host crash. Acknowledgements
share their writes and syncs (a group commit: whoever syncs takes every change buffered
until then, the others find theirs done).

A write the file system refuses (a full disk) fails the acknowledgements of the changes it
carried, and the journal stops taking writes (:meth:`JournalState.refusal`: the master
refuses new puts and says why) until a snapshot has been written again, tried once a
second: a snapshot of the live state needs no journal before it. A snapshot never takes
the last :data:`SNAPSHOT_RESERVE_BYTES` of its file system (it is abandoned first, and
tried again a second later): on a disk with room for records but not a snapshot the
journal goes on taking puts, and the snapshot completes by itself once space returns.
Segment switches happen under the same lock as the writes of acknowledgements.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from kvctl.errors import UsageError
from kvctl.store.state.base import (
    DeleteNode,
    DeleteObject,
    JournalEntry,
    LoadedState,
    NodeRecord,
    ObjectRecord,
    Snapshot,
    StateBackend,
    register_state,
)

_log = logging.getLogger("kvctl.store.state")

_LEN = struct.Struct("<I")
_SEGMENT = re.compile(r"^(journal|snapshot)-(\d{8})\.(log|msgpack|tmp)$")
#: Seconds between attempts to write again after the file system refused a write (and
#: between attempts at a snapshot that failed).
RETRY_S = 1.0
#: Free bytes a snapshot leaves on its file system for the journal: it is abandoned rather
#: than written into them (a snapshot that filled the disk made the journal's appends fail,
#: so a compaction that did not fit stopped every put).
SNAPSHOT_RESERVE_BYTES = 256 << 10


def _frames(path: Path) -> Iterator[JournalEntry]:
    """The records of one journal or snapshot file; stops at a torn last record."""
    data = path.read_bytes()
    decoder = msgspec.msgpack.Decoder(JournalEntry)
    view = memoryview(data)
    pos = 0
    while pos + _LEN.size <= len(data):
        (length,) = _LEN.unpack_from(data, pos)
        end = pos + _LEN.size + length
        if end > len(data):
            break
        try:
            entry = decoder.decode(view[pos + _LEN.size:end])
        except (msgspec.DecodeError, msgspec.ValidationError):
            break
        yield entry
        pos = end
    if pos != len(data):
        _log.warning("master journal %s: ignoring a torn record at byte %d", path, pos)


def _open_private(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        done = os.write(fd, view)
        view = view[done:]


@register_state("file")
def _open_journal(spec: str, cluster_id: str, token: str | None) -> StateBackend:
    """``file:///DIR``: the journal in ``DIR`` (a bare ``DIR`` is one too, see
    :func:`~kvctl.store.state.open_state`)."""
    return JournalState(Path(spec[len("file://"):]))


class JournalState(StateBackend):
    """Journal segments + snapshots in ``directory`` (one master at a time).

    Args:
        directory: created (``0700``) if missing.
        compact_min_records: snapshot once the journals since the last snapshot hold this
            many records and more than twice as many as there are live objects.
    """

    def __init__(self, directory: Path, *, compact_min_records: int = 50_000,
                 snapshot_reserve_bytes: int = SNAPSHOT_RESERVE_BYTES) -> None:
        self.directory = directory
        self.description = f"journal {directory}"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create master state directory {directory}: {exc}",
                             "pick a writable --state directory") from exc
        self._compact_min = compact_min_records
        self.snapshot_reserve_bytes = snapshot_reserve_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._buf = bytearray()
        self._buf_lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._local = threading.local()
        #: changes taken / written to the OS / on disk (fdatasync'ed)
        self._seq = 0
        self._written = 0
        self._synced = 0
        #: why writes stopped (a refused write), or None
        self._failed: str | None = None
        #: changes not written (the journal was stopped), first and last; a snapshot
        #: started after them makes them durable
        self._dropped: tuple[int, int] | None = None
        self._failures = 0
        self._retry_at = 0.0
        #: records in the journals since the base snapshot
        self._records = 0
        self._snapshot_running = False
        self._records_at_snapshot = 0
        self._closed = False
        snapshots: dict[int, Path] = {}
        journals: dict[int, Path] = {}
        for entry in directory.iterdir():
            m = _SEGMENT.match(entry.name)
            if m is None or m.group(3) == "tmp":
                continue
            (snapshots if m.group(1) == "snapshot" else journals)[int(m.group(2))] = entry
        self._base = max(snapshots) if snapshots else None
        self._base_path = snapshots.get(self._base) if self._base is not None else None
        start = self._base if self._base is not None else 0
        self._replay_journals = [journals[g] for g in sorted(journals) if g >= start]
        self._legacy = [p for p in (directory / "snapshot.msgpack", directory / "journal.log")
                        if self._base is None and p.exists()]
        self._gen = max([*snapshots, *journals, 0]) + 1
        self._fd: int | None = None
        self._open_segment(self._gen)

    # ------------------------------------------------------------------ files

    def _segment(self, kind: str, gen: int) -> Path:
        ext = "log" if kind == "journal" else "msgpack"
        return self.directory / f"{kind}-{gen:08d}.{ext}"

    def _open_segment(self, gen: int) -> None:
        path = self._segment("journal", gen)
        try:
            fd = _open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        except OSError as exc:
            hint = ("free space on that disk (the journal needs room for its next segment), "
                    "or pick another --state directory" if exc.errno == errno.ENOSPC else
                    "free space or pick a writable --state directory")
            raise UsageError(f"cannot write master journal {path}: {exc.strerror or exc}",
                             hint) from exc
        old, self._fd = self._fd, None
        if old is not None:
            self._sync_closing(old)
        self._fd = fd
        self._gen = gen

    def _sync_closing(self, fd: int) -> None:
        """Close the previous segment once what it holds is on disk (acknowledgements wait
        for that; the new segment is synced from here on)."""
        try:
            os.fdatasync(fd)
        except OSError as exc:
            self._fail(f"sync of master journal failed: {exc.strerror or exc}")
            self._mark_dropped(self._synced + 1, self._written)
        else:
            self._synced = self._written
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def replay(self) -> Iterator[JournalEntry]:
        for path in self._legacy:
            if path.name == "snapshot.msgpack":
                try:
                    loaded = msgspec.msgpack.decode(path.read_bytes(), type=LoadedState)
                except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise UsageError(f"master state snapshot {path} is unreadable: {exc}",
                                     "restore it from a backup or start with an empty "
                                     "--state") from exc
                yield from loaded.nodes
                yield from loaded.objects
            else:
                for entry in _frames(path):
                    self._records += 1
                    yield entry
        if self._base_path is not None:
            try:
                yield from _frames(self._base_path)
            except OSError as exc:
                raise UsageError(f"master state snapshot {self._base_path} is unreadable: "
                                 f"{exc}", "restore it from a backup or start with an empty "
                                 "--state") from exc
        for path in self._replay_journals:
            for entry in _frames(path):
                self._records += 1
                yield entry

    # ------------------------------------------------------------------ changes

    def _append(self, entry: JournalEntry) -> None:
        payload = self._encoder.encode(entry)
        with self._buf_lock:
            self._buf += _LEN.pack(len(payload))
            self._buf += payload
            self._seq += 1
            self._local.seq = self._seq
            self._records += 1

    def put_object(self, record: ObjectRecord) -> None:
        self._append(record)

    def delete_object(self, key: str) -> None:
        self._append(DeleteObject(key))

    def put_node(self, record: NodeRecord) -> None:
        self._append(record)

    def delete_node(self, node_id: str) -> None:
        self._append(DeleteNode(node_id))

    def _flush(self, *, sync: bool = False) -> None:
        """Write the buffered records to the OS, in order, and with ``sync`` to the disk
        (callers hold no master lock except :meth:`start_snapshot`)."""
        with self._io_lock:
            self._flush_locked(sync=sync)

    def _flush_locked(self, *, sync: bool = False) -> None:
        """:meth:`_flush` with ``_io_lock`` held: the segment's descriptor changes only
        under that lock (a switch to a new segment racing an acknowledgement's write once
        wrote journal records through a closed descriptor, or whatever file reused its
        number)."""
        with self._buf_lock:
            data, self._buf = self._buf, bytearray()
            upto = self._seq
        fd = self._fd
        if data:
            if fd is None:  # stopped by a refused write: a snapshot takes them
                self._mark_dropped(self._synced + 1, upto)
                return
            try:
                _write_all(fd, data)
            except OSError as exc:
                self._fail(f"write to master journal "
                           f"{self._segment('journal', self._gen)} failed: "
                           f"{exc.strerror or exc}")
                self._mark_dropped(self._synced + 1, upto)
                return
            self._written = upto
        if not sync or self._synced >= self._written or fd is None:
            return
        try:
            os.fdatasync(fd)
        except OSError as exc:
            self._fail(f"sync of master journal {self._segment('journal', self._gen)} "
                       f"failed: {exc.strerror or exc}")
            self._mark_dropped(self._synced + 1, self._written)
            return
        self._synced = self._written

    def _mark_dropped(self, first: int, last: int) -> None:
        """Changes ``first``..``last`` are not on disk (a snapshot started later takes
        them); the range grows from the oldest such change."""
        if first > last:
            return
        self._dropped = (first if self._dropped is None else self._dropped[0], last)

    def _fail(self, cause: str) -> None:
        if self._failed is None:
            _log.error("master state: %s; refusing new puts until a snapshot can be written",
                       cause)
        self._failed = cause
        self._failures += 1
        self._retry_at = time.monotonic() + RETRY_S
        if self._fd is not None:  # it may end in a torn record: never append to it again
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def ack(self, timeout_s: float | None = None) -> str | None:
        seq = getattr(self._local, "seq", 0)
        self._local.seq = 0
        if seq > self._synced:
            self._flush(sync=True)
        dropped = self._dropped
        if seq <= self._synced and (dropped is None or not dropped[0] <= seq <= dropped[1]):
            return None
        return (f"master state {self.directory}: the change was not written "
                f"({self._failed or 'the journal was stopped by an earlier failure'})")

    def wait_for_key(self, key: str) -> None:
        # No per-key bookkeeping: the acknowledgement waits for every change taken so far.
        with self._buf_lock:
            self._local.seq = max(getattr(self._local, "seq", 0), self._seq)

    def refusal(self) -> str | None:
        if self._failed is None:
            return None
        return f"master state {self.directory} takes no writes: {self._failed}"

    def sync(self) -> None:
        self._flush()

    @property
    def backlog(self) -> int:
        return self._seq - self._written

    # ------------------------------------------------------------------ snapshots

    def snapshot_wanted(self, live_objects: int) -> bool:
        if self._snapshot_running or self._closed:
            return False
        if time.monotonic() < self._retry_at:
            return False
        if self._failed is not None:
            return True
        return self._records >= self._compact_min and self._records > 2 * live_objects

    def start_snapshot(self, nodes: Sequence[NodeRecord]) -> Snapshot | None:
        if self._snapshot_running or self._closed:
            return None
        gen = self._gen + 1
        with self._io_lock:  # no acknowledgement writes while the segment changes
            self._flush_locked()  # what the old segment holds must reach it first
            try:
                self._open_segment(gen)
            except UsageError as exc:
                self._fail(exc.cause)
                return None
        self._snapshot_running = True
        self._records_at_snapshot = self._records
        return _JournalSnapshot(self, gen, nodes)

    def _snapshot_done(self, gen: int, ok: bool, failures_at_start: int) -> None:
        self._snapshot_running = False
        if not ok:  # tried again in a while, not at every tick (each try opens a segment)
            self._retry_at = max(self._retry_at, time.monotonic() + RETRY_S)
            return
        if self._failures != failures_at_start:
            return
        if self._failed is not None:
            _log.info("master state %s: snapshot written; taking writes again", self.directory)
            self._failed = None
        self._dropped = None  # every change dropped before the snapshot began is in it
        self._records = max(0, self._records - self._records_at_snapshot)
        for entry in self.directory.iterdir():
            m = _SEGMENT.match(entry.name)
            if (m is not None and int(m.group(2)) < gen) or entry.name in (
                    "snapshot.msgpack", "journal.log", "snapshot.tmp", "journal.tmp"):
                with contextlib.suppress(OSError):
                    entry.unlink()

    def close(self) -> None:
        if self._closed:
            return
        with self._io_lock:
            self._flush_locked(sync=True)
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class _JournalSnapshot(Snapshot):
    def __init__(self, state: JournalState, gen: int, nodes: Sequence[NodeRecord]) -> None:
        self._state = state
        self._gen = gen
        self._failures_at_start = state._failures
        self._path = state._segment("snapshot", gen)
        self._tmp = self._path.with_suffix(".tmp")
        self._encoder = msgspec.msgpack.Encoder()
        self._buf = bytearray()
        self._fd: int | None = None
        self._error: str | None = None
        self._started = time.monotonic()
        self._count = 0
        try:
            with contextlib.suppress(FileNotFoundError):
                self._tmp.unlink()
            self._fd = _open_private(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            self._error = f"cannot create {self._tmp}: {exc.strerror or exc}"
        self._take(nodes)

    def _take(self, records: Sequence[NodeRecord | ObjectRecord]) -> None:
        encode, buf = self._encoder.encode, self._buf
        for rec in records:
            payload = encode(rec)
            buf += _LEN.pack(len(payload))
            buf += payload
        self._count += len(records)

    def add(self, records: Sequence[ObjectRecord]) -> None:
        self._take(records)

    def write(self) -> None:
        data, self._buf = self._buf, bytearray()
        if self._fd is None or self._error is not None or not data:
            return
        reserve = self._state.snapshot_reserve_bytes
        try:
            st = os.fstatvfs(self._fd)
            free = st.f_bavail * st.f_frsize
            if free - len(data) < reserve:
                self._error = (f"{self._tmp} would leave {max(0, free - len(data))} bytes "
                               f"free, less than the {reserve} kept for the journal")
                return
            _write_all(self._fd, data)
        except OSError as exc:
            self._error = f"write to {self._tmp} failed: {exc.strerror or exc}"

    def finish(self) -> bool:
        self.write()
        ok = self._error is None and self._fd is not None
        if ok and self._state._failures != self._failures_at_start:
            self._error = "a journal write failed while it was written"
            ok = False
        if ok:
            try:
                os.fsync(self._fd)  # type: ignore[arg-type]
                os.close(self._fd)  # type: ignore[arg-type]
                self._fd = None
                self._tmp.replace(self._path)
                dir_fd = os.open(self._state.directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                self._error = f"cannot complete {self._path}: {exc.strerror or exc}"
                ok = False
        if ok:
            _log.info("master state: snapshot %s of %d records in %.1f s", self._path.name,
                      self._count, time.monotonic() - self._started)
        else:
            _log.warning("master state: snapshot abandoned: %s", self._error)
            self._cleanup()
        self._state._snapshot_done(self._gen, ok, self._failures_at_start)
        return ok

    def _cleanup(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self._tmp.unlink()

    def abort(self) -> None:
        self._cleanup()
        self._state._snapshot_done(self._gen, False, self._failures_at_start)
