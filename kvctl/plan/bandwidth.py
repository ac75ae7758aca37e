"""Read-back bandwidth from a ``kvctl bench transfer --json`` result file.

Expected shape (the rows of ``kvctl bench transfer --json``, schema
``kvctl.bench.transfer.row/2``; only ``rows[].throughput_gbytes_per_s`` is required)::

    {
      "schema_version": 2,
      "kind": "bench.transfer",
      "rows": [
        {"op": "read", "block_size_bytes": 65536, "throughput_gbytes_per_s": 11.8, ...},
        {"op": "read", "block_size_bytes": 1048576, "throughput_gbytes_per_s": 23.4, ...},
        {"op": "write", "block_size_bytes": 1048576, "throughput_gbytes_per_s": 22.9, ...}
      ]
    }

- ``throughput_gbytes_per_s``: GB/s (gigabytes, decimal: 10^9 bytes per second); a positive
  number. Files of row schema 1 name it ``throughput_gbps``, which is read too.
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

#: Row fields of ``kvctl bench transfer`` (kvctl.bench.result.ResultRow) read here; the
#: second name is row schema 1's.
GBPS_KEY = "throughput_gbytes_per_s"
OLD_GBPS_KEY = "throughput_gbps"
SIZE_KEY = "block_size_bytes"

_HINT = (
    "give the JSON written by 'kvctl bench transfer --json': an object with a 'rows' list, "
    "each row with 'throughput_gbytes_per_s' (GB/s) and optionally 'op' and 'block_size_bytes'"
)


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """A read-back bandwidth and where it came from.

    Attributes:
        gbytes_per_s: GB/s, decimal (10^9 bytes per second).
        source: ``--read-gbytes-per-s`` or ``FILE row N (op read, 64 KiB)``.
    """

    gbytes_per_s: float
    source: str


def _number(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return math.nan
    return float(value)


def read_bench_file(path: Path, *, size_bytes: int | None = None) -> Bandwidth:
    """The fastest eligible row's ``throughput_gbytes_per_s`` (read rows; of ``size_bytes``
    when given).

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
        key = GBPS_KEY if GBPS_KEY in row or OLD_GBPS_KEY not in row else OLD_GBPS_KEY
        gbps = _number(row, key)
        if gbps is None or math.isnan(gbps) or gbps <= 0:
            raise UsageError(
                f"bench result {path}: row {index} has {key} {row.get(key)!r}, "
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
    return Bandwidth(gbytes_per_s=gbps, source=f"{path} row {index}{detail}")
