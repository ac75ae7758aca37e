"""Mooncake's trace format: JSON lines ``{timestamp, input_length, output_length, hash_ids}``.

As published with the FAST'25 paper (github.com/kvcache-ai/Mooncake, ``FAST25-release/
traces/``) and replayed by NVIDIA Dynamo's data generator and aiperf: one request a line,
``timestamp`` in milliseconds, ``hash_ids`` one id per 512-token block, prefix-chained
(equal ids at the same position mean an equal prefix). ``output_length`` may be absent (then
0); other keys are ignored. A gzip file (by its magic bytes, whatever its name) is read
through gzip.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

import msgspec

from kvctl.sim.traceformat import (
    TraceRequest,
    bad_record,
    bounded_lines,
    open_trace,
    register_trace_format,
)

_HINT = ('each line must be one JSON object like {"timestamp": 0, "input_length": 6758, '
         '"output_length": 500, "hash_ids": [0, 1, 2]}')


#: Longest input or output a request may have, tokens (an int64, as every engine counts):
#: 10^400 passed msgspec and overflowed the float mean after the replay.
MAX_LENGTH = 2**63 - 1


class _Record(msgspec.Struct):
    timestamp: float
    input_length: int
    hash_ids: list[int]
    output_length: int = 0


@register_trace_format(
    "mooncake", block_tokens=512,
    description="Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids "
                "(512 tokens per id); .gz too",
)
def read_mooncake(path: Path) -> Iterator[TraceRequest]:
    """The requests of a Mooncake JSONL trace, in file order (blank lines are skipped, and a
    UTF-8 byte-order mark at the start).

    Raises:
        TraceInputError: a line is not JSON, misses a field, has a field of the wrong type or
            a negative length or one past :data:`MAX_LENGTH`, or is longer than the line bound.
    """
    decode = msgspec.json.Decoder(_Record).decode
    with open_trace(path) as stream:
        for number, data in bounded_lines(stream, path):
            if number == 1 and data.startswith(codecs.BOM_UTF8):  # as Windows tools write
                data = data[len(codecs.BOM_UTF8):]
            try:
                record = decode(data)
            except msgspec.DecodeError as exc:
                if not data.strip():
                    continue
                raise bad_record(path, number, _problem(exc), _HINT) from None
            except RecursionError:  # msgspec skips an unknown field recursively
                raise bad_record(path, number, "JSON nested too deeply to read", _HINT
                                 ) from None
            if record.input_length < 0 or record.output_length < 0:
                which = "input_length" if record.input_length < 0 else "output_length"
                raise bad_record(path, number, f"{which} {getattr(record, which)} is negative",
                                 "lengths are token counts, 0 or more")
            if max(record.input_length, record.output_length) > MAX_LENGTH:
                which = ("input_length" if record.input_length > MAX_LENGTH
                         else "output_length")
                raise bad_record(path, number, f"{which} is more than {MAX_LENGTH:,} tokens",
                                 "lengths are token counts of one request: check the record")
            yield TraceRequest(number, record.timestamp, record.input_length,
                               record.output_length, record.hash_ids)


def _problem(exc: msgspec.DecodeError) -> str:
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        return f"bad record: {text}"
    return f"not a JSON object ({text})"
