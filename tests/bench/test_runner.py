"""The runner over kvctl's engine and a real embedded target process (integration)."""

import dataclasses
from typing import Any

import pytest

from kvctl.bench.engines import EngineDriver, open_driver
from kvctl.bench.engines.kvctl import describe_paths
from kvctl.bench.linerate import LineRates
from kvctl.bench.runner import SweepRunner, plan_for
from kvctl.bench.spec import BenchSettings, Sweep, build_sweep
from kvctl.bench.verify import IntegrityError, Pattern

pytestmark = pytest.mark.integration

RUN_ID = 0x5EED


BASE = BenchSettings(op="write", transport="shm", block_size="8KiB", batch_size="4",
                     iterations=3, warmup=1, verify=True)


def _sweep(**kw: Any) -> Sweep:
    return build_sweep(dataclasses.replace(BASE, **kw))


def test_verified_rows_over_both_transports() -> None:
    sweep = _sweep(transport="shm,tcp", op="both", threads=2)
    with open_driver("kvctl") as driver:
        driver.start(plan_for(sweep))
        rows = list(SweepRunner(driver, sweep, line_rates=LineRates()).rows())
    assert [(r.transport, r.op) for r in rows] == [
        ("shm", "read"), ("shm", "write"), ("tcp", "read"), ("tcp", "write")]
    for row in rows:
        assert row.verified is True
        assert row.errors == 0
        assert row.batches == 6  # 3 iterations x 2 threads
        assert row.requests == 24
        assert row.bytes_moved == 24 * 8192
        assert row.throughput_gbytes_per_s > 0
        assert row.line_rate_gbytes_per_s is not None
        assert row.line_rate_fraction is not None
        assert row.request_latency_p50_us > 0
        assert row.retries == 0  # kvctl's engine reports retries (none on a healthy path)
    assert "->127.0.0.1:" in rows[2].path  # per-request paths of the tcp transport
    assert rows[0].path.startswith("shm")


def test_describe_paths() -> None:
    assert describe_paths(["any->h:1#0", "any->h:1#1", "any->h:1#0"]) == "any->h:1 (2 paths)"
    assert describe_paths(["a->h:1#0,b->h:1#1"]) == "a->h:1 (1 path), b->h:1 (1 path)"
    assert describe_paths(["shm:mmap"]) == "shm:mmap"
    assert describe_paths([]) == "-"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_planted_corruption_is_caught_with_its_offset(transport: str) -> None:
    sweep = _sweep(transport=transport)
    planted: list[int] = []

    def corrupt(driver: EngineDriver, used: str, stride: int) -> None:
        # Block 2 of thread 0, byte 5000: flip it on the target after the pattern was written.
        offset = 2 * 8192 + 5000
        good = Pattern.for_config(RUN_ID, 0).expected(2, 8192)[5000]
        planted.append(offset)
        driver.poke_remote(used, offset, bytes([good ^ 0xFF]))

    with open_driver("kvctl") as driver:
        driver.start(plan_for(sweep))
        runner = SweepRunner(driver, sweep, line_rates=LineRates(), tamper=corrupt,
                             run_id=RUN_ID)
        with pytest.raises(IntegrityError, match="block 2 differs at byte offset 5000"):
            list(runner.rows())
    assert planted


def test_latency_sampling_gives_up_on_a_target_that_fails_every_request() -> None:
    """A dead target used to cost 200 failing single-request batches (minutes with an engine
    that times each out) before the row could report it."""
    from kvctl.bench.engines.base import BatchOutcome
    from kvctl.bench.runner import MAX_FAILED_SAMPLES

    class Dead:
        calls = 0

        def run_batch(self, *_args: Any) -> BatchOutcome:
            Dead.calls += 1
            return BatchOutcome(errors=1)

    sweep = _sweep(duration=30.0, iterations=None)
    runner = SweepRunner(Dead(), sweep, line_rates=LineRates())  # type: ignore[arg-type]
    config = sweep.configs()[0]
    assert runner._request_latencies(config) == []
    assert Dead.calls == MAX_FAILED_SAMPLES
