"""Native libraries' own log lines go to a file, not to the operator's terminal.

Mooncake (glog: ``I1201 … client_metric.cpp:102] …``, and an ``E… Local segment descriptor
not found`` on every client start), NIXL and UCX write straight to file descriptors 1 and 2.
kvctl's stdout carries its results and its stderr its own messages, so while such a
library is loaded, fd 1 and fd 2 point at a log file and Python's ``sys.stderr`` (and the
logging handlers that wrote to it) at a duplicate of the terminal's stderr: kvctl's
``Error:``/``Warning:`` lines and progress bars still reach the terminal, the library's
lines reach the file. ``-v`` prints the file's path; a failing engine's message names it.

Files live in ``$KVCTL_LOG_DIR`` (default ``$XDG_STATE_HOME/kvctl/logs``, i.e.
``~/.local/state/kvctl/logs``), one per process and component, and only the newest
:data:`KEEP` are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_log = logging.getLogger("kvctl.nativelog")

#: Log files kept in the directory (older ones are removed when a new one is opened).
KEEP = 50


def log_dir() -> Path:
    """Where native logs go (``KVCTL_LOG_DIR``, else under ``XDG_STATE_HOME``)."""
    explicit = os.environ.get("KVCTL_LOG_DIR")
    if explicit:
        return Path(explicit)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvctl" / "logs"


def component_of(process_name: str) -> str:
    """A file-name-safe component name for a process called ``process_name``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", process_name).strip("-.") or "process"


def log_path(component: str, pid: int | None = None) -> Path:
    """The log file of ``component`` in process ``pid`` (default: this one)."""
    return log_dir() / f"{component}-{pid or os.getpid()}.log"


#: A file this module wrote: its name (``log_path``) and the first bytes of its header.
_OWN_NAME = re.compile(r"[A-Za-z0-9_.-]+-[0-9]+\.log")
_HEADER = b"--- "


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile (another kvctl pruning)
        return 0.0


def _ours(path: Path) -> bool:
    """Whether ``path`` is a regular file that starts with this module's header."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(_HEADER)) == _HEADER
    except OSError:
        return False
    finally:
        os.close(fd)


def _prune(directory: Path) -> None:
    # Only kvctl's own logs: KVCTL_LOG_DIR may name a directory other programs log to.
    with contextlib.suppress(OSError):
        files = sorted((p for p in directory.glob("*.log") if _OWN_NAME.fullmatch(p.name)),
                       key=_mtime, reverse=True)
        for old in files[KEEP:]:
            if _ours(old):
                with contextlib.suppress(OSError):
                    old.unlink()


def _open_log(component: str) -> tuple[int, Path] | None:
    path = log_path(component)
    fd = -1
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _prune(path.parent)
        # O_NONBLOCK: a FIFO planted at the path must not block the open (or the writes).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                     | os.O_NONBLOCK, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a private regular file (planted?)")
        os.set_blocking(fd, True)
        os.write(fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {component} pid "
                     f"{os.getpid()}\n".encode())
    except OSError as exc:  # unwritable, full or planted: the lines stay on the terminal
        if fd >= 0:
            os.close(fd)
        _log.debug("native log %s not opened (%s); native output stays on stderr", path, exc)
        return None
    return fd, path


def repoint_log_handlers(old: object, new: object) -> list[logging.StreamHandler]:  # type: ignore[type-arg]
    """Point the root logger's stream handlers that write to ``old`` at ``new``; returns
    them, to be pointed back (a handler keeps the stream it was made with, so one swap of
    ``sys.stderr`` does not move it)."""
    moved = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(new)
            moved.append(handler)
    return moved


@dataclasses.dataclass
class _KeptStderr:
    """Python's stderr moved onto a duplicate of the terminal's fd (see :func:`_keep_stderr`)."""

    terminal: io.TextIOWrapper
    old: Any
    moved: list[logging.StreamHandler]  # type: ignore[type-arg]

    def undo(self) -> None:
        self.terminal.flush()
        sys.stderr = self.old
        for handler in self.moved:
            handler.setStream(self.old)
        self.terminal.close()


def _keep_stderr(terminal_fd: int) -> _KeptStderr | None:
    """``sys.stderr``, and the log handlers on it, onto a stream over a duplicate of
    ``terminal_fd``, before fd 2 itself is redirected; ``None`` (nothing moved) under a
    test's in-memory capture, which is not fd 2."""
    if not _is_fd2(sys.stderr):
        return None
    terminal = os.fdopen(os.dup(terminal_fd), "w", buffering=1, encoding="utf-8",
                         errors="replace")
    old = sys.stderr
    sys.stderr = terminal
    return _KeptStderr(terminal, old, repoint_log_handlers(old, terminal))


def send_native_output_to_log(component: str) -> Path | None:
    """For the rest of this process: fd 1 and 2 to ``component``'s log file, Python's
    stderr to the terminal. Meant for a child process that hosts an engine (its results
    travel over a pipe, so its stdout is never the parent's). Returns the log's path
    (``None``: it could not be opened, and fd 1 now goes to stderr instead)."""
    sys.stdout.flush()
    sys.stderr.flush()
    opened = _open_log(component)
    if opened is None:
        os.dup2(2, 1)
        return None
    fd, path = opened
    _keep_stderr(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


class _Redirect:
    """The one process-wide redirection of fd 2, shared by every open user."""

    def __init__(self, path: Path, fd: int) -> None:
        sys.stderr.flush()
        self.path = path
        self.saved = os.dup(2)
        self.kept = _keep_stderr(self.saved)  # keep Python on the terminal
        os.dup2(fd, 2)
        os.close(fd)
        self.users = 0

    def undo(self) -> None:
        if self.kept is not None:
            self.kept.terminal.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        if self.kept is not None:
            self.kept.undo()


def _is_fd2(stream: object) -> bool:
    try:
        return stream.fileno() == 2  # type: ignore[attr-defined,no-any-return]
    except (AttributeError, OSError, ValueError):
        return False


_lock = threading.Lock()
#: The redirection in force, if any (one per process).
_active: dict[str, _Redirect] = {}


@contextlib.contextmanager
def native_output_to_log(component: str) -> Iterator[Path | None]:
    """While inside: fd 2 (where native libraries write) goes to ``component``'s log file;
    Python's stderr, and the logging handlers that used it, go to the terminal. Yields the
    log's path (``None``: it could not be opened, nothing changed). Nested and overlapping
    users share one redirection, undone when the last one leaves."""
    with _lock:
        if "fd2" not in _active:
            opened = _open_log(component)
            if opened is not None:
                _active["fd2"] = _Redirect(opened[1], opened[0])
                _log.info("native log lines of %s go to %s", component, opened[1])
        current = _active.get("fd2")
        if current is not None:
            current.users += 1
    try:
        yield None if current is None else current.path
    finally:
        if current is not None:
            with _lock:
                current.users -= 1
                if current.users == 0:
                    current.undo()
                    del _active["fd2"]
