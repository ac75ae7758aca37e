"""Trace requests and the registry of trace formats (``kvctl sim trace --format NAME``).

A *trace* is a sequence of :class:`TraceRequest` in arrival order: when a request arrived,
how many tokens it prefilled and decoded, and its prefix-chained block ids (equal ids mean
an equal prefix up to and including that block, as in Mooncake's published traces). A
format is a reader, ``Path -> Iterator[TraceRequest]``, registered by name with the tokens
per block id it implies::

    @register_trace_format("mooncake", block_tokens=512, description="...")
    def read_mooncake(path: Path) -> Iterator[TraceRequest]: ...

Readers stream: they yield one request at a time and never hold the file, so memory grows
with what the replay keeps, not with the trace. They report a malformed record with
:func:`bad_record` (a :class:`TraceInputError` naming the file and the record), and read
lines with :func:`bounded_lines` so that a huge line is refused instead of read whole.

The modules that define formats are imported by name from :data:`_FORMAT_MODULES` the first
time a format is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib
import io
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvctl.errors import UsageError

#: Modules whose import registers trace formats (imported lazily, in this order).
_FORMAT_MODULES: tuple[str, ...] = ("kvctl.sim.trace_mooncake", "kvctl.sim.trace_kvevents")

#: Longest record line a reader accepts, bytes (a longer one is an error, never read whole).
MAX_LINE_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        line: 1-based record number in the source (a line of a JSONL file), for messages.
        timestamp_ms: arrival, milliseconds from any origin; non-decreasing in a trace.
        input_length: prefill tokens of the request.
        output_length: decoded tokens (0 when the source does not say).
        hash_ids: prefix-chained block ids, one per ``block_tokens`` tokens of the input.
        instance: the instance that served it, where the source says so.
        block_tokens: tokens per id when the record itself says (KV events' ``block_size``);
            ``None``: the format's default or ``--block-tokens``.
    """

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: Sequence[int]
    instance: str | None = None
    block_tokens: int | None = None


TraceReader = Callable[[Path], Iterator[TraceRequest]]


@dataclasses.dataclass(frozen=True)
class TraceFormat:
    """A registered trace format.

    Attributes:
        name: what ``--format`` takes.
        block_tokens: default tokens per block id; ``None`` when the records carry it.
        description: one line for help and errors.
        reader: yields the requests of a file, in file order.
    """

    name: str
    block_tokens: int | None
    description: str
    reader: TraceReader


class TraceInputError(UsageError):
    """A trace file is malformed: the message names the file and the record (line)."""


def bad_record(path: Path | str, line: int, problem: str, hint: str) -> TraceInputError:
    """The error for record ``line`` of ``path``: ``"<path> line <n>: <problem>"``."""
    return TraceInputError(f"{path} line {line}: {problem}", hint)


_FORMATS: dict[str, TraceFormat] = {}


def register_trace_format(
    name: str, *, block_tokens: int | None, description: str
) -> Callable[[TraceReader], TraceReader]:
    """Decorator: make ``reader`` available as ``--format name``.

    Raises:
        UsageError: ``block_tokens`` is not positive (a programming error in a format).
    """
    if block_tokens is not None and block_tokens <= 0:
        raise UsageError(f"trace format {name!r}: block_tokens {block_tokens} is not positive",
                         "register the format with a positive block_tokens or None")

    def decorate(reader: TraceReader) -> TraceReader:
        _FORMATS[name] = TraceFormat(name, block_tokens, description, reader)
        return reader

    return decorate


@functools.cache
def _load() -> None:
    for module in _FORMAT_MODULES:
        importlib.import_module(module)


def known_trace_formats() -> list[str]:
    """The names ``--format`` accepts, sorted."""
    _load()
    return sorted(_FORMATS)


def trace_format(name: str) -> TraceFormat:
    """The format called ``name``.

    Raises:
        UsageError: unknown name; the hint lists the known ones.
    """
    _load()
    try:
        return _FORMATS[name]
    except KeyError:
        raise UsageError(f"unknown trace format {name!r}",
                         f"give --format one of: {', '.join(sorted(_FORMATS))}") from None


class _GzipTrace(gzip.GzipFile):
    """gzip over an open binary stream, closing the stream with it."""

    def __init__(self, raw: io.BufferedReader) -> None:
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


#: The first bytes of every gzip file.
GZIP_MAGIC = b"\x1f\x8b"


def open_trace(path: Path) -> io.BufferedIOBase:
    """``path`` opened for binary reading, decompressed when it is gzip: when it starts with
    gzip's magic bytes, whatever its name (a ``.gz`` name on a plain file reads it plain, and
    a compressed file named ``.jsonl`` is still decompressed).

    Raises:
        UsageError: the file cannot be opened.
    """
    try:
        stream = path.open("rb")
        try:
            head = stream.peek(len(GZIP_MAGIC))[:len(GZIP_MAGIC)]
        except BaseException:
            stream.close()
            raise
        if head != GZIP_MAGIC:
            return stream
        return _GzipTrace(stream)  # on the stream already open: a pipe cannot be reopened
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror or exc}",
                         "give the path of a readable trace file") from exc


def bounded_lines(
    stream: io.BufferedIOBase, path: Path | str, *, max_line_bytes: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """``(line number, line without its newline)`` for each line of ``stream``, 1-based.

    A line is never read past ``max_line_bytes`` (default :data:`MAX_LINE_BYTES`): a longer
    one raises instead.

    Raises:
        TraceInputError: a line is longer than ``max_line_bytes``, or the stream fails
            (e.g. a truncated or corrupt ``.gz``).
    """
    if max_line_bytes is None:
        max_line_bytes = MAX_LINE_BYTES
    number = 0
    while True:
        number += 1
        try:
            data = stream.readline(max_line_bytes + 1)
        except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a corrupt .gz
            raise bad_record(path, number, f"cannot read: {exc}",
                             "check that the file is complete and not corrupt (a .gz: gzip -t)"
                             ) from exc
        if not data:
            return
        if data[-1:] == b"\n":
            data = data[:-1]
        elif len(data) > max_line_bytes:
            raise bad_record(
                path, number, f"the line is longer than {max_line_bytes:,} bytes",
                "a trace has one request a line: check that the file is JSONL (not one JSON "
                "document) and not corrupt",
            )
        yield number, data
