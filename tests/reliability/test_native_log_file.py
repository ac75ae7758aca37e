"""Hostile checks of the native log file (kvctl/nativelog.py): a full disk, a FIFO planted
at the log's path, and a KVCTL_LOG_DIR other programs log to."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl import nativelog

_PROBE = ("import os\n"
          "from kvctl.nativelog import native_output_to_log\n"
          "with native_output_to_log('lib') as path:\n"
          "    os.write(2, b'still here\\n')\n"
          "print(path)\n")


def _run(log_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=timeout, check=False,
                          env={**os.environ, "KVCTL_LOG_DIR": str(log_dir)})


@contextlib.contextmanager
def _full_tmpfs(where: Path) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        fill = os.open(where / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with contextlib.suppress(OSError):  # until ENOSPC
                for _ in range(64):
                    os.write(fill, b"\0" * 4096)
        finally:
            os.close(fill)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_log_disk_leaves_output_on_the_terminal(tmp_path: Path) -> None:
    """The header write fails with ENOSPC: kvctl must go on, lines where they were."""
    with _full_tmpfs(tmp_path / "full") as full:
        proc = _run(full)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"
    assert "still here" in proc.stderr


def test_a_fifo_planted_at_the_log_path_does_not_block(tmp_path: Path) -> None:
    """Log names are <component>-<pid>.log: a FIFO planted there (with or without a reader)
    must neither hang the process nor get its output."""
    code = ("import os, sys\n"
            "from kvctl.nativelog import log_path\n"
            "os.mkfifo(log_path('lib'))\n" + _PROBE)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False,
                          env={**os.environ, "KVCTL_LOG_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"
    assert "still here" in proc.stderr


def test_a_fifo_with_a_reader_gets_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setenv("KVCTL_LOG_DIR", str(tmp_path))
    fifo = nativelog.log_path("lib")
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with nativelog.native_output_to_log("lib") as path:
            assert path is None
        with contextlib.suppress(BlockingIOError):
            got.append(os.read(reader, 4096))
    finally:
        os.close(reader)
    assert not any(got)


def test_other_programs_logs_in_the_log_dir_are_never_pruned(tmp_path: Path) -> None:
    """KVCTL_LOG_DIR=/var/log/app: kvctl removes only its own old logs."""
    for i in range(nativelog.KEEP + 10):
        foreign = tmp_path / f"access-{20260000 + i}.log"
        foreign.write_text("GET / 200\n")
        os.utime(foreign, (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "app.log").write_text("other\n")
    os.utime(tmp_path / "app.log", (1_000, 1_000))
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "app.log").exists()
    assert len(list(tmp_path.glob("access-*.log"))) == nativelog.KEEP + 10


def test_many_processes_at_once_each_get_their_own_log(tmp_path: Path) -> None:
    results: list[subprocess.CompletedProcess[str]] = []
    lock = threading.Lock()

    def one() -> None:
        proc = _run(tmp_path, timeout=120)
        with lock:
            results.append(proc)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert len(results) == 12
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    paths = {r.stdout.strip() for r in results}
    assert len(paths) == 12
    for path in paths:
        assert "still here" in Path(path).read_text()
