"""``kvctl store top`` in a real terminal: tmux runs it, capture-pane reads the screen, and
q and Ctrl-C must leave the shell's terminal as it was."""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore, metrics_url
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.settings import StoreSettings

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="needs tmux (scripts/setup installs it)")

MiB = 1 << 20


class Pane:
    """One tmux session on a private socket, running an interactive shell."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", str(self.socket), *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "top", "-l", line)
        self.tmux("send-keys", "-t", "top", "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def wait_for(self, test: Callable[[str], bool], what: str, timeout_s: float = 30.0
                 ) -> str:
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if test(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"screen never showed {what}:\n{text}")


@pytest.fixture
def pane(tmp_path: Path) -> Iterator[Pane]:
    p = Pane(tmp_path / "tmux.sock")
    p.tmux("-f", "/dev/null", "new-session", "-d", "-s", "top", "-x", "120", "-y", "50",
           "env", "PS1=$ ", "TERM=xterm-256color", "bash", "--norc", "--noprofile")
    try:
        yield p
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            p.tmux("kill-server")


@pytest.fixture
def store() -> Iterator[EmbeddedStore]:
    settings = StoreSettings(listen="127.0.0.1:0", capacity=16 * MiB, metrics_port=0)
    with EmbeddedStore(settings) as running:
        yield running


def _command(store: EmbeddedStore, done: Path) -> str:
    argv = [sys.executable, "-m", "kvctl", "store", "top", "--master", store.address,
            "--metrics", metrics_url(store.server) or "", "--interval", "0.5s"]
    # The exit status, then whether the terminal is back in canonical mode with echo.
    return (f"{shlex.join(argv)}; echo \"exit=$?\" > {done}; "
            f"stty -a | tr ' ' '\\n' | grep -E '^-?(icanon|echo)$' >> {done}")


def _exited(done: Path, timeout_s: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = done.read_text().split() if done.exists() else []
        if len(lines) >= 3:
            return lines
        time.sleep(0.1)
    raise AssertionError("kvctl store top did not exit")


def _hit_ratio(screen: str) -> float | None:
    found = re.search(r"hit ratio (\d+(?:\.\d)?)%", screen)
    return float(found.group(1)) if found else None


def _row(screen: str, op: str) -> list[str]:
    """The cells of ``op``'s row in the operations table (empty when not on screen)."""
    for line in screen.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells and cells[0] == op and len(cells) == 4:
            return cells
    return []


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_live_view_shows_the_store_and_quits_cleanly(pane: Pane, store: EmbeddedStore,
                                                     tmp_path: Path, key: str) -> None:
    done = tmp_path / "done"
    pane.type(_command(store, done))
    first = pane.wait_for(lambda s: "kvctl store top: kvctl master" in s, "the header")
    assert store.address in first
    assert store.node.node_id in first
    assert "16 MiB" in first
    with StoreClient(store.address) as client:
        client.put("hot", b"h" * 4096)
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline:
            client.get("hot")
            with contextlib.suppress(ObjectNotFoundError):
                client.get("cold")
            screen = pane.screen()  # may catch a redraw half done: look again then
            if _hit_ratio(screen) is not None and _row(screen, "get"):
                break
    # One hit and one miss per round: a half, give or take a round cut by the interval.
    ratio = _hit_ratio(screen)
    assert ratio is not None, screen
    assert 40 <= ratio <= 60, screen
    assert "p99" in screen
    get = _row(screen, "get")
    assert get, screen
    assert float(get[1]) > 0  # ops/s
    assert get[2].endswith(("µs", "ms"))  # a p99 measured, in the table's unit
    pane.tmux("send-keys", "-t", "top", key)
    status = _exited(done)
    assert status[0] == "exit=0"
    assert set(status[1:]) == {"icanon", "echo"}  # cbreak undone, echo back
    # The alternate screen is gone: the shell's own lines and its prompt are back.
    after = pane.wait_for(lambda s: s.rstrip().endswith("$"), "the shell's prompt")
    assert "kvctl store top: kvctl master" not in after
    assert "operations" not in after
    assert "store top --master" in after
