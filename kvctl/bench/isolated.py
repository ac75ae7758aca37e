"""One engine's sweep in a child process of its own, its rows streamed back to kvctl.

Foreign engines load native libraries that must stay out of kvctl's own process: NIXL 1.5.1
crashes at exit in any process that created an agent (exit 139), which would otherwise
become ``kvctl bench transfer``'s exit code, and Mooncake's teardown is its own business too.
So the session runs such a driver (``EngineDriver.isolated``) in a spawned child that opens
the driver, runs :class:`~kvctl.bench.runner.SweepRunner` and sends every progress event, row
and skip back over a pipe; the parent renders them with the other engines' rows. The child
ends with ``os._exit`` once its driver is closed and its last message sent, so nothing of
the engine runs at interpreter exit; a child that dies before it said "done" is an error
naming its exit code.

A failure in the child comes back as the same :class:`~kvctl.errors.KvctlError` subclass,
cause, hint and exit code (an :class:`~kvctl.bench.verify.IntegrityError` stays one).
Baselines measured once per run (memcpy, loopback TCP) are measured by the parent and handed
in, so every engine's rows share them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from kvctl.bench.engines.base import DriverPlan, driver_class
from kvctl.bench.engines.foreign import stdout_to_stderr
from kvctl.bench.linerate import LineRate, LineRates
from kvctl.bench.result import ResultRow
from kvctl.bench.runner import ProgressEvent, Skipped, SweepRunner
from kvctl.bench.spec import Sweep
from kvctl.errors import ExitCode, KvctlError, UnavailableError
from kvctl.nativelog import component_of, log_path

_log = logging.getLogger("kvctl.bench")

#: What a child reports: a configuration starts, a row is measured, something was skipped.
Event = ProgressEvent | ResultRow | Skipped
#: Seconds between liveness checks of the child while waiting for its next message.
_POLL_S = 0.5


class EngineProcessError(KvctlError):
    """An isolated engine's process died or failed outside kvctl's own errors."""

    exit_code = ExitCode.INTERNAL


@dataclasses.dataclass(frozen=True)
class IsolatedJob:
    """What the child runs.

    Attributes:
        engine: the engine's name.
        sweep / plan: as for an in-process driver.
        nic_rates: line rate of cross-host paths by medium.
        run_id: mixed into verification patterns (the same for every engine of a run).

    The child measures its rows' line rates itself (:mod:`kvctl.bench.linerate`: with each
    row's shape, right after it), on the same host as the parent.
    """

    engine: str
    sweep: Sweep
    plan: DriverPlan
    nic_rates: Mapping[str, LineRate]
    run_id: int


# --------------------------------------------------------------------------- child side

def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != parent:
            os._exit(1)  # the parent is gone: nobody reads our rows


def _run(job: IsolatedJob, conn: multiprocessing.connection.Connection) -> None:
    cls = driver_class(job.engine)
    reason = cls.unavailable_reason()
    if reason is not None:
        conn.send(Skipped(cls.name, None, f"engine {cls.name} unavailable: {reason}",
                          cls.install_hint))
        return
    with cls() as driver:
        try:
            driver.start(job.plan)
        except UnavailableError as exc:
            conn.send(Skipped(cls.name, None, exc.cause, exc.hint))
            return
        runner = SweepRunner(driver, job.sweep, line_rates=LineRates(),
                             nic_rates=job.nic_rates, run_id=job.run_id, on_progress=conn.send)
        for row in runner.rows():
            conn.send(row)
        for skip in runner.skipped:
            conn.send(skip)


def _child_main(job: IsolatedJob, log_level: int,
                conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the spawned engine process; never returns (``os._exit``)."""
    stdout_to_stderr()  # rows travel over the pipe; stdout is the parent's results
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s",
                        force=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True,
                     name="kvctl-parent-watch").start()
    code = 0
    try:
        _run(job, conn)
        conn.send(("done",))
    except KvctlError as exc:
        kind = type(exc)
        conn.send(("error", kind.__module__, kind.__qualname__, exc.cause, exc.hint,
                   int(exc.exit_code)))
    except Exception as exc:  # noqa: BLE001 - a bug or an engine's own error, reported whole
        conn.send(("crash", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent stops too
        code = 1
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # skip the interpreter's exit: NIXL crashes in it


# --------------------------------------------------------------------------- parent side

def _rebuild(module: str, qualname: str, cause: str, hint: str | None,
             exit_code: int) -> KvctlError:
    """The child's error as the same kvctl error type (plain KvctlError if unknown)."""
    cls: type[KvctlError] = KvctlError
    if module.startswith("kvctl.") and "." not in qualname:
        with contextlib.suppress(ImportError, AttributeError):
            found = getattr(importlib.import_module(module), qualname)
            if isinstance(found, type) and issubclass(found, KvctlError):
                cls = found
    error = cls.__new__(cls)
    KvctlError.__init__(error, cause, hint)
    error.exit_code = ExitCode(exit_code)
    return error


def run_isolated(job: IsolatedJob) -> Iterator[Event]:
    """Run ``job`` in a spawned child, yielding its events as they come.

    The child is stopped (killed if need be) when the iterator finishes or is closed.

    Raises:
        KvctlError: the child's own error, as raised there.
        EngineProcessError: the child died before it finished, or crashed.
    """
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    level = logging.getLogger().getEffectiveLevel()
    # Not a daemon: a loopback driver spawns its own target process from the child.
    proc = ctx.Process(target=_child_main, args=(job, level, child_conn),
                       name=f"kvctl bench {job.engine}", daemon=False)
    proc.start()
    child_conn.close()
    rows = 0
    finished = False
    try:
        while True:
            if not parent_conn.poll(_POLL_S):
                if proc.is_alive():
                    continue
                if parent_conn.poll(0):  # it wrote its last words, then exited
                    continue
                raise _died(job.engine, proc, rows)
            try:
                message: Any = parent_conn.recv()
            except (EOFError, OSError):
                proc.join(5)
                raise _died(job.engine, proc, rows) from None
            if isinstance(message, ProgressEvent | ResultRow | Skipped):
                rows += isinstance(message, ResultRow)
                yield message
            elif message[0] == "done":
                finished = True
                return
            elif message[0] == "error":
                raise _rebuild(*message[1:])
            else:
                _log.debug("%s engine process traceback:\n%s", job.engine, message[2])
                raise EngineProcessError(
                    f"the {job.engine} engine failed in its process: {message[1]}",
                    "rerun with -v (KVCTL_DEBUG=1 for the traceback)")
    finally:
        parent_conn.close()
        if not finished and proc.is_alive():
            proc.terminate()  # we stopped reading (an error, Ctrl-C): it stops too
        proc.join(15)
        if proc.is_alive():
            _log.warning("the %s engine process did not stop; killing it", job.engine)
            proc.kill()
            proc.join(5)


def _died(engine: str, proc: Any, rows: int) -> EngineProcessError:
    code = proc.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    log = log_path(component_of(f"kvctl bench {engine}"), proc.pid)
    where = f"read its native log {log}" if log.exists() else "rerun with -v to see its log"
    return EngineProcessError(f"the {engine} engine's process {how} after {rows} row(s), "
                              "before it finished",
                              f"{where}; a crash inside the engine's library is the engine's "
                              "bug")
