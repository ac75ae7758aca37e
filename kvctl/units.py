"""Sizes, rates and durations as operators write them.

Sizes accept binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) and decimal (``KB``, ``MB``, ``GB``,
``TB``) suffixes; a bare ``K``/``M``/``G``/``T`` means binary, as in ``dd`` and most
inference engines' flags. Output always names its unit: GB/s is decimal (10^9 bytes per
second), GiB/s binary.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvctl.errors import UsageError

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}

_DURATION_UNITS: dict[str, float] = {
    "": 1.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
}


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse ``"64KiB"``, ``"1MiB"``, ``"4M"``, ``"1.5GB"`` or ``4096`` into bytes.

    Raises:
        UsageError: the text is not a size or names an unknown unit; the hint lists the units.
    """
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"{what} {text} is negative", "give a size of 0 bytes or more")
        return text
    match = _SIZE_RE.match(text)
    if match is None and text.strip().startswith("-") and _SIZE_RE.match(text.strip()[1:]):
        raise UsageError(f"{what} {text.strip()!r} is negative",
                         "give a size of 0 bytes or more, e.g. 4KiB")
    if match is None:
        raise UsageError(
            f"{what} {text!r} is not a size",
            "write a number with an optional unit, e.g. 4096, 64KiB, 1MiB, 4M, 2GB",
        )
    unit = match["unit"].lower()
    if unit not in _SIZE_UNITS:
        raise UsageError(
            f"{what} {text!r} has an unknown unit {match['unit']!r}",
            "use one of B, K/KiB, M/MiB, G/GiB, T/TiB (binary) or KB, MB, GB, TB (decimal)",
        )
    value = float(match["num"]) * _SIZE_UNITS[unit]
    if not value.is_integer():
        raise UsageError(f"{what} {text!r} is not a whole number of bytes", "use a smaller unit")
    return int(value)


def parse_size_list(text: str, *, what: str = "size") -> list[int]:
    """Parse a comma-separated list (``"4KiB,64KiB"``) or a power-of-two range
    (``"4KiB-4MiB"``, every power of two from the first to the last) into bytes."""
    sizes: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise UsageError(f"{what} list {text!r} has an empty entry", "remove the stray comma")
        if part.startswith("-"):
            raise UsageError(f"{what} {part!r} is negative",
                             "give sizes of 0 bytes or more, e.g. 4KiB or a range 4KiB-4MiB")
        if "-" in part:
            lo_text, _, hi_text = part.partition("-")
            if not hi_text.strip():
                raise UsageError(f"{what} range {part!r} has no upper end",
                                 "write LOW-HIGH, e.g. 4KiB-4MiB")
            lo, hi = parse_size(lo_text, what=what), parse_size(hi_text, what=what)
            if lo <= 0 or lo > hi:
                raise UsageError(
                    f"{what} range {part!r} is empty", "write LOW-HIGH with 0 < LOW <= HIGH"
                )
            value = lo
            while value <= hi:
                sizes.append(value)
                value *= 2
        else:
            sizes.append(parse_size(part, what=what))
    return sizes


def parse_duration(text: str | float, *, what: str = "duration") -> float:
    """Parse ``"10s"``, ``"250ms"``, ``"2m"`` or ``3.5`` (seconds) into seconds."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = _SIZE_RE.match(text)
        unit = match["unit"].lower() if match else None
        negative = _SIZE_RE.match(text.strip()[1:]) if text.strip().startswith("-") else None
        if match is None and negative is not None and negative["unit"].lower() in _DURATION_UNITS:
            raise UsageError(f"{what} {text.strip()!r} is negative",
                             "give a duration of 0 or more, e.g. 10s or 250ms")
        if match is None or unit not in _DURATION_UNITS:
            raise UsageError(
                f"{what} {text!r} is not a duration", "write e.g. 10s, 250ms, 2m or 1h"
            )
        seconds = float(match["num"]) * _DURATION_UNITS[unit]
    if seconds < 0 or math.isnan(seconds) or math.isinf(seconds):
        raise UsageError(f"{what} {text!r} is out of range", "give a finite, positive duration")
    return seconds


def format_size(size_bytes: int) -> str:
    """Format bytes with a binary unit: ``4096`` → ``"4 KiB"``, ``1536`` → ``"1.5 KiB"``."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.1f}".rstrip("0").rstrip(".") if unit != "B" else f"{int(value)}"
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def gbytes_per_s(size_bytes: float, seconds: float) -> float:
    """Throughput in GB/s (gigabytes, decimal: 10^9 bytes per second)."""
    return size_bytes / seconds / 1e9 if seconds > 0 else 0.0


#: JSON keys renamed to name their unit (``gbytes`` = 10^9 bytes, ``gbits`` = 10^9 bits), and
#: the ambiguous ``gbps`` key each replaced. The old key is still written next to the new one
#: for one release (schema_version 2); it goes in the next.
DEPRECATED_KEYS: dict[str, str] = {
    "throughput_gbytes_per_s": "throughput_gbps",
    "throughput_gbits_per_s": "throughput_gbitps",
    "line_rate_gbytes_per_s": "line_rate_gbps",
    "expect_gbytes_per_s": "expect_gbps",
    "read_gbytes_per_s": "read_gbps",
    "break_even_gbytes_per_s": "break_even_gbps",
    "pool_gbytes_per_s": "pool_gbps",
    "pool_read_gbytes_per_s": "pool_read_gbps",
    "rate_gbits_per_s": "rate_gbps",
    # kvctl cluster bench (its agents' wire rows keep their names: agents of the last release
    # still speak them)
    "gbytes_per_s": "gbps",
    "write_gbytes_per_s": "write_gbps",
    "median_gbytes_per_s": "median_gbps",
    "mad_gbytes_per_s": "mad_gbps",
    "threshold_gbytes_per_s": "threshold_gbps",
}


def with_deprecated_keys(value: Any) -> Any:
    """``value`` (JSON data) with each renamed key's old name added after it, same value.

    Mappings and lists are walked; a mapping that already has the old key keeps its own.
    """
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out[key] = with_deprecated_keys(item)
            old = DEPRECATED_KEYS.get(key)
            if old is not None and old not in value:
                out[old] = out[key]
        return out
    if isinstance(value, list):
        return [with_deprecated_keys(item) for item in value]
    return value
