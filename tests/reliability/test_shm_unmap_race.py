"""refresh_segment() or close() on one thread never unmaps memory under another thread's
shm copy (issue 15.12: SIGSEGV in 3/3 runs on the old code). Run in a child process, so a
crash is an exit code, not a dead test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, threading, time, uuid
    from kvctl.transfer.batch import OpCode, TransferRequest
    from kvctl.transfer.engine import TransferEngine
    from kvctl.errors import KvctlError

    url = f"memory://{uuid.uuid4().hex}"
    size = 64 << 20
    mode = sys.argv[1]
    with TransferEngine("race-t", metadata=url) as target:
        target.register_segment("race", size, kind="shm")
        init = TransferEngine("race-i", metadata=url, transport="shm")
        local = bytearray(size)
        init.register_memory("race-local", [local])
        stop = time.monotonic() + 2.0
        failures = []

        def reader():
            while time.monotonic() < stop:
                try:
                    init.transfer([TransferRequest(OpCode.READ, "race-local", 0, "race", 0,
                                                   size)])
                except KvctlError as exc:
                    if mode != "close":
                        failures.append(exc.cause)
                    return

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        if mode == "refresh":
            while time.monotonic() < stop:
                init.refresh_segment("race")
        else:
            time.sleep(0.3)
            init.close()
        for t in threads:
            t.join()
        init.close()
        print("ok", len(failures), failures[:1], flush=True)
""")


@pytest.mark.parametrize("mode", ["refresh", "close"])
def test_unmapping_under_a_running_copy_never_crashes(mode: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("ok 0"), done.stdout
