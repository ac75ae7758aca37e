"""Rendering for people and scripts (CLI layer: the library never imports this module).

- Tables and progress go through Rich; progress and diagnostics go to stderr so stdout
  stays clean for ``--json`` and pipes.
- ``--json`` prints exactly one JSON document on stdout with ``schema_version`` and ``kind``;
  a document that judges carries ``ok`` and ``checks`` (docs/json.md, docs/schemas/).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from kvctl import SCHEMA_VERSION
from kvctl.errors import KvctlError, UnavailableError
from kvctl.nativelog import repoint_log_handlers
from kvctl.units import with_deprecated_keys

#: Columns of tables written to a pipe or file.
PIPE_WIDTH = 160


def to_jsonable(obj: Any) -> Any:
    """Convert dataclasses, enums, paths, bytes, sets and mappings into JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        items = [to_jsonable(v) for v in obj]
        return sorted(items, key=str) if isinstance(obj, set | frozenset) else items
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    return obj


#: Characters a terminal acts on rather than prints: every C0 control (tab and newline too),
#: DEL, every C1 control (CSI, OSC, DCS, ST... as single code points), and the Unicode
#: bidirectional overrides and isolates that reorder what follows them on screen.
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(value: object) -> str:
    """``value`` as text a terminal cannot act on: every control character (ESC, so any
    CSI/OSC/DCS sequence; C1; DEL; tab and newline; bidi overrides) written out visibly as a
    Python-style escape (``\\x1b``, ``\\x9d``, ``\\u202e``), everything else as it is.

    Use it for every table cell and log line that carries text someone else wrote (metadata
    keys and values, host records, job errors): JSON output escapes these already.
    """
    return _CONTROL_RE.sub(_escape, str(value))


def _safe_lines(value: str) -> str:
    return "\n".join(safe_text(line) for line in value.split("\n"))


def safe_cell(value: object, style: str = "") -> Text:
    """``value`` as a Rich cell: :func:`safe_text`, and never parsed as Rich markup (so a
    foreign ``[link=...]`` cannot become an OSC 8 hyperlink either)."""
    return Text(safe_text(value), style=style)


def safe_markup(value: object) -> str:
    """``value`` for a Rich string that is parsed as markup (``Output.warn``/``info``):
    :func:`safe_text`, with Rich's brackets escaped."""
    return escape(safe_text(value))


class SafeFormatter(logging.Formatter):
    """A log formatter whose messages go through :func:`safe_text` (a traceback it appends
    keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = safe_text(record.message)
        return super().formatMessage(record)


def safe_log_lines(logger: logging.Logger) -> None:
    """Give each of ``logger``'s handlers a :class:`SafeFormatter` with its format kept."""
    for handler in logger.handlers:
        fmt = handler.formatter._fmt if handler.formatter is not None else None
        handler.setFormatter(SafeFormatter(fmt))


#: A document's ``kind``: the command's words, dotted (``bench.transfer``, ``doctor.env``);
#: words of one command keep their hyphen (``keys.store-check``). docs/json.md lists them.
KIND_RE = re.compile(r"[a-z]+(?:\.[a-z][a-z-]*)+")


def json_document(kind: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The envelope every ``--json`` output uses."""
    if not KIND_RE.fullmatch(kind):
        raise ValueError(f"JSON kind {kind!r} is not dotted lowercase words")
    body = with_deprecated_keys(to_jsonable(payload))  # old unit-less names, one release
    return {"schema_version": SCHEMA_VERSION, "kind": kind, **body}


class Output:
    """Where a command writes: a stdout console for results, a stderr console for the rest."""

    def __init__(self, *, quiet: bool = False, verbose: int = 0, json_mode: bool = False) -> None:
        self.quiet = quiet
        self.verbose = verbose
        self.json_mode = json_mode
        # Piped output (logs, CI) gets a wide page instead of Rich's 80 columns, so tables
        # stay one row per line; COLUMNS still wins when set.
        width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPE_WIDTH
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)
        # stderr=True: resolved at each write, so it follows sys.stderr when kvctl.nativelog
        # moves native output off fd 2 (and a test capture that replaces sys.stderr).
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    def emit_json(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Print one JSON document on stdout."""
        self.write_json(json_document(kind, payload))

    def write_json(self, document: Mapping[str, Any]) -> None:
        """Print ``document`` as it is: a file format with its own envelope (a key manifest).

        Raises:
            UnavailableError: stdout cannot take it (a full disk, an I/O error).
        """
        text = json.dumps(to_jsonable(document), indent=2) + "\n"
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise  # the reader left (| head): the CLI ends quietly
        except OSError as exc:
            raise UnavailableError(
                f"cannot write the JSON document to stdout: {exc.strerror or exc}",
                "make room where stdout goes, or send it elsewhere") from exc

    def print(self, *renderables: Any) -> None:
        """Print results for people (suppressed in JSON mode)."""
        if not self.json_mode:
            self.console.print(*renderables)

    def line(self, text: Any) -> None:
        """One line for people that is never wrapped or cut, whatever the terminal's width
        (a server's first line: people copy the address out of it)."""
        if not self.json_mode:
            self.console.print(text, soft_wrap=True)

    def info(self, message: str) -> None:
        """A status line on stderr, hidden by ``--quiet`` and in JSON mode."""
        if not self.quiet and not self.json_mode:
            self.err.print(message)

    def debug(self, message: str) -> None:
        """A detail shown only with ``-v``."""
        if self.verbose > 0:
            self.err.print(f"[dim]{message}[/dim]")

    def warn(self, message: str) -> None:
        """A warning on stderr (kept in JSON mode, hidden by ``--quiet``)."""
        if not self.quiet:
            self.err.print(f"[yellow]Warning:[/yellow] {message}")

    @contextmanager
    def progress(self, description: str, total: float | None = None) -> Iterator[Progress]:
        """A live progress bar on stderr; disabled when quiet, in JSON mode or not a TTY."""
        disable = self.quiet or self.json_mode or not self.err.is_terminal
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn()]
        before = sys.stderr
        with Progress(*columns, console=self.err, transient=True, disable=disable) as bar:
            bar.add_task(description, total=total)
            # Rich catches writes to sys.stderr and prints them above the bar; logging's
            # handlers hold the stream they were made with, so point them there too, or a
            # warning lands glued to the bar's line.
            moved = repoint_log_handlers(before, sys.stderr) if sys.stderr is not before \
                else []
            try:
                yield bar
            finally:
                for handler in moved:
                    handler.setStream(before)


def print_error(err: KvctlError) -> None:
    """Render a library error as ``Error: ...`` / ``Hint: ...`` on stderr (no markup parsing)."""
    sys.stderr.write(f"Error: {_safe_lines(err.cause)}\n")
    if err.hint:
        sys.stderr.write(f"Hint: {_safe_lines(err.hint)}\n")
    sys.stderr.flush()
