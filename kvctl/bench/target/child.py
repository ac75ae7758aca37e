"""Benchmark targets in spawned child processes, with a pipe for "ready" and "stop".

The child function receives its arguments plus the child end of a pipe. It sends one
message when it is serving (or failed to), then calls :func:`serve_until_stopped`, which
returns when the parent says stop, the pipe closes, the parent dies or a day passes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable
from typing import Any

from kvctl.errors import UnavailableError
from kvctl.nativelog import component_of, log_path

_log = logging.getLogger("kvctl.bench")

#: A child exits on its own after this long, even if nobody stops it.
MAX_LIFETIME_S = 24 * 3600.0


def serve_until_stopped(conn: multiprocessing.connection.Connection) -> None:
    """Block (bounded) until the parent sends anything, closes the pipe or exits."""
    parent = os.getppid()
    deadline = time.monotonic() + MAX_LIFETIME_S
    with contextlib.suppress(EOFError, OSError):
        while time.monotonic() < deadline and os.getppid() == parent:
            if conn.poll(0.5):
                return


def _bootstrap(target: Callable[..., None], log_level: int, *args: Any) -> None:
    """Child entry: configure logging like the parent before anything else can.

    Some libraries (pyverbs) call ``logging.basicConfig`` at import time, which in a fresh
    child would set the root logger to INFO with their own format.
    """
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s",
                        force=True)
    target(*args)


class ChildProcess:
    """A spawned child running ``target(*args, conn)``.

    Args:
        target: module-level function (spawn pickles it by name).
        args: its arguments (picklable), the pipe end is appended.
        name: process name, also used in messages.
        hint: what to tell the operator when the child fails to start.
    """

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], *, name: str,
                 hint: str) -> None:
        self.target = target
        self.args = args
        self.name = name
        self.hint = hint
        self._proc: Any = None
        self._conn: multiprocessing.connection.Connection | None = None

    def start(self, timeout_s: float) -> Any:
        """Spawn the child and return its first message (bounded by ``timeout_s``).

        Raises:
            UnavailableError: the child sent nothing in time or exited first.
        """
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        proc = ctx.Process(target=_bootstrap,
                           args=(self.target, level, *self.args, child_conn),
                           name=self.name, daemon=True)
        proc.start()
        child_conn.close()
        self._proc, self._conn = proc, parent_conn
        try:
            if not parent_conn.poll(timeout_s):
                raise UnavailableError(f"{self.name} did not start within {timeout_s:g} s",
                                       self.hint)
            return parent_conn.recv()
        except (EOFError, OSError) as exc:
            note = self.log_note()
            self.stop()
            raise UnavailableError(
                f"{self.name} exited during start-up (exit code {proc.exitcode}){note}",
                self.hint) from exc
        except BaseException:
            self.stop()
            raise

    def log_note(self) -> str:
        """`` (its native log: PATH)`` when the child wrote one (engines do), else ``""``."""
        proc = self._proc
        if proc is None or proc.pid is None:
            return ""
        path = log_path(component_of(self.name), proc.pid)
        return f" (its native log: {path})" if path.exists() else ""

    def stop(self) -> None:
        """Ask the child to stop and reap it (killed after 15 s). Safe to call twice."""
        conn, self._conn = self._conn, None
        proc, self._proc = self._proc, None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send("stop")
            conn.close()
        if proc is not None:
            proc.join(15)
            if proc.is_alive():
                _log.warning("%s did not stop; killing it", self.name)
                proc.kill()
                proc.join(5)
