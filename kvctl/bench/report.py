"""A finished benchmark as data: the JSON payload, JSON lines and CSV (strings, not printed).

The JSON document (``--json``) carries ``row_schema`` and every row; each JSON line
(``--jsonl``) and CSV row (``--csv``) starts with ``row_schema`` so a consumer can check it
line by line. Field meanings and units: :class:`kvctl.bench.result.ResultRow`.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Sequence
from typing import Any

from kvctl.bench.result import OUTPUT_FIELDS, ROW_SCHEMA, ResultRow, Shortfall, row_to_dict
from kvctl.bench.runner import Skipped
from kvctl.bench.spec import Sweep


@dataclasses.dataclass(frozen=True)
class BenchReport:
    """Everything one ``kvctl bench transfer`` run produced.

    Attributes:
        run_id: 32-bit id mixed into verification patterns.
        engines: engines asked for, in order (the first is the ratio baseline).
        sweep: the configurations.
        rows: one per configuration and engine that ran.
        skipped: engines or transports that could not run here, with reasons and hints.
        shortfalls: configurations that missed ``--expect-*`` or had failed requests.
        expect_line_rate / expect_gbytes_per_s: the thresholds, if any.
        peer: the target (``None``: embedded on loopback).
    """

    run_id: int
    engines: tuple[str, ...]
    sweep: Sweep
    rows: tuple[ResultRow, ...]
    skipped: tuple[Skipped, ...] = ()
    shortfalls: tuple[Shortfall, ...] = ()
    expect_line_rate: float | None = None
    expect_gbytes_per_s: float | None = None
    peer: str | None = None

    @property
    def ok(self) -> bool:
        """Whether every configuration met the expectations."""
        return not self.shortfalls


def _sweep_dict(sweep: Sweep) -> dict[str, Any]:
    return {
        "ops": [op.value for op in sweep.ops],
        "transports": list(sweep.transports),
        "block_sizes_bytes": list(sweep.block_sizes_bytes),
        "batch_sizes": list(sweep.batch_sizes),
        "threads": sweep.threads,
        "duration_s": sweep.duration_s,
        "iterations": sweep.iterations,
        "warmup_batches": sweep.warmup_batches,
        "verify": sweep.verify,
        "local_location": str(sweep.local),
        "remote_location": str(sweep.remote),
    }


def report_payload(report: BenchReport) -> dict[str, Any]:
    """The ``--json`` payload (the CLI adds ``schema_version`` and ``kind``)."""
    sizing = report.sweep.sizing
    return {
        "row_schema": ROW_SCHEMA,
        "run_id": report.run_id,
        "engines": list(report.engines),
        "baseline_engine": report.engines[0] if report.engines else None,
        "peer": report.peer,
        "sweep": _sweep_dict(report.sweep),
        "model": dataclasses.asdict(sizing) if sizing is not None else None,
        "skipped": [dataclasses.asdict(s) for s in report.skipped],
        "rows": [row_to_dict(r) for r in report.rows],
        "verdict": {
            "ok": report.ok,
            "expect_line_rate": report.expect_line_rate,
            "expect_gbytes_per_s": report.expect_gbytes_per_s,
            "expect_gbps": report.expect_gbytes_per_s,  # deprecated name, one release
            "shortfalls": [dataclasses.asdict(s) for s in report.shortfalls],
        },
    }


def to_jsonl(rows: Sequence[ResultRow]) -> str:
    """One JSON object per row and line, each with ``row_schema`` first."""
    return "".join(json.dumps({"row_schema": ROW_SCHEMA, **row_to_dict(r)}) + "\n"
                   for r in rows)


def to_csv(rows: Sequence[ResultRow]) -> str:
    """A header of field names (``row_schema`` first) and one line per row; empty = null."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(("row_schema", *OUTPUT_FIELDS))
    for row in rows:
        data = row_to_dict(row)
        writer.writerow((ROW_SCHEMA, *("" if data[f] is None else data[f]
                                       for f in OUTPUT_FIELDS)))
    return out.getvalue()
