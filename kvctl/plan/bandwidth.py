"""Read-back bandwidth from a ``kvctl bench transfer --json`` result file.

Expected shape (the rows of ``kvctl bench transfer --json``, schema
``kvctl.bench.transfer.row/1``; only ``rows[].throughput_gbps`` is required)::

    {
      "schema_version": 1,
      "kind": "bench.transfer",
      "rows": [
        {"op": "read", "block_size_bytes": 65536, "throughput_gbps": 11.8, ...},
        {"op": "read", "block_size_bytes": 1048576, "throughput_gbps": 23.4, ...},
        {"op": "write", "block_size_bytes": 1048576, "throughput_gbps": 22.9, ...}
      ]
    }

- ``throughput_gbps``: GB/s, decimal (10^9 bytes per second); a positive number.
- ``op`` (optional): ``read``/``write`` (any case). When any row has an ``op``, only read
  rows are used (reading KV back is a read).
- ``block_size_bytes`` (optional): the block size of the row; ``--bench-size`` picks the
  rows of that size.

A bare JSON list of rows is accepted too. Of the eligible rows the fastest is used, and the
result says which row it was.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from kvctl.errors import UsageError
from kvctl.units import format_size

#: Row fields of ``kvctl bench transfer`` (kvctl.bench.result.ResultRow) read here.
GBPS_KEY = "throughput_gbps"
SIZE_KEY = "block_size_bytes"

_HINT = (
    "give the JSON written by 'kvctl bench transfer --json': an object with a 'rows' list, "
    "each row with 'throughput_gbps' (GB/s) and optionally 'op' and 'block_size_bytes'"
)


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """A read-back bandwidth and where it came from.

    Attributes:
        gbps: GB/s, decimal (10^9 bytes per second).
        source: ``--read-gbps`` or ``FILE row N (op read, 64 KiB)``.
    """

    gbps: float
    source: str


def _number(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return math.nan
    return float(value)


def read_bench_file(path: Path, *, size_bytes: int | None = None) -> Bandwidth:
    """The fastest eligible row's ``throughput_gbps`` (read rows; of ``size_bytes`` when given).

    Raises:
        UsageError: the file is missing, not JSON, not of the documented shape, or has no
            eligible row.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(
            f"cannot read bench result {path}: {exc.strerror or exc}",
            "check the --bench-file path",
        ) from exc
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"bench result {path} is not JSON (line {exc.lineno}, column {exc.colno})", _HINT
        ) from exc
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise UsageError(f"bench result {path} has no 'rows' list", _HINT)
    has_op = any(isinstance(r, dict) and "op" in r for r in rows)
    best: tuple[float, int, dict[str, Any]] | None = None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UsageError(f"bench result {path}: row {index} is not an object", _HINT)
        gbps = _number(row, GBPS_KEY)
        if gbps is None or math.isnan(gbps) or gbps <= 0:
            raise UsageError(
                f"bench result {path}: row {index} has {GBPS_KEY} {row.get(GBPS_KEY)!r}, "
                "expected a "
                "positive number of GB/s",
                _HINT,
            )
        if has_op and str(row.get("op", "")).lower() != "read":
            continue
        if size_bytes is not None and row.get(SIZE_KEY) != size_bytes:
            continue
        if best is None or gbps > best[0]:
            best = (gbps, index, row)
    if best is None:
        what = "read rows" if has_op else "rows"
        if size_bytes is not None:
            what += f" of {SIZE_KEY} {size_bytes}"
        raise UsageError(
            f"bench result {path} has no {what}",
            "run 'kvctl bench transfer' with reads at that size, or drop --bench-size",
        )
    gbps, index, row = best
    details = []
    if "op" in row:
        details.append(f"op {row['op']}")
    size = row.get(SIZE_KEY)
    if isinstance(size, int) and not isinstance(size, bool):
        details.append(format_size(size))
    detail = f" ({', '.join(details)})" if details else ""
    return Bandwidth(gbps=gbps, source=f"{path} row {index}{detail}")
