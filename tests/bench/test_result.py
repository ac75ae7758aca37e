"""Result rows: ratios, expectations, schema of JSON lines and CSV."""

import csv
import dataclasses
import io
import json
import math
from typing import Any

import pytest

from kvctl.bench.report import to_csv, to_jsonl
from kvctl.bench.result import (
    OUTPUT_FIELDS,
    ROW_FIELDS,
    ROW_SCHEMA,
    ResultRow,
    raise_shortfalls,
    row_to_dict,
    shortfalls,
    with_ratios,
)
from kvctl.errors import CheckFailedError

BASE = ResultRow(
    engine="kvctl", op="write", transport="tcp", transport_requested="tcp", path="p",
    block_size_bytes=4096, batch_size=8, threads=1, local_location="cpu:0",
    remote_location="cpu:0", batches=10, requests=80, bytes_moved=80 * 4096, elapsed_s=1.0,
    throughput_gbytes_per_s=1.0, throughput_gbits_per_s=8.0, requests_per_s=80.0,
    batch_latency_p50_us=1.0, batch_latency_p99_us=2.0, batch_latency_p999_us=3.0,
    batch_latency_mean_us=1.5, batch_latency_stddev_us=0.5, request_latency_p50_us=math.nan,
    request_latency_p99_us=math.nan, request_latency_p999_us=math.nan,
    request_latency_stddev_us=math.nan, errors=0, retries=None, line_rate_gbytes_per_s=2.0,
    line_rate_source="tcp-loopback x4", line_rate_fraction=0.5, line_rate_valid=True,
    verified=None)


def _row(engine: str = "kvctl", gbps: float = 1.0, **kw: Any) -> ResultRow:
    fields: dict[str, Any] = {"engine": engine, "throughput_gbytes_per_s": gbps,
                              "throughput_gbits_per_s": gbps * 8,
                              "line_rate_fraction": gbps / 2.0}
    fields.update(kw)
    return dataclasses.replace(BASE, **fields)


def test_ratios_pair_rows_by_configuration() -> None:
    rows = with_ratios([_row("kvctl", 2.0), _row("mooncake", 1.0),
                        _row("mooncake", 1.0, block_size_bytes=8192)], "kvctl")
    assert rows[0].ratio_vs_baseline is None
    assert rows[1].ratio_vs_baseline == pytest.approx(0.5)
    assert rows[2].ratio_vs_baseline is None  # no baseline row for 8 KiB


def test_shortfalls_name_the_configuration() -> None:
    rows = [_row(gbps=1.0), _row(gbps=1.9, op="read")]
    missed = shortfalls(rows, expect_gbytes_per_s=1.5)
    assert [m.label for m in missed] == ["kvctl write tcp 4 KiB x8"]
    assert not shortfalls(rows, expect_gbytes_per_s=0.5)
    by_line = shortfalls(rows, expect_line_rate=0.9)
    assert [m.label for m in by_line] == ["kvctl write tcp 4 KiB x8"]
    assert "50.0% of line rate" in by_line[0].reason
    unknown = shortfalls([_row(line_rate_fraction=None)], expect_line_rate=0.1)
    assert "unknown" in unknown[0].reason
    failed = shortfalls([_row(errors=3)])
    assert "3 request(s) failed" in failed[0].reason
    with pytest.raises(CheckFailedError, match="kvctl write tcp 4 KiB x8"):
        raise_shortfalls(missed)
    raise_shortfalls([])  # nothing missed: no error


def test_a_row_above_its_line_rate_is_not_judged_by_it() -> None:
    fast = _row(gbps=3.0, line_rate_fraction=1.5, line_rate_valid=False)
    missed = shortfalls([fast], expect_line_rate=0.9)
    assert len(missed) == 1
    assert "baseline below measured: baseline invalid" in missed[0].reason
    assert "3.000 GB/s measured is 150% of line rate 2.000 GB/s" in missed[0].reason
    assert not shortfalls([fast])  # no line-rate expectation: nothing to judge
    assert not shortfalls([fast], expect_gbytes_per_s=2.5)


def test_row_dict_has_every_field_and_nan_is_null() -> None:
    data = row_to_dict(_row())
    assert tuple(data) == OUTPUT_FIELDS
    assert OUTPUT_FIELDS[:len(ROW_FIELDS)] == ROW_FIELDS
    assert data["throughput_gbps"] == data["throughput_gbytes_per_s"] == 1.0  # deprecated name
    assert data["throughput_gbitps"] == 8.0
    assert data["line_rate_gbps"] == 2.0
    assert data["request_latency_p50_us"] is None
    for name in ("engine", "op", "transport", "path", "block_size_bytes", "batch_size",
                 "throughput_gbytes_per_s", "throughput_gbits_per_s", "requests_per_s",
                 "batch_latency_p50_us", "batch_latency_p99_us", "batch_latency_p999_us",
                 "batch_latency_stddev_us", "errors", "retries", "line_rate_gbytes_per_s",
                 "line_rate_fraction", "verified"):
        assert name in data


def test_jsonl_and_csv_carry_the_schema() -> None:
    rows = [_row(), dataclasses.replace(_row(), engine="mooncake")]
    lines = [json.loads(line) for line in to_jsonl(rows).splitlines()]
    assert [line["engine"] for line in lines] == ["kvctl", "mooncake"]
    assert all(line["row_schema"] == ROW_SCHEMA for line in lines)
    table = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert tuple(table[0]) == ("row_schema", *OUTPUT_FIELDS)
    assert table[1]["engine"] == "mooncake"
    assert table[0]["request_latency_p50_us"] == ""
    assert float(table[0]["throughput_gbytes_per_s"]) == 1.0
