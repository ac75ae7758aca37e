"""``kvctl segment register|list|show|rm``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvctl.metadata import open_metadata
from kvctl.transfer.admin import segment_key
from kvctl.transfer.segments import BufferInfo, SegmentInfo, host_id

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/meta"


@pytest.mark.integration
def test_register_serves_until_interrupted(url: str, kvctl: Callable[..., Any]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "segment", "register", "cli-seg",
                             "--size", "256KiB", "--metadata", url], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first[0] == "cli-seg"
        assert first[1].startswith("127.0.0.1:")
        listed = kvctl("segment", "list", "--metadata", url, "--json")
        assert listed.exit_code == 0
        (seg,) = listed.json()["segments"]
        assert (seg["name"], seg["kind"], seg["addresses"]) == ("cli-seg", "shm", [first[1]])
        shown = kvctl("segment", "show", "cli-seg", "--metadata", url, "--json")
        assert shown.json()["segment"]["buffers"][0]["length"] == 256 * 1024
        table = kvctl("segment", "list", "--metadata", url)
        assert table.exit_code == 0
        assert "1 segment(s)" in table.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    assert proc.returncode == 0
    assert kvctl("segment", "list", "--metadata", url, "--json").json()["segments"] == []


def test_show_and_rm_of_missing_segment_exit_1(url: str, kvctl: Callable[..., Any]) -> None:
    for verb in ("show", "rm"):
        r = kvctl("segment", verb, "ghost", "--metadata", url)
        assert r.exit_code == 1
        assert "Error: segment 'ghost' is not published" in r.stderr
        assert "Hint:" in r.stderr


def test_rm_removes_a_stale_entry_and_its_shm_file(url: str, kvctl: Callable[..., Any]) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shm = Path(f"/dev/shm/kvctl-stale-{os.getpid()}-test")
    shm.write_bytes(bytes(16))
    info = SegmentInfo("stale", "shm", "gone", host_id(), dead.pid, ("127.0.0.1:1",), 1,
                       ("shm", "tcp"), (BufferInfo(0, 16, "cpu:0", str(shm)),))
    with open_metadata(url) as client:
        client.put(segment_key("", "stale"), info.to_json())
    r = kvctl("segment", "rm", "stale", "--metadata", url, "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["removed"]["files_removed"] == [str(shm)]
    assert not shm.exists()
    assert kvctl("segment", "show", "stale", "--metadata", url).exit_code == 1


def test_register_rejects_bad_settings(url: str, kvctl: Callable[..., Any]) -> None:
    r = kvctl("segment", "register", "x", "--kind", "tape", "--metadata", url)
    assert r.exit_code == 2
    assert "unknown segment kind" in r.stderr
    r = kvctl("segment", "register", "x", "--size", "lots", "--metadata", url)
    assert r.exit_code == 2
    assert "--size" in r.stderr
    r = kvctl("segment", "register", "x", "--kind", "file", "--metadata", url)
    assert r.exit_code == 2
    assert "needs a path" in r.stderr
