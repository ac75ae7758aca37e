"""Latency statistics: percentiles (linear interpolation) and standard deviation."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (0..1) of ascending ``sorted_values``.

    Linear interpolation between closest ranks (numpy's default ``linear`` method), so the
    p99.9 of 10 samples lies between the two largest instead of jumping to the maximum.

    Raises:
        ValueError: no values, or ``fraction`` outside [0, 1].
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} outside [0, 1]")
    rank = fraction * (len(sorted_values) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    weight = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * weight


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    """Summary of latency samples, all in microseconds.

    Attributes:
        count: samples summarised (0: nothing was measured and every value is NaN).
        p50_us / p99_us / p999_us: 50th, 99th and 99.9th percentiles.
        mean_us: arithmetic mean.
        stddev_us: sample standard deviation (0 for a single sample).
        min_us / max_us: extremes.
    """

    count: int
    p50_us: float
    p99_us: float
    p999_us: float
    mean_us: float
    stddev_us: float
    min_us: float
    max_us: float

    @classmethod
    def empty(cls) -> LatencyStats:
        """Stats of no samples: ``count`` 0 and NaN values (rendered as null / ``-``)."""
        nan = math.nan
        return cls(0, nan, nan, nan, nan, nan, nan, nan)


def summarize(samples_s: Sequence[float]) -> LatencyStats:
    """Summarise latency samples given in seconds; no samples gives :meth:`LatencyStats.empty`."""
    if not samples_s:
        return LatencyStats.empty()
    values = sorted(s * 1e6 for s in samples_s)
    return LatencyStats(
        count=len(values),
        p50_us=percentile(values, 0.50),
        p99_us=percentile(values, 0.99),
        p999_us=percentile(values, 0.999),
        mean_us=statistics.fmean(values),
        stddev_us=statistics.stdev(values) if len(values) > 1 else 0.0,
        min_us=values[0],
        max_us=values[-1],
    )
