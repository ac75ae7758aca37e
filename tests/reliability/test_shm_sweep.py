"""Hostile /dev/shm entries against the dead-segment sweep (kvctl.transfer.shmfiles).

A name whose pid field is a long run of digits made ``os.kill`` overflow, so the sweep, and
with it the first ``create_shm_segment`` of every process, raised OverflowError. Live
segments held only through a forked child's inherited mapping, or created on a thread,
are never taken; links, FIFOs and directories are left alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvctl.transfer import shmfiles
from kvctl.transfer.segments import LocalSegment, create_shm_segment

OLD = time.time() - 3600


def _old(path: Path) -> Path:
    os.utime(path, (OLD, OLD), follow_symlinks=False)
    return path


def test_a_name_with_a_huge_pid_does_not_crash_segment_creation(tmp_path: Path) -> None:
    for pid in ("9" * 20, "9" * 200, "4194305", "0"):
        (tmp_path / f"kvctl-x-{pid}-ab").write_bytes(b"x")
        _old(tmp_path / f"kvctl-x-{pid}-ab")
    assert shmfiles.owner_pid(f"kvctl-x-{'9' * 20}-ab") is None
    assert shmfiles.pid_alive(10 ** 20) is False
    assert shmfiles.sweep_dead(tmp_path, grace_s=0) == []  # none is a segment's: kept
    seg = create_shm_segment("after", 4096, shm_dir=tmp_path)
    seg.close()
    assert len(list(tmp_path.glob("kvctl-x-*"))) == 4


def test_links_fifos_and_dirs_with_a_dead_pid_are_left_alone(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"keep")
    _old(victim)
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    (shm / f"kvctl-link-{pid}-aa").symlink_to(victim)
    _old(shm / f"kvctl-link-{pid}-aa")
    os.mkfifo(shm / f"kvctl-fifo-{pid}-bb")
    _old(shm / f"kvctl-fifo-{pid}-bb")
    (shm / f"kvctl-dir-{pid}-cc").mkdir()
    _old(shm / f"kvctl-dir-{pid}-cc")
    started = time.monotonic()
    assert shmfiles.sweep_dead(shm, grace_s=0) == []
    assert time.monotonic() - started < 5  # the FIFO is never opened blocking
    assert victim.read_bytes() == b"keep"
    assert len(list(shm.iterdir())) == 3


def test_a_forked_child_keeps_its_dead_parents_segment(tmp_path: Path) -> None:
    """The parent creates a segment, forks a child that inherits the mapping, and is
    SIGKILLed: the child's inherited descriptor holds the owner's lock, so the file
    (named after the dead parent) stays while the child lives and goes after."""
    code = (
        "import os, sys, time; from pathlib import Path; "
        "from kvctl.transfer.segments import create_shm_segment; "
        f"s = create_shm_segment('forked', 1 << 16, shm_dir=Path({str(tmp_path)!r})); "
        "r, w = os.pipe(); child = os.fork()\n"
        "if child == 0:\n"
        "    os.close(r); os.write(w, b'x'); time.sleep(60); os._exit(0)\n"
        "os.read(r, 1); print(child, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        (left,) = list(tmp_path.glob("kvctl-forked-*"))
        _old(left)
        assert shmfiles.sweep_dead(tmp_path, grace_s=0) == []
        assert left.exists()
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while shmfiles.pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)  # (reaped by init: the parent is gone)
    assert [n for n, _ in shmfiles.sweep_dead(tmp_path, grace_s=0)] == [left.name]


def test_a_segment_created_on_a_thread_is_not_swept(tmp_path: Path) -> None:
    made: list[LocalSegment] = []
    worker = threading.Thread(target=lambda: made.append(
        create_shm_segment("threaded", 4096, shm_dir=tmp_path)))
    worker.start()
    worker.join(10)
    (path,) = list(tmp_path.glob("kvctl-threaded-*"))
    _old(path)
    try:
        code = ("import sys; from pathlib import Path; from kvctl.transfer import shmfiles; "
                f"print(shmfiles.sweep_dead(Path({str(tmp_path)!r}), grace_s=0))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=30)
        assert out.stdout.strip() == "[]"
        assert path.exists()
    finally:
        made[0].close()
