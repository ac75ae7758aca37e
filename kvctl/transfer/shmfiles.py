"""Shared-memory files of this host's segments: who owns one, and sweeping the dead's.

A shm segment is a ``/dev/shm/kvctl-<name>-<pid>-<hex>`` file. Its owner holds a shared
``flock`` on it for as long as the mapping lives (the lock rides on the mapping's own
descriptor, so it goes when the segment is closed, and with the process on SIGKILL). A
process that was killed leaves its file behind, and the file keeps its memory until
someone deletes it: without a sweep, every SIGKILLed node or target leaks its whole
segment until the host reboots.

:func:`sweep_dead` deletes a file only when all of these hold: it is ours (our uid, a
regular file, not a link), it is older than a grace period (a file being created right
now is never taken), the pid in its name is not alive here, and an exclusive ``flock``
on it succeeds (nobody holds the owner's lock, even a process in another pid namespace
sharing this ``/dev/shm``). The lock test is what makes the pid test safe; the pid test
spares files of older kvctl versions, which did not lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from pathlib import Path

_log = logging.getLogger("kvctl.transfer")

PREFIX = "kvctl-"
#: files younger than this are never swept, seconds (creation and locking take microseconds)
GRACE_S = 30.0
#: directory entries one sweep looks at, at most
SWEEP_LIMIT = 4096
#: the largest pid Linux hands out (``PID_MAX_LIMIT`` on 64-bit); a name with a larger
#: one was not made by a segment's owner
PID_LIMIT = 1 << 22


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal counts)."""
    if not 0 < pid <= PID_LIMIT:  # no such process (and os.kill overflows past a C int)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hold(fd: int) -> None:
    """Mark the file open on ``fd`` as owned by this process (a shared ``flock`` that
    lasts as long as any descriptor of this open file, e.g. a mapping's duplicate).
    Best effort: on a file system without ``flock`` the pid in the name is all a sweep
    has to go on."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        _log.debug("no flock on shared-memory file (fd %d): %s", fd, exc)


def owner_pid(name: str) -> int | None:
    """The pid in a segment file's name (``kvctl-<name>-<pid>-<hex>``), if it has one."""
    if not name.startswith(PREFIX):
        return None
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isascii() or not parts[1].isdecimal():
        return None
    pid = int(parts[1][:9])  # (a longer run of digits is no pid; int() of it costs)
    return pid if 0 < pid <= PID_LIMIT and len(parts[1]) <= 9 else None


def sweep_dead(shm_dir: Path, *, grace_s: float = GRACE_S, limit: int = SWEEP_LIMIT
               ) -> list[tuple[str, int]]:
    """Delete the segment files in ``shm_dir`` whose owner is gone (see the module
    docstring for the rules); ``(name, bytes)`` of each deleted file."""
    removed: list[tuple[str, int]] = []
    now = time.time()
    uid = os.getuid()
    try:
        entries = os.scandir(shm_dir)
    except OSError:
        return removed
    with entries:
        for seen, entry in enumerate(entries):
            if seen >= limit:
                break
            pid = owner_pid(entry.name)
            if pid is None or pid == os.getpid() or pid_alive(pid):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if (not entry.is_file(follow_symlinks=False) or st.st_uid != uid
                    or now - st.st_mtime < grace_s):
                continue
            size = _delete_unlocked(Path(entry.path), st.st_ino)
            if size is not None:
                removed.append((entry.name, size))
    if removed:
        _log.info("deleted %d shared-memory file(s) of dead processes in %s (%d bytes): %s",
                  len(removed), shm_dir, sum(s for _, s in removed),
                  ", ".join(n for n, _ in removed[:5]) + (" ..." if len(removed) > 5 else ""))
    return removed


def delete_if_unowned(path: Path) -> int | None:
    """Delete the segment file ``path`` if it is a regular file of ours that nobody holds
    the owner's lock on (its owner is gone, whatever pid namespace it ran in); its size,
    or None when it was kept."""
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return None
    return _delete_unlocked(path, st.st_ino)


def _delete_unlocked(path: Path, inode: int) -> int | None:
    """Delete ``path`` if nobody holds its owner's lock and it is still inode ``inode``;
    its size, or None when it was kept."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # held: a live owner (perhaps in another pid namespace)
        st = os.fstat(fd)
        if st.st_ino != inode or path.lstat().st_ino != inode:
            return None
        path.unlink()
        return st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)
