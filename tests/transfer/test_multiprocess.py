"""Targets in other processes, found through file:// metadata; lease expiry after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.metadata import open_metadata
from kvctl.transfer import OpCode, SegmentNotFoundError, TransferEngine, TransferRequest
from tests.transfer._helpers import pattern, wait_until
from tests.transfer._target_proc import BLOCK, RUN

ROOT = Path(__file__).resolve().parents[2]
SIZE = 32 * BLOCK

pytestmark = pytest.mark.integration


def _spawn(url: str, name: str, ttl: float = 10.0) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.transfer._target_proc", url, name,
                             str(SIZE), str(ttl)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until READY (or the child dies: empty line)
    if line.strip() != "READY":
        proc.kill()
        pytest.fail(f"target process did not start: {line!r}")
    return proc


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/meta"


@pytest.fixture
def remote(url: str) -> Iterator[subprocess.Popen[str]]:
    proc = _spawn(url, "mp-remote")
    yield proc
    if proc.poll() is None:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(20)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_read_and_write_another_process(url: str, remote: subprocess.Popen[str],
                                        transport: str) -> None:
    with TransferEngine("mp-init", url, transport=transport, slice_bytes=BLOCK // 2) as engine:
        engine.register_segment("local", SIZE)
        handle = engine.open_segment("mp-remote")
        assert handle.transport == transport
        assert handle.engine == "mp-remote-engine"
        blocks = SIZE // BLOCK
        engine.transfer([TransferRequest(OpCode.READ, "local", i * BLOCK, "mp-remote",
                                         i * BLOCK, BLOCK) for i in range(blocks)], timeout_s=20)
        view = engine.local_view("local")
        for i in range(blocks):
            assert bytes(view[i * BLOCK : (i + 1) * BLOCK]) == pattern(RUN, i, i * BLOCK, BLOCK)
        # Write a new pattern (reversed block order), read it back into another place.
        for i in range(blocks):
            view[i * BLOCK : (i + 1) * BLOCK] = pattern(RUN + 1, i, i * BLOCK, BLOCK)
        engine.transfer([TransferRequest(OpCode.WRITE, "local", i * BLOCK, "mp-remote",
                                         (blocks - 1 - i) * BLOCK, BLOCK) for i in range(blocks)],
                        timeout_s=20)
        view[:] = bytes(SIZE)
        engine.transfer([TransferRequest(OpCode.READ, "local", 0, "mp-remote", 0, SIZE)],
                        timeout_s=20)
        for i in range(blocks):
            j = blocks - 1 - i
            assert bytes(view[j * BLOCK : (j + 1) * BLOCK]) == pattern(RUN + 1, i, i * BLOCK,
                                                                         BLOCK)


def test_killed_target_vanishes_when_its_lease_expires(url: str) -> None:
    proc = _spawn(url, "mp-doomed", ttl=1.0)
    with open_metadata(url) as client, TransferEngine("watcher", client) as engine:
        info = engine.lookup("mp-doomed")
        assert info.pid == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

        def gone() -> bool:
            try:
                engine.lookup("mp-doomed")
            except SegmentNotFoundError:
                return True
            return False

        wait_until(gone, timeout_s=10, what="segment entry expiry")
    shm = info.buffers[0].path
    if shm and Path(shm).exists():  # SIGKILL leaves the file; 'segment rm' cleans it
        Path(shm).unlink()
