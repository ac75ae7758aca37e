"""Bad shared-tier files that clients report: checked by the master, then dropped.

A client whose read of a shared-tier file fails (torn, truncated, flipped, missing)
treats it as a miss and reports the key and version (:class:`~kvctl.store.protocol.
SharedBad`, no reply). Without the report the index would go on naming the file and every
later get would pay the miss again. The master trusts no client:

- a report is taken only for a file its index names now (that key at that version, with
  a shared copy), at most :data:`MAX_QUEUED` at a time, and not for a file it verified
  good in the last :data:`GOOD_FOR_S` seconds; the rest are counted as dropped;
- the file is read and checked against the index's own size and checksum by a thread of
  the tier's own (:class:`BadFileReports`), never with the master's lock held, at most
  :data:`VERIFY_BYTES_PER_S` a second: a flood of reports costs the master a bounded read
  rate and a queue of bounded length, never its lock or its requests;
- only a file that is missing, not a regular file, or fails the check loses its index
  entry (a state change: journal or etcd), and it is deleted once that change is durable
  (:func:`~kvctl.store.sharedtier.housekeeping.housekeeping`). A read the file system
  fails (``EIO``, ``ESTALE``) proves nothing: it is counted, and the entry stays;
- a file is *missing* only from a mounted tier: one missing while the tier's root lacks
  its marker file (the bare mount point an unmounted NFS or 3FS leaves, :func:`tier_away`)
  is counted as ``unmounted`` and keeps its entry, so the read is a miss until the tier
  is back, never a loss.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from kvctl.store.checksum import ALGORITHM
from kvctl.store.master.records import Obj
from kvctl.store.sharedtier.config import TIER_MARKER
from kvctl.store.sharedtier.fileformat import (
    FORMAT,
    HEADER,
    MAGIC,
    SharedMissError,
    errno_name,
    file_bytes,
    header_bytes,
    read_bytes,
    read_entry,
)

if TYPE_CHECKING:
    from kvctl.store.sharedtier.mixin import SharedTierMixin

_log = logging.getLogger("kvctl.store.sharedtier")

#: Most reported files waiting for their check.
MAX_QUEUED = 256
#: Most (key, version) pairs of one report message looked at (the rest are dropped).
MAX_PER_REPORT = 64
#: Seconds a file verified good is not checked again (a client that reports good files
#: over and over makes the master read each at most once in that time).
GOOD_FOR_S = 60.0
#: Most files remembered as verified good.
GOOD_MEMORY = 4096
#: Bytes of reported files the master reads a second at most.
VERIFY_BYTES_PER_S = 256 << 20
#: Objects up to this size are checked by the clients' own read (into memory); larger ones
#: a chunk at a time, so a large object's check never holds its size in the master.
WHOLE_READ_MAX = 64 << 20
#: Bytes one read of a large object's check takes.
CHUNK = 4 << 20
#: What a reported file missing from a tier that is not mounted (its root without its
#: marker) is counted as in the tier's errors: not bad, the entry stays.
UNMOUNTED = "unmounted"


def verify(path: Path, key: str, version: int, size: int, csum: int, at: int = -1
           ) -> tuple[str, str] | None:
    """``None`` when ``path`` is exactly the object the index names (``at`` >= 0: its
    record at that offset of a pack is); else ``(kind, why)`` with kind ``ENOENT``
    (missing) or ``corrupt`` (anything else wrong with it).

    Raises:
        OSError: the file system failed the read (``EIO``, ``ESTALE``...): nothing is
            proved either way.
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return "ENOENT", "missing"
    if size > WHOLE_READ_MAX and ALGORITHM == "xxh3-64" and at < 0:
        return _verify_in_chunks(path, key, version, size, csum)
    try:
        if at < 0:
            read_bytes(path, key, version, csum, size)
        else:
            read_entry(path, at, key, version, csum, size)
    except SharedMissError as exc:
        try:
            os.lstat(path)
        except FileNotFoundError:
            return "ENOENT", "missing"
        if "cannot be" in exc.cause and not _special(before.st_mode):
            # opened or read failed on a file that is there: the file system's fault
            raise OSError(errno.EIO, exc.cause) from None
        return "corrupt", exc.cause.replace(repr(key), "its copy")
    return None


