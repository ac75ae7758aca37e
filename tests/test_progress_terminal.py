"""Progress on a real terminal (tmux): the count moves as steps finish, and a warning
printed while the bar is live gets its own line instead of being glued to the bar."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="needs tmux (scripts/setup installs it)")

#: Runs ``kvctl runbook BOOK`` with one extra step kind, ``wait-file``, that logs a warning
#: and then waits (bounded) until the test creates a file.
_DRIVER = '''
import dataclasses, logging, sys, time
from pathlib import Path
from kvctl.runbook.model import CheckResult, Verdict, register_step

@dataclasses.dataclass(frozen=True)
class WaitParams:
    path: str = ""

@register_step("wait-file", WaitParams, "waits for a file (test only)")
def wait_file(params, ctx):
    logging.getLogger("kvctl.test").warning("intentional warning while the bar is live")
    deadline = time.monotonic() + 60
    while not Path(params.path).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return [CheckResult("", Verdict.PASS, "file seen")]

from kvctl.cli import main
code = main(["runbook", sys.argv[1]])
print("EXIT", code)
time.sleep(30)
'''


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True, check=True, timeout=10).stdout


def _wait_for(session: str, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = _pane(session)
        if text in screen:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared; screen:\n{screen}")


def test_runbook_progress_counts_finished_steps_and_keeps_warnings_apart(
        tmp_path: Path) -> None:
    release = tmp_path / "release"
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    book = tmp_path / "book.yaml"
    book.write_text("name: progress\nsteps:\n"
                    "  - check: verify-keys\n    name: keys\n"
                    f"  - check: wait-file\n    name: waiting\n    path: {release}\n")
    session = f"kvctl-test-{uuid.uuid4().hex[:8]}"
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "30",
                    "-c", str(repo), sys.executable, str(driver), str(book)],
                   check=True, timeout=10)
    try:
        screen = _wait_for(session, "1/2")  # the first step has finished
        assert "waiting: running" in screen
        lines = screen.splitlines()
        assert any(line.startswith("WARNING kvctl.test: intentional warning") for line in lines), \
            screen
        assert not any("1/2" in line and "WARNING" in line for line in lines), screen
        release.touch()
        screen = _wait_for(session, "EXIT 0")
        assert "runbook progress: PASSED" in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False, timeout=10)
