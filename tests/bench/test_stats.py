"""Percentiles and standard deviation against hand-computed values."""

import math

import pytest

from kvctl.bench.stats import percentile, summarize


def test_percentile_interpolates_between_ranks() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(values, 0.5) == 30.0
    assert percentile(values, 0.0) == 10.0
    assert percentile(values, 1.0) == 50.0
    # rank 0.99 * 4 = 3.96: 40 + 0.96 * 10
    assert percentile(values, 0.99) == pytest.approx(49.6)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 0.5)
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_summarize_converts_seconds_to_microseconds() -> None:
    stats = summarize([0.001, 0.002, 0.003, 0.004])
    assert stats.count == 4
    assert stats.p50_us == pytest.approx(2500.0)
    assert stats.mean_us == pytest.approx(2500.0)
    # sample stddev of 1000, 2000, 3000, 4000 us = sqrt(5/3) * 1000
    assert stats.stddev_us == pytest.approx(math.sqrt(5 / 3) * 1000)
    assert stats.min_us == pytest.approx(1000.0)
    assert stats.max_us == pytest.approx(4000.0)
    assert stats.p999_us == pytest.approx(3997.0)


def test_single_sample_has_zero_stddev_and_empty_is_nan() -> None:
    one = summarize([0.5])
    assert one.stddev_us == 0.0
    assert one.p99_us == pytest.approx(500_000.0)
    empty = summarize([])
    assert empty.count == 0
    assert math.isnan(empty.p50_us)
