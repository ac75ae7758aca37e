"""A target's error text reaches bench rows as first_error: it is one printable line.

A kvctl target's error reply carries up to 64 KiB of its own text; the engine's first
cause repeated it whole into the row's ``first_error`` (a CSV row that must stay one line,
the table) and the ``Error:`` line, newlines and terminal escapes included.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvctl.bench.engines.base import BatchOutcome
from kvctl.bench.linerate import LineRates
from kvctl.bench.runner import MAX_CAUSE_CHARS, SweepRunner
from kvctl.bench.spec import BenchSettings, build_sweep
from kvctl.errors import CheckFailedError

HOSTILE = ("target 127.0.0.1:9 refused: line one\nline two\r\n\x1b[2J\x1b]0;owned\x07"
           + "x" * 70000)


class Refusing:
    def run_batch(self, *_args: Any) -> BatchOutcome:
        return BatchOutcome(errors=4, cause=HOSTILE)


def _clean(text: str) -> None:
    assert text.isprintable(), repr(text[:200])
    assert "\x1b" not in text


def test_a_hostile_cause_reaches_the_row_as_one_short_printable_line() -> None:
    sweep = build_sweep(BenchSettings(op="write", transport="tcp", block_size="8KiB",
                                      batch_size="4", iterations=2, warmup=0))
    runner = SweepRunner(Refusing(), sweep, line_rates=LineRates())  # type: ignore[arg-type]
    timed = runner._timed(sweep.configs()[0])
    assert timed.errors == 8
    assert timed.first_error is not None
    _clean(timed.first_error)
    assert len(timed.first_error) <= MAX_CAUSE_CHARS
    assert timed.first_error.startswith("target 127.0.0.1:9 refused: line one line two")
    with pytest.raises(CheckFailedError) as err:
        SweepRunner._must(Refusing().run_batch(), "write tcp", "writing the pattern")
    _clean(err.value.cause)
    assert len(err.value.cause) < MAX_CAUSE_CHARS + 200
