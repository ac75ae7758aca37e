"""Native libraries' log lines go to a file; kvctl's own stderr stays on the terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: A glog line (Mooncake): severity letter, MMDD, time, thread, file:line]
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.MULTILINE)


def _run(code: str, log_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "KVCTL_LOG_DIR": str(log_dir)})


def test_inside_the_context_native_writes_go_to_the_file_python_stays(tmp_path: Path) -> None:
    proc = _run(
        "import logging, os, sys\n"
        "from kvctl.nativelog import native_output_to_log\n"
        "logging.basicConfig(format='LOG %(message)s')\n"
        "with native_output_to_log('lib') as path:\n"
        "    with native_output_to_log('nested') as again:\n"
        "        assert again == path\n"
        "    os.write(2, b'native line\\n')\n"
        "    print('python line', file=sys.stderr)\n"
        "    logging.warning('a warning')\n"
        "os.write(2, b'after\\n')\n"
        "print(path)\n", tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.parent == tmp_path
    assert path.name.startswith("lib-")
    assert "native line" in path.read_text()
    assert "native line" not in proc.stderr
    assert "python line" in proc.stderr
    assert "LOG a warning" in proc.stderr
    assert "after" in proc.stderr  # fd 2 is back once the last user leaves
    assert path.stat().st_mode & 0o077 == 0


def test_an_engine_process_sends_fd_1_and_2_to_its_log(tmp_path: Path) -> None:
    proc = _run(
        "import os, sys\n"
        "from kvctl.nativelog import send_native_output_to_log\n"
        "path = send_native_output_to_log('engine')\n"
        "os.write(1, b'native out\\n'); os.write(2, b'native err\\n')\n"
        "print('kvctl says', path, file=sys.stderr)\n", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # stdout carries only results
    (log,) = tmp_path.glob("engine-*.log")
    assert "native out" in log.read_text()
    assert "native err" in log.read_text()
    assert f"kvctl says {log}" in proc.stderr


def test_an_unwritable_log_dir_leaves_output_where_it_was(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _run(
        "import os\n"
        "from kvctl.nativelog import native_output_to_log\n"
        "with native_output_to_log('lib') as path:\n"
        "    os.write(2, b'still here\\n')\n"
        "print(path)\n", blocker / "sub")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"
    assert "still here" in proc.stderr


def test_only_the_newest_logs_are_kept(tmp_path: Path) -> None:
    from kvctl import nativelog

    for i in range(nativelog.KEEP + 5):
        old = tmp_path / f"old-{i}.log"
        old.write_text("--- an old kvctl log\n")
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    proc = _run("from kvctl.nativelog import native_output_to_log\n"
                "with native_output_to_log('lib'):\n    pass\n", tmp_path)
    assert proc.returncode == 0, proc.stderr
    left = sorted(tmp_path.glob("*.log"))
    assert len(left) == nativelog.KEEP + 1
    assert not (tmp_path / "old-0.log").exists()


@pytest.mark.integration
def test_mooncake_glog_lines_stay_off_the_terminal(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeMaster, MooncakeUnavailableError

    src = tmp_path / "value"
    src.write_bytes(os.urandom(4096))
    try:
        master = MooncakeMaster(storage_bytes=64 << 20)
    except MooncakeUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc.cause}")
    logs = tmp_path / "logs"
    with master:
        proc = subprocess.run(
            [sys.executable, "-m", "kvctl", "-v", "store", "put", "nl/k", str(src),
             "--backend", "mooncake", "--master", master.address],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "KVCTL_LOG_DIR": str(logs)})
    assert proc.returncode == 0, proc.stderr
    assert not GLOG.search(proc.stderr), proc.stderr
    (log,) = logs.glob("mooncake-store-*.log")
    assert GLOG.search(log.read_text())  # Mooncake did log, to the file
    assert str(log) in proc.stderr  # -v names the file


@pytest.mark.integration
def test_a_foreign_engine_bench_prints_no_engine_log_lines(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "kvctl", "bench", "transfer", "--engine", "mooncake", "-t", "tcp",
         "-b", "64KiB", "-n", "4", "-i", "2", "--op", "read"],
        capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "KVCTL_LOG_DIR": str(logs)})
    assert proc.returncode == 0, proc.stderr
    assert not GLOG.search(proc.stderr), proc.stderr
    assert any(GLOG.search(p.read_text()) for p in logs.glob("*.log"))
