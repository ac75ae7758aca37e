"""Result rows of a transfer benchmark and the schema scripts rely on.

Every row is one configuration through one engine. Units are in the field names: ``_bytes``,
``_s`` (seconds), ``_us`` (microseconds), ``_gbytes_per_s`` (GB/s, gigabytes, decimal: 10^9
bytes per second), ``_gbits_per_s`` (Gbit/s: 10^9 bits per second, the unit of NIC port rates
and ib_write_bw). ``None`` (JSON ``null``) means "not measured" or "not known", never 0.

Bump :data:`ROW_SCHEMA` when a field changes meaning or disappears; adding a field is
compatible. Row schema 2 renamed ``throughput_gbps``, ``throughput_gbitps`` and
``line_rate_gbps`` (:data:`kvctl.units.DEPRECATED_KEYS`); the old keys are still written, last,
for one release.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from kvctl.errors import CheckFailedError
from kvctl.units import DEPRECATED_KEYS, format_size

#: Identifier of the row layout in ``--json``/``--jsonl``/``--csv`` output.
ROW_SCHEMA = "kvctl.bench.transfer.row/2"


@dataclasses.dataclass(frozen=True)
class ResultRow:
    """One configuration's measurements.

    Attributes:
        engine: ``kvctl``, ``mooncake`` or ``nixl``.
        op: ``read`` or ``write``.
        transport: transport that actually moved the bytes (``shm``, ``tcp``, ``rdma``, or the
            engine's own name for it, e.g. ``ucx``).
        transport_requested: what the sweep asked for (``auto`` lets the engine pick).
        path: the path used, e.g. ``127.0.0.1->127.0.0.1:4001`` or ``shm:/dev/shm/...``.
        block_size_bytes / batch_size / threads: the configuration.
        local_location / remote_location: buffer locations (``cpu:0``, ``file:/x``).
        batches / requests: timed batches and requests (all threads).
        bytes_moved: bytes of completed timed requests.
        elapsed_s: wall time of the timed phase.
        throughput_gbytes_per_s: bytes_moved / elapsed_s / 10^9 (GB/s: gigabytes, decimal).
        throughput_gbits_per_s: the same in Gbit/s (x 8).
        requests_per_s: completed requests per second.
        batch_latency_*_us: submit-to-all-done time of timed batches.
        request_latency_*_us: one request alone (batch of 1, unloaded) of the same size.
        errors: failed or timed-out requests (timed phase).
        retries: slices retried on another path; ``None`` when the engine does not report it.
        line_rate_gbytes_per_s / line_rate_source: the path's ceiling (GB/s) and how it was
            obtained (:mod:`kvctl.bench.linerate`: measured with this row's shape, in this run).
        line_rate_fraction: throughput_gbytes_per_s / line_rate_gbytes_per_s.
        line_rate_valid: ``False`` when the row beat its line rate (fraction above 1): the
            baseline is wrong and no verdict is drawn from it; ``None`` without a line rate.
        verified: ``True`` when every block's pattern was checked; ``None`` when not asked.
        ratio_vs_baseline: throughput / the baseline engine's throughput for the same
            configuration (``None`` for the baseline itself or without a match).
        model / tokens_per_block: set when blocks are sized as a model's KV pages.
        first_error: why the first failed request of the timed phase failed, as the
            engine said (a target that died, a refusal); ``None`` when none failed.
    """

    engine: str
    op: str
    transport: str
    transport_requested: str
    path: str
    block_size_bytes: int
    batch_size: int
    threads: int
    local_location: str
    remote_location: str
    batches: int
    requests: int
    bytes_moved: int
    elapsed_s: float
    throughput_gbytes_per_s: float
    throughput_gbits_per_s: float
    requests_per_s: float
    batch_latency_p50_us: float
    batch_latency_p99_us: float
    batch_latency_p999_us: float
    batch_latency_mean_us: float
    batch_latency_stddev_us: float
    request_latency_p50_us: float
    request_latency_p99_us: float
    request_latency_p999_us: float
    request_latency_stddev_us: float
    errors: int
    retries: int | None
    line_rate_gbytes_per_s: float | None
    line_rate_source: str | None
    line_rate_fraction: float | None
    line_rate_valid: bool | None
    verified: bool | None
    ratio_vs_baseline: float | None = None
    model: str | None = None
    tokens_per_block: int | None = None
    first_error: str | None = None

    def label(self) -> str:
        """How messages name the configuration: ``kvctl write tcp 64 KiB x128``."""
        return (f"{self.engine} {self.op} {self.transport_requested} "
                f"{format_size(self.block_size_bytes)} x{self.batch_size}")

    def key(self) -> tuple[str, str, int, int]:
        """The configuration without the engine, to pair engines for ratios."""
        return (self.op, self.transport_requested, self.block_size_bytes, self.batch_size)


#: Field names in order: the CSV header and the keys of every JSON row; the deprecated
#: names of renamed fields come last (same values), for one release.
ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ResultRow))
_OLD_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (DEPRECATED_KEYS[name], name) for name in ROW_FIELDS if name in DEPRECATED_KEYS)
OUTPUT_FIELDS: tuple[str, ...] = ROW_FIELDS + tuple(old for old, _ in _OLD_FIELDS)


def with_ratios(rows: Sequence[ResultRow], baseline_engine: str) -> list[ResultRow]:
    """Rows with ``ratio_vs_baseline`` filled against ``baseline_engine``'s matching rows."""
    base = {r.key(): r.throughput_gbytes_per_s for r in rows if r.engine == baseline_engine}
    out: list[ResultRow] = []
    for row in rows:
        ref = base.get(row.key())
        ratio = None
        if row.engine != baseline_engine and ref:
            ratio = row.throughput_gbytes_per_s / ref
        out.append(dataclasses.replace(row, ratio_vs_baseline=ratio))
    return out


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """A configuration that missed an expectation.

    Attributes:
        label: the configuration (``kvctl write tcp 64 KiB x128``).
        reason: what was expected and what was measured.
    """

    label: str
    reason: str


def shortfalls(rows: Sequence[ResultRow], *, expect_line_rate: float | None = None,
               expect_gbytes_per_s: float | None = None) -> list[Shortfall]:
    """Configurations below ``expect_gbytes_per_s`` GB/s or ``expect_line_rate`` of their line
    rate, or with failed requests. A row with no known line rate, or one that beat its line
    rate (the baseline is wrong), cannot be judged against a line-rate expectation and is
    reported as such."""
    out: list[Shortfall] = []
    for row in rows:
        if row.errors:
            out.append(Shortfall(row.label(), f"{row.errors} request(s) failed" + (
                f", first: {row.first_error}" if row.first_error else "")))
        tp = row.throughput_gbytes_per_s
        if expect_gbytes_per_s is not None and tp < expect_gbytes_per_s:
            out.append(Shortfall(
                row.label(), f"{tp:.3f} GB/s < expected {expect_gbytes_per_s:g} GB/s"))
        if expect_line_rate is not None:
            if row.line_rate_fraction is None:
                out.append(Shortfall(row.label(), "line rate unknown for this path"))
            elif row.line_rate_valid is False:
                out.append(Shortfall(row.label(), baseline_invalid_reason(row)))
            elif row.line_rate_fraction < expect_line_rate:
                out.append(Shortfall(
                    row.label(),
                    f"{row.line_rate_fraction:.1%} of line rate "
                    f"({tp:.3f} of {row.line_rate_gbytes_per_s:.3f} GB/s, "
                    f"{row.line_rate_source}) < expected {expect_line_rate:.0%}"))
    return out


def baseline_invalid_reason(row: ResultRow) -> str:
    """Why a row's line rate cannot be judged against: the row went faster than it."""
    return (f"baseline below measured: baseline invalid ({row.throughput_gbytes_per_s:.3f} GB/s "
            f"measured is {row.line_rate_fraction or 0.0:.0%} of line rate "
            f"{row.line_rate_gbytes_per_s or 0.0:.3f} GB/s from {row.line_rate_source}); "
            "no line-rate verdict")


def raise_shortfalls(missed: Sequence[Shortfall]) -> None:
    """Raise :class:`CheckFailedError` naming every configuration that fell short (if any)."""
    if missed:
        lines = "; ".join(f"{m.label}: {m.reason}" for m in missed)
        raise CheckFailedError(
            f"{len(missed)} configuration(s) fell short: {lines}",
            "check the path shown per row (kvctl topo for NIC placement), or lower the "
            "threshold if this link is known to be slower",
        )


def row_to_dict(row: ResultRow) -> dict[str, Any]:
    """A row as a JSON-ready mapping (NaN becomes ``None``), keys in :data:`OUTPUT_FIELDS`
    order: the deprecated names of renamed fields last."""
    out: dict[str, Any] = {}
    for name in ROW_FIELDS:
        value = getattr(row, name)
        if isinstance(value, float) and math.isnan(value):  # not measured
            value = None
        out[name] = value
    for old, new in _OLD_FIELDS:
        out[old] = out[new]
    return out
