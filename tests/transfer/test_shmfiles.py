"""Shared-memory files of SIGKILLed owners are swept; a live owner's never are."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvctl.transfer import shmfiles
from kvctl.transfer.segments import create_shm_segment

OLD = time.time() - 3600


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _file(shm: Path, name: str, *, old: bool = True, size: int = 4096) -> Path:
    path = shm / name
    path.write_bytes(b"\0" * size)
    if old:
        os.utime(path, (OLD, OLD))
    return path


def test_a_killed_owners_segment_is_swept_by_the_next_process(tmp_path: Path) -> None:
    """A process maps a segment and is SIGKILLed: its file stays (the leak); the next
    process to create a segment there deletes it, and keeps its own."""
    code = ("import sys, time; from pathlib import Path; "
            "from kvctl.transfer.segments import create_shm_segment; "
            f"s = create_shm_segment('victim', 1 << 20, shm_dir=Path({str(tmp_path)!r})); "
            "print('ready', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    (left,) = list(tmp_path.glob("kvctl-victim-*"))
    assert shmfiles.sweep_dead(tmp_path, grace_s=0) == []  # alive and holding its lock
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert left.exists()  # what SIGKILL leaves behind
    os.utime(left, (OLD, OLD))
    mine = create_shm_segment("next", 4096, shm_dir=tmp_path)
    try:
        assert not left.exists()
        assert len(list(tmp_path.glob("kvctl-next-*"))) == 1
        assert shmfiles.sweep_dead(tmp_path, grace_s=0) == []  # our own is never taken
    finally:
        mine.close()


def test_only_dead_unlocked_old_files_of_ours_are_deleted(tmp_path: Path) -> None:
    dead = _dead_pid()
    gone = _file(tmp_path, f"kvctl-seg-{dead}-0000aaaa", size=8192)
    young = _file(tmp_path, f"kvctl-seg-{dead}-0000bbbb", old=False)
    alive = _file(tmp_path, f"kvctl-seg-{os.getppid()}-0000cccc")
    other = _file(tmp_path, f"other-seg-{dead}-0000dddd")
    odd = _file(tmp_path, f"kvctl-seg-{dead}x-0000eeee")
    digits = _file(tmp_path, "kvctl-seg-\u0663\u0664-0000ffff")  # Arabic-Indic: no pid
    link = tmp_path / f"kvctl-seg-{dead}-00001111"
    link.symlink_to(other)
    # Held by a process whose pid we cannot see (another pid namespace): kept.
    held = _file(tmp_path, f"kvctl-seg-{dead}-00002222")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        removed = shmfiles.sweep_dead(tmp_path)
    finally:
        os.close(fd)
    assert removed == [(gone.name, 8192)]
    for kept in (young, alive, other, odd, digits, held):
        assert kept.exists(), kept
    assert link.is_symlink()


def test_the_sweep_is_bounded(tmp_path: Path) -> None:
    dead = _dead_pid()
    for i in range(20):
        _file(tmp_path, f"kvctl-seg-{dead}-{i:08x}", size=1)
    assert len(shmfiles.sweep_dead(tmp_path, limit=5)) <= 5
    assert len(list(tmp_path.iterdir())) >= 15


def test_owner_pid_parses_only_ascii_pids() -> None:
    assert shmfiles.owner_pid("kvctl-a-b-123-0badf00d") == 123
    assert shmfiles.owner_pid("kvctl-x-\u00b2-0badf00d") is None
    assert shmfiles.owner_pid("kvctl-0badf00d") is None
    assert shmfiles.owner_pid("x-1-2") is None


def test_delete_if_unowned_keeps_a_locked_file_and_other_kinds(tmp_path: Path) -> None:
    """What ``kvctl segment rm`` deletes: a regular file of ours nobody holds the owner's
    lock on; never a locked one (a live owner the pid check cannot see), a link or a dir."""
    free = _file(tmp_path, "kvctl-free-1-00000000", size=100)
    held = _file(tmp_path, "kvctl-held-1-00000000")
    link = tmp_path / "kvctl-link-1-00000000"
    link.symlink_to(free)
    folder = tmp_path / "kvctl-dir-1-00000000"
    folder.mkdir()
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        assert shmfiles.delete_if_unowned(held) is None
        assert shmfiles.delete_if_unowned(link) is None
        assert shmfiles.delete_if_unowned(folder) is None
        assert shmfiles.delete_if_unowned(tmp_path / "kvctl-none-1-0") is None
        assert shmfiles.delete_if_unowned(free) == 100
    finally:
        os.close(fd)
    assert held.exists()
    assert link.is_symlink()
    assert folder.is_dir()
    assert not free.exists()
