"""Side by side with the real Mooncake and NIXL engines (integration; short runs)."""

from collections.abc import Callable
from typing import Any

import pytest

from kvctl.bench.engines import EngineDriver, driver_class, open_driver
from kvctl.bench.linerate import LineRates
from kvctl.bench.runner import SweepRunner, plan_for
from kvctl.bench.spec import BenchSettings, build_sweep
from kvctl.bench.verify import IntegrityError, Pattern

pytestmark = pytest.mark.integration


def _require(engine: str) -> None:
    reason = driver_class(engine).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{engine} unavailable: {reason}")


def test_kvctl_and_mooncake_side_by_side(kvctl: Callable[..., Any]) -> None:
    _require("mooncake")
    r = kvctl("bench", "transfer", "--engine", "kvctl", "--engine", "mooncake", "-t", "tcp",
              "-b", "64KiB", "-n", "16", "-i", "5", "--warmup", "1", "--verify", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["baseline_engine"] == "kvctl"
    rows = doc["rows"]
    assert [(row["engine"], row["op"]) for row in rows] == [
        ("kvctl", "read"), ("kvctl", "write"), ("mooncake", "read"), ("mooncake", "write")]
    for row in rows:
        assert row["verified"] is True
        assert row["errors"] == 0
        assert row["throughput_gbytes_per_s"] > 0
        assert row["transport"] == "tcp"
    for kv, mc in zip(rows[:2], rows[2:], strict=True):
        assert kv["ratio_vs_baseline"] is None
        assert mc["ratio_vs_baseline"] == pytest.approx(
            mc["throughput_gbytes_per_s"] / kv["throughput_gbytes_per_s"])
        assert mc["retries"] is None  # Mooncake's Python API does not report retries


def test_mooncake_without_shm_is_skipped_not_failed(kvctl: Callable[..., Any]) -> None:
    _require("mooncake")
    r = kvctl("bench", "transfer", "--engine", "mooncake", "-t", "shm,tcp", "--op", "write",
              "-b", "4KiB", "-n", "4", "-i", "2", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert [row["transport"] for row in doc["rows"]] == ["tcp"]
    assert doc["skipped"][0]["transport"] == "shm"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_planted_corruption_is_caught_through_other_engines(engine: str) -> None:
    _require(engine)
    sweep = build_sweep(BenchSettings(op="write", transport="tcp", block_size="8KiB",
                                      batch_size="4", iterations=2, warmup=0, verify=True))
    expected = Pattern.for_config(77, 0).expected(1, 8192)[100]

    def corrupt(driver: EngineDriver, used: str, stride: int) -> None:
        driver.poke_remote(used, 8192 + 100, bytes([expected ^ 0x0F]))

    with open_driver(engine) as driver:
        driver.start(plan_for(sweep))
        runner = SweepRunner(driver, sweep, line_rates=LineRates(), tamper=corrupt, run_id=77)
        with pytest.raises(IntegrityError, match="block 1 differs at byte offset 100"):
            list(runner.rows())


def test_nixl_tcp_rows(kvctl: Callable[..., Any]) -> None:
    _require("nixl")
    r = kvctl("bench", "transfer", "--engine", "nixl", "-t", "tcp", "-b", "16KiB", "-n", "8",
              "-i", "3", "--verify", "--json")
    assert r.exit_code == 0, r.stderr
    rows = r.json()["rows"]
    assert {row["transport"] for row in rows} == {"ucx-tcp"}
    assert all(row["verified"] and row["engine"] == "nixl" for row in rows)
    assert all(row["line_rate_source"].startswith("tcp-loopback") for row in rows)