def _verify_in_chunks(path: Path, key: str, version: int, size: int, csum: int
                      ) -> tuple[str, str] | None:
    """:func:`verify` of a large object: its header, its length, then its bytes through a
    streaming xxh3-64 (:data:`CHUNK` at a time)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return "ENOENT", "missing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "corrupt", "a symbolic link"
        raise
    try:
        info = os.fstat(fd)
        if _special(info.st_mode):
            return "corrupt", "not a regular file"
        kb = key.encode("utf-8", "surrogatepass")
        if info.st_size != file_bytes(key, size):
            return "corrupt", ("truncated" if info.st_size < file_bytes(key, size)
                               else "longer than its object")
        head = os.pread(fd, header_bytes(key), 0)
        if len(head) != header_bytes(key):
            return "corrupt", "truncated"
        magic, fmt, key_len, fsize, fsum, fversion, _epoch = HEADER.unpack_from(head)
        if (magic, fmt, key_len, fsize, fsum, fversion) != (
                MAGIC, FORMAT, len(kb), size, csum, version) or head[HEADER.size:] != kb:
            return "corrupt", "a header for another object (torn or reused)"
        digest = xxhash.xxh3_64()
        offset, left = len(head), size
        while left:
            chunk = os.pread(fd, min(CHUNK, left), offset)
            if not chunk:
                return "corrupt", "truncated"
            digest.update(chunk)
            offset += len(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if digest.intdigest() != csum:
        return "corrupt", "fails its checksum"
    return None


def tier_away(root: Path, path: Path) -> str | None:
    """Why a file found missing at ``path`` proves nothing (``None``: it is missing from
    the tier itself, so bad).

    A distributed file system unmounted for a moment (an NFS or 3FS hiccup) leaves its
    bare mount point: every file is "missing" although none is gone. As the write path
    does (:func:`~kvctl.store.sharedtier.fileformat.write_object`), the tier is taken for
    the tier only while its root holds :data:`~kvctl.store.sharedtier.config.TIER_MARKER`;
    the marker is looked at after the file was found missing, and the file once more
    after that, so a mount that came back between the two reads is not a loss either.
    """
    try:
        os.lstat(root / TIER_MARKER)
    except FileNotFoundError:
        return f"the tier is not mounted ({TIER_MARKER} missing from {root})"
    except OSError as exc:
        return f"the tier's root {root} cannot be read ({exc.strerror or exc})"
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"the file cannot be looked up ({exc.strerror or exc})"
    return "the file is back (the tier was remounted meanwhile)"


def _special(mode: int) -> bool:
    """Not a regular file (a link, FIFO, device or directory planted at the name)."""
    return not stat.S_ISREG(mode)


class BadFileReports:
    """Reported files waiting for their check, and the thread that checks them.

    The queue and the memory of good files are guarded by the master's lock; the thread
    takes one file at a time under it and reads the file without it.
    """

    def __init__(self, verify_bytes_per_s: int = VERIFY_BYTES_PER_S) -> None:
        #: path (``path@offset`` for a pack's record) -> (object as the index named it,
        #: its file, its record's offset in a pack or -1)
        self.queue: OrderedDict[str, tuple[Obj, str, int]] = OrderedDict()
        #: (key, version) -> when verified good
        self.good: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.reports = 0
        self.dropped = 0
        self.bad = 0
        #: reported files found missing while the tier was not mounted (entries kept)
        self.unavailable = 0
        self.verify_bytes_per_s = verify_bytes_per_s
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- index side (lock held)

    def take(self, obj: Obj, path: str, now: float, at: int = -1) -> bool:
        """Queue ``obj``'s file (named by the index; ``at`` >= 0: its record at that offset
        of a pack) for a check; ``False`` when not taken (queued already, verified good
        lately, or the queue is full)."""
        when = self.good.get((obj.key, obj.version))
        if when is not None and now - when < GOOD_FOR_S:
            self.dropped += 1
            return False
        name = path if at < 0 else f"{path}@{at}"
        if name in self.queue:
            self.dropped += 1
            return False
        if len(self.queue) >= MAX_QUEUED:
            self.dropped += 1
            return False
        self.queue[name] = (obj, path, at)
        return True

    def was_good(self, obj: Obj, now: float) -> None:
        good = self.good
        good.pop((obj.key, obj.version), None)
        good[(obj.key, obj.version)] = now
        while len(good) > GOOD_MEMORY:
            good.popitem(last=False)

    # ---- the checking thread

    def start(self, core: SharedTierMixin) -> None:
        """Wake the thread (started on the first report)."""
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._loop, args=(core,),
                                            name="kvctl-shared-reports", daemon=True)
            self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)

    def _loop(self, core: SharedTierMixin) -> None:
        spent = 0.0  # seconds of reading the rate allows ahead of now
        while not self._stop:
            self._wake.wait(1.0)
            self._wake.clear()
            while not self._stop:
                with core._lock:
                    if not self.queue:
                        break
                    _, (obj, path, at) = self.queue.popitem(last=False)
                    checked = core._shared_check_wanted(obj)
                if not checked:
                    continue
                spent = self._pace(spent, obj.size)
                self._check(core, Path(path), obj, at)

    def _pace(self, ahead: float, nbytes: int) -> float:
        """Sleep so that reads stay under :attr:`verify_bytes_per_s`."""
        now = time.monotonic()
        ahead = max(ahead, now) + nbytes / self.verify_bytes_per_s
        if ahead - now > 0.1:
            time.sleep(ahead - now - 0.1)
        return ahead

    def _check(self, core: SharedTierMixin, path: Path, obj: Obj, at: int = -1) -> None:
        try:
            found = verify(path, obj.key, obj.version, obj.size, obj.checksum, at)
        except OSError as exc:
            with core._lock:
                core._shared_check_failed(errno_name(exc),
                                          f"check of a reported file {path}: {exc}")
            return
        away = None
        if found is not None and found[0] == "ENOENT":
            away = tier_away(core._shared_root(), path)
        with core._lock:
            if core._shared_at(obj) != at or core._shared_file(obj) != str(path):
                return  # its copy moved meanwhile (dropped, written to another pack)
            if found is None:
                self.was_good(obj, core._clock())
                return
            if away is not None:
                self.unavailable += 1
                core._shared_check_failed(UNMOUNTED, f"check of a reported file {path}: "
                                          f"{away}: the entry stays")
                return
            core._shared_bad(obj, *found)

