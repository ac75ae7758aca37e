"""``TransferEngine.close()`` on one thread while other threads run 128 MiB shm copies
through one of its own shm segments never unmaps memory under them (issue 27.11: SIGSEGV
in 3 of 6 runs on the old code, which force-released the in-flight count and unmapped).
The refresh/close fix of issue 15.12 (``test_shm_unmap_race``) covered the *target's*
mapping; this is the *local* segment's. Each run is a child process, so a crash is an exit
code, not a dead test run; runs are bounded by time and count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvctl.transfer.segments import create_shm_segment

SCRIPT = textwrap.dedent("""
    import sys, threading, time, uuid
    from kvctl.errors import KvctlError
    from kvctl.transfer.batch import OpCode, TransferRequest
    from kvctl.transfer.engine import TransferEngine

    url = f"memory://{uuid.uuid4().hex}"
    size = 128 << 20
    op = OpCode.READ if sys.argv[1] == "read" else OpCode.WRITE
    target = TransferEngine("close-t", metadata=url)
    target.register_segment("close-remote", size, kind="shm")
    init = TransferEngine("close-i", metadata=url, transport="shm")
    init.register_segment("close-local", size, kind="shm")
    stop = time.monotonic() + 3.0
    started = threading.Barrier(3)
    refused = []

    def copier():
        started.wait()
        while time.monotonic() < stop:
            try:
                init.transfer([TransferRequest(op, "close-local", 0, "close-remote", 0,
                                               size)])
            except KvctlError as exc:
                refused.append(exc.cause)
                return

    threads = [threading.Thread(target=copier) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)  # copies are under way
    init.close()
    for t in threads:
        t.join(10)
    target.close()
    print("ok", len(refused), refused[:1], flush=True)
""")

RUNS = 4


@pytest.mark.parametrize("op", ["read", "write"])
def test_engine_close_during_a_local_shm_copy_never_crashes(op: str) -> None:
    for run in range(RUNS):
        done = subprocess.run([sys.executable, "-c", SCRIPT, op], capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, (run, done.returncode, done.stderr[-2000:])
        assert done.stdout.startswith("ok 2 "), done.stdout  # both copiers told it closed
        assert "is closed" in done.stdout, done.stdout


def test_a_retired_segment_is_unmapped_by_its_last_transfer(tmp_path: Path) -> None:
    seg = create_shm_segment("retire-me", 1 << 16, shm_dir=tmp_path)
    seg.acquire(2)
    assert seg.retire(0.01) is False  # still in use: nothing unmapped
    assert seg.closed
    assert seg.buffers[0].view is not None
    assert any(tmp_path.iterdir())
    seg.release()
    assert seg.buffers[0].view is not None
    seg.release()  # the last one out unmaps and deletes
    assert seg.buffers[0].view is None
    assert not any(tmp_path.iterdir())
    assert seg.retire(0.0) is True


def test_retire_waits_for_a_transfer_that_ends(tmp_path: Path) -> None:
    seg = create_shm_segment("retire-wait", 1 << 16, shm_dir=tmp_path)
    seg.acquire()
    timer = threading.Timer(0.05, seg.release)
    timer.start()
    try:
        assert seg.retire(10.0) is True
    finally:
        timer.join()
    assert seg.buffers[0].view is None
    assert not any(tmp_path.iterdir())
