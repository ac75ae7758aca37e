"""The ``--record`` file: every message kvctl received, as it came, one JSON line each.

The first line is a header ``{"format": "kvctl.kv-events", "version": 1, "profile": ...,
"block_size": ...}``; then one line per message::

    {"instance": "a", "recv_ts": 1767225600.123, "seq": 7, "replayed": false,
     "topic": "", "payload": "<base64 of the msgpack payload>"}

``seq`` is ``null`` and ``frames`` (each base64) replaces ``topic``/``payload`` for a
message that was not ``(topic, seq, payload)``. The payload bytes are the publisher's own,
untouched: a record replays exactly (``kvctl sim trace --format kv-events FILE``).
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

from kvctl.errors import UnavailableError, UsageError

FORMAT = "kvctl.kv-events"
VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class RecordedMessage:
    """One line of a record file.

    Attributes:
        line: its 1-based line number.
        instance: the instance that sent it.
        recv_ts: when kvctl received it (seconds since the epoch).
        seq: its sequence number (``None``: a malformed message).
        payload: the payload bytes (``b""`` for a malformed message).
        replayed: it came from the replay endpoint.
        frames: a malformed message's frames.
    """

    line: int
    instance: str
    recv_ts: float
    seq: int | None
    payload: bytes
    replayed: bool = False
    frames: tuple[bytes, ...] = ()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Recorder:
    """Writes a record file; ``close()`` is safe twice."""

    def __init__(self, path: Path, *, profile: str, block_size: int) -> None:
        try:
            self._file: IO[str] | None = path.open("w", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write the record file {path}: {exc.strerror or exc}",
                             "choose a writable --record path") from exc
        self.path = path
        self.messages = 0
        self._write({"format": FORMAT, "version": VERSION, "profile": profile,
                     "block_size": block_size})

    def _write(self, doc: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(doc, separators=(",", ":")) + "\n")
        except OSError as exc:
            raise UnavailableError(f"cannot write the record file {self.path}: "
                                   f"{exc.strerror or exc}", "make room, or stop --record"
                                   ) from exc

    def message(self, instance: str, recv_ts: float, seq: int, topic: bytes, payload: bytes,
                *, replayed: bool = False) -> None:
        """Record one well-formed message."""
        self.messages += 1
        self._write({"instance": instance, "recv_ts": round(recv_ts, 6), "seq": seq,
                     "replayed": replayed, "topic": _b64(topic), "payload": _b64(payload)})

    def malformed(self, instance: str, recv_ts: float, frames: list[bytes]) -> None:
        """Record a message that was not ``(topic, seq, payload)``."""
        self.messages += 1
        self._write({"instance": instance, "recv_ts": round(recv_ts, 6), "seq": None,
                     "frames": [_b64(f) for f in frames]})

    def close(self) -> None:
        """Flush and close the file."""
        f, self._file = self._file, None
        if f is not None:
            f.close()


def _bad(path: Path, line: int, problem: str) -> UsageError:
    return UsageError(f"{path} line {line}: {problem}",
                      "give a file written by kvctl verify-keys watch ENDPOINT --record FILE")


#: Longest line :func:`read_record` accepts (a longer one is an error, never read whole).
MAX_LINE_BYTES = 64 * 2**20


def read_record(path: Path) -> Iterator[RecordedMessage]:
    """The messages of record file ``path`` (``.gz`` too), in file order.

    Raises:
        UsageError: not a record file, or a malformed or overlong line (named).
    """
    try:
        f: BinaryIO = (cast(BinaryIO, gzip.open(path, "rb")) if path.suffix == ".gz"  # noqa: SIM115
                       else path.open("rb"))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}",
                         "give the file --record wrote") from exc
    with f:
        number = 0
        while True:
            number += 1
            try:
                text = f.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a corrupt .gz
                raise _bad(path, number, f"cannot read ({exc})") from exc
            if not text:
                return
            if len(text) > MAX_LINE_BYTES:
                raise _bad(path, number, f"the line is longer than {MAX_LINE_BYTES:,} bytes")
            try:
                doc = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _bad(path, number, f"not JSON ({exc})") from None
            except RecursionError:
                raise _bad(path, number, "JSON nested too deeply to read") from None
            if not isinstance(doc, dict):
                raise _bad(path, number, "not a JSON object")
            if number == 1:
                if doc.get("format") != FORMAT:
                    raise _bad(path, 1, f"no {FORMAT} header")
                if doc.get("version") != VERSION:
                    raise _bad(path, 1, f"record version {doc.get('version')!r}; this kvctl "
                               f"reads version {VERSION}")
                continue
            yield _message(path, number, doc)


def _message(path: Path, number: int, doc: dict[str, Any]) -> RecordedMessage:
    try:
        instance, recv_ts, seq = doc["instance"], float(doc["recv_ts"]), doc["seq"]
        if not isinstance(instance, str) or (seq is not None and not isinstance(seq, int)):
            raise TypeError("instance must be text and seq an integer or null")
        if seq is None:
            frames = tuple(base64.b64decode(f, validate=True) for f in doc["frames"])
            return RecordedMessage(number, instance, recv_ts, None, b"", frames=frames)
        payload = base64.b64decode(doc["payload"], validate=True)
        return RecordedMessage(number, instance, recv_ts, seq, payload,
                               bool(doc.get("replayed", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(path, number, f"not a recorded message ({exc})") from None
