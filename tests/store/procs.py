"""Store servers as processes, as in production: ``python -m kvctl store ARGS --json``.

The first JSON document a server prints is its address card (``.card``). Its stderr goes
to a log file, never a pipe (a pipe nobody reads fills up and stops a chatty server);
a server that exits before its card fails the test with the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

#: the node timeout every test server runs with (KVCTL_STORE_NODE_TIMEOUT), seconds
NODE_TIMEOUT_S = 1.5


class StoreProc:
    """One ``kvctl store`` server.

    Args:
        log: file its stderr is appended to.
        args: ``kvctl store`` arguments (``master --listen ...``).
        env: extra environment.
        card_within_s: how long the card may take (a restore of millions of objects
            comes first).
        stop_within_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, log: Path, *args: str, env: dict[str, str] | None = None,
                 card_within_s: float = 30.0, stop_within_s: float = 15.0) -> None:
        self.log = log
        self.args = args
        self.stop_within_s = stop_within_s
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvctl", "store", *args, "--json"],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                env={**os.environ, "KVCTL_STORE_NODE_TIMEOUT": str(NODE_TIMEOUT_S),
                     **(env or {})})
        self.card = self._read_card(card_within_s)

    def _read_card(self, within_s: float) -> dict[str, object]:
        assert self.proc.stdout is not None
        text = ""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                pytest.fail(f"kvctl store {' '.join(self.args)} exited: "
                            f"{self.log.read_text(errors='replace')[-2000:]}")
            text += line
            try:
                card: dict[str, object] = json.loads(text)
                return card
            except ValueError:
                continue
        pytest.fail(f"no address card within {within_s:g} s")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        cleanup_shm(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_within_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        cleanup_shm(self.proc.pid)


def cleanup_shm(pid: int) -> None:
    """Unlink the shared memory of server ``pid`` (a SIGKILLed node cannot)."""
    for path in Path("/dev/shm").glob(f"kvctl-*-{pid}-*"):
        path.unlink(missing_ok=True)


class Servers(list[StoreProc]):
    """The servers a test started (each logs to ``logs/ROLE-N.log``); :meth:`stop_all`
    stops them in reverse order."""

    def __init__(self, logs: Path) -> None:
        super().__init__()
        self.logs = logs

    def start(self, *args: str, env: dict[str, str] | None = None,
              card_within_s: float = 30.0, stop_within_s: float = 15.0) -> StoreProc:
        proc = StoreProc(self.logs / f"{args[0]}-{len(self)}.log", *args, env=env,
                         card_within_s=card_within_s, stop_within_s=stop_within_s)
        self.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self):
            proc.stop()


def servers(logs: Path) -> Iterator[Servers]:
    """For a fixture: :class:`Servers` logging under ``logs``, all stopped at the end."""
    started = Servers(logs)
    try:
        yield started
    finally:
        started.stop_all()
