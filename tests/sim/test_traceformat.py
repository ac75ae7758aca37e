"""The trace request type, the format registry and the bounded line reader."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.sim.traceformat import (
    TraceInputError,
    TraceRequest,
    bounded_lines,
    known_trace_formats,
    open_trace,
    trace_format,
)


def test_mooncake_is_known_with_512_tokens_per_id() -> None:
    assert "mooncake" in known_trace_formats()
    fmt = trace_format("mooncake")
    assert fmt.block_tokens == 512
    assert fmt.description


def test_unknown_format_lists_the_known_ones() -> None:
    with pytest.raises(UsageError) as err:
        trace_format("nope")
    assert "nope" in err.value.cause
    assert err.value.hint is not None
    assert "mooncake" in err.value.hint


def test_request_defaults() -> None:
    req = TraceRequest(1, 0.0, 10, 0, [1])
    assert req.instance is None
    assert req.block_tokens is None


def test_bounded_lines_numbers_lines_and_strips_newlines() -> None:
    stream = io.BytesIO(b"a\nbb\n\nlast")
    assert list(bounded_lines(stream, "f")) == [(1, b"a"), (2, b"bb"), (3, b""), (4, b"last")]


def test_a_line_past_the_bound_is_refused_without_reading_it_whole() -> None:
    class Counting(io.BytesIO):
        most = 0

        def readline(self, size: int | None = -1, /) -> bytes:
            Counting.most = max(Counting.most, size if size is not None else -1)
            return super().readline(size)

    stream = Counting(b"ok\n" + b"x" * 1000 + b"\n")
    with pytest.raises(TraceInputError) as err:
        list(bounded_lines(stream, "big.jsonl", max_line_bytes=100))
    assert "big.jsonl line 2" in err.value.cause
    assert "100 bytes" in err.value.cause
    assert err.value.hint
    assert 0 < Counting.most <= 101


def test_exactly_the_bound_passes() -> None:
    stream = io.BytesIO(b"x" * 100 + b"\n" + b"y" * 100)
    assert [n for n, _ in bounded_lines(stream, "f", max_line_bytes=100)] == [1, 2]


def test_gz_is_decompressed_and_a_truncated_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b"one\ntwo\n" * 1000))
    with open_trace(path) as stream:
        assert sum(1 for _ in bounded_lines(stream, path)) == 2000
    path.write_bytes(path.read_bytes()[:-20])
    with open_trace(path) as stream, pytest.raises(TraceInputError) as err:
        list(bounded_lines(stream, path))
    assert str(path) in err.value.cause
    assert err.value.hint


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        open_trace(tmp_path / "absent.jsonl")
    assert "absent.jsonl" in err.value.cause
