"""Helpers for the metadata tests: bounded polling and a child process holding a lease."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float:
    """Poll ``predicate`` until true; return the seconds it took. Fails after ``timeout_s``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next stdout line of ``proc``, waiting at most ``timeout_s``."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stream = proc.stdout
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s).strip()
    except queue.Empty:
        raise AssertionError(f"no output from {proc.args} within {timeout_s} s") from None


PUBLISHER = """
import sys, time
from kvctl.metadata import LeaseKeeper, open_metadata
url, key, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = open_metadata(url)
keeper = LeaseKeeper(client, ttl_s=ttl).start()
keeper.publish(key, b"alive")
print("ready", flush=True)
time.sleep(60)
"""


def start_publisher(url: str, key: str, ttl_s: float) -> subprocess.Popen[str]:
    """A child python that publishes ``key`` under a kept-alive lease, then waits to be killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, url, key, str(ttl_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    line = read_line(proc, 20.0)
    if line != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"publisher failed: {line!r} {err[-2000:]}")
    return proc
