"""``kvctl bench transfer`` over a real embedded target (short runs)."""

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.bench import linerate
from kvctl.bench.linerate import LineRate, Shape
from kvctl.bench.result import OUTPUT_FIELDS, ROW_SCHEMA
from kvctl.bench.target.kvctl import BenchTarget, TargetSpec

pytestmark = pytest.mark.integration

QUICK = ("-b", "4KiB", "-n", "8", "-i", "3", "--warmup", "1")


def test_json_document_schema(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", *QUICK, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["kind"] == "bench.transfer"
    assert doc["schema_version"] == 2
    assert doc["row_schema"] == ROW_SCHEMA
    assert doc["engines"] == ["kvctl"]
    assert doc["sweep"]["transports"] == ["shm", "tcp"]
    assert doc["verdict"] == {"ok": True, "expect_line_rate": None,
                              "expect_gbytes_per_s": None, "expect_gbps": None,
                              "shortfalls": []}
    rows = doc["rows"]
    assert [(row["transport"], row["op"]) for row in rows] == [
        ("shm", "read"), ("shm", "write"), ("tcp", "read"), ("tcp", "write")]
    for row in rows:
        assert tuple(row) == OUTPUT_FIELDS
        assert row["engine"] == "kvctl"
        assert row["block_size_bytes"] == 4096
        assert row["batch_size"] == 8
        assert row["requests"] == 24
        assert row["throughput_gbytes_per_s"] > 0
        assert row["throughput_gbits_per_s"] == pytest.approx(row["throughput_gbytes_per_s"] * 8)
        # the deprecated names, for one release: the same values
        assert row["throughput_gbps"] == row["throughput_gbytes_per_s"]
        assert row["throughput_gbitps"] == row["throughput_gbits_per_s"]
        assert row["line_rate_gbps"] == row["line_rate_gbytes_per_s"]
        assert row["batch_latency_p99_us"] >= row["batch_latency_p50_us"] > 0
        assert row["line_rate_gbytes_per_s"] > 0
        assert row["line_rate_fraction"] == pytest.approx(
            row["throughput_gbytes_per_s"] / row["line_rate_gbytes_per_s"])
        assert row["line_rate_valid"] is (row["line_rate_fraction"] <= 1.0)
        assert row["errors"] == 0
        assert row["verified"] is None
    assert rows[0]["line_rate_source"].startswith("memcpy 4 KiB x8")  # the row's own shape
    assert rows[2]["line_rate_source"].startswith("tcp-loopback 4 KiB x8")


def test_verify_jsonl_and_table(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", *QUICK, "-t", "tcp", "--op", "write", "--verify", "--jsonl")
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 1
    assert lines[0]["row_schema"] == ROW_SCHEMA
    assert lines[0]["verified"] is True
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "read", "--verify")
    assert r.exit_code == 0, r.stderr
    assert "GB/s = 10^9 B/s" in r.stdout
    assert "Gbit/s" in r.stdout
    assert "verify" in r.stdout
    assert "line rate memcpy 4 KiB x8" in r.stdout


def test_csv(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", *QUICK, "-t", "tcp", "--op", "read", "--csv")
    assert r.exit_code == 0, r.stderr
    header, row = r.stdout.splitlines()
    assert header.split(",") == ["row_schema", *OUTPUT_FIELDS]
    assert row.startswith(f"{ROW_SCHEMA},kvctl,read,tcp,tcp,")


def test_expectations_turn_the_run_into_a_check(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "write",
              "--expect-gbytes-per-s", "100000")
    assert r.exit_code == 1
    assert "Error:" in r.stderr
    assert "kvctl write shm 4 KiB x8" in r.stderr
    assert "expected 100000 GB/s" in r.stderr
    assert "GB/s" in r.stdout  # the table is still printed
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "write",
              "--expect-gbytes-per-s", "0.000001", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["verdict"]["ok"] is True
    assert "deprecated" not in r.stderr
    r = kvctl("bench", "transfer", *QUICK, "-t", "tcp", "--op", "read",
              "--expect-line-rate", "50", "--json")
    assert r.exit_code == 1
    doc = r.json()
    assert doc["verdict"]["ok"] is False
    assert doc["verdict"]["shortfalls"][0]["label"] == "kvctl read tcp 4 KiB x8"
    assert "of line rate" in r.stderr


def test_a_row_above_its_line_rate_says_the_baseline_is_invalid(
        kvctl: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    readings: list[str] = []

    def too_low(shape: Shape) -> LineRate:  # a baseline far below anything shm moves
        readings.append(shape.label())
        return LineRate(1e-6, f"memcpy {shape.label()}")

    monkeypatch.setattr(linerate, "measure_memcpy", too_low)
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "both")
    assert r.exit_code == 0, r.stderr  # no line-rate expectation: a warning, not a failure
    assert readings == ["4 KiB x8", "4 KiB x8"]  # measured, then once more when beaten
    assert "% !" in r.stdout
    assert "baseline below measured: baseline invalid" in r.stdout
    assert "baseline invalid for 2 row(s)" in r.stderr
    assert "memcpy 4 KiB x8 (re-measured)" in r.stdout
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "write",
              "--expect-line-rate", "0.5", "--json")
    assert r.exit_code == 1  # it cannot pass a check it cannot be judged by
    doc = r.json()
    row = doc["rows"][0]
    assert row["line_rate_valid"] is False
    assert row["line_rate_fraction"] > 1
    reason = doc["verdict"]["shortfalls"][0]["reason"]
    assert reason.startswith("baseline below measured: baseline invalid")
    assert "no line-rate verdict" in reason


def test_old_gbps_names_still_work_with_a_warning(kvctl: Callable[..., Any],
                                                  tmp_path: Path) -> None:
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "write",
              "--expect-gbps", "100000", "--json")
    assert r.exit_code == 1
    assert "--expect-gbps is deprecated" in r.stderr
    assert "use --expect-gbytes-per-s" in r.stderr
    assert r.json()["verdict"]["expect_gbytes_per_s"] == 100000
    r = kvctl("bench", "transfer", *QUICK, "--expect-gbps", "1", "--expect-gbytes-per-s", "2")
    assert r.exit_code == 2
    assert "set the same thing" in r.stderr
    config = tmp_path / "kvctl.yaml"
    config.write_text("bench:\n  expect_gbps: 100000\n")
    r = kvctl("--config", str(config), "bench", "transfer", *QUICK, "-t", "shm", "--op",
              "write", "--json")
    assert r.exit_code == 1
    assert "bench.expect_gbps is deprecated" in r.stderr
    assert r.json()["verdict"]["expect_gbytes_per_s"] == 100000


def test_model_sized_blocks(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", "--model", "llama-3-8b", "--page-tokens", "16", "-n", "2",
              "-i", "2", "--warmup", "0", "-t", "shm", "--op", "write", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    # 32 layers x 8 KV heads x 128 x 2 x 2 bytes = 131,072 B/token; x 16 tokens = 2 MiB
    assert doc["model"]["kv_bytes_per_token"] == 131_072
    assert doc["model"]["tokens_per_block"] == 16
    assert doc["rows"][0]["block_size_bytes"] == 16 * 131_072
    assert doc["rows"][0]["model"] == "Llama-3-8B"
    assert doc["rows"][0]["tokens_per_block"] == 16


@pytest.mark.parametrize(
    ("args", "cause"),
    [
        (("-b", "4QB"), "unknown unit"),
        (("-b", "lots"), "is not a size"),
        (("-t", "udp"), "transport 'udp' is unknown"),
        (("--engine", "ucx"), "engine 'ucx' is unknown"),
        (("--role", "initiator"), "--role initiator needs --peer"),
        (("--role", "boss"), "role 'boss' is unknown"),
        (("--json", "--csv"), "are exclusive"),
        (("--duration", "1s", "--iterations", "3"), "both --duration and --iterations"),
        (("--expect-line-rate", "-1"), "not positive"),
        (("--model", "no-such-model"), "unknown model"),
    ],
)
def test_bad_input_exits_2_with_hint(kvctl: Callable[..., Any], args: tuple[str, ...],
                                     cause: str) -> None:
    r = kvctl("bench", "transfer", *args)
    assert r.exit_code == 2, r.stderr
    assert cause in r.stderr
    assert "Hint:" in r.stderr


def test_plot_needs_matplotlib(kvctl: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
                               tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    r = kvctl("bench", "transfer", *QUICK, "--plot", str(tmp_path / "x.png"))
    assert r.exit_code == 3
    assert "matplotlib" in r.stderr
    assert "kvctl[plot]" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_png(kvctl: Callable[..., Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    r = kvctl("bench", "transfer", "-b", "4KiB,16KiB", "-n", "4", "-i", "2", "-t", "shm",
              "--plot", str(out))
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def target_by_address() -> Iterator[BenchTarget]:
    with BenchTarget(TargetSpec(region_bytes=8 * 4096)) as target:
        yield target


def test_initiator_by_address(kvctl: Callable[..., Any], target_by_address: BenchTarget
                              ) -> None:
    info = target_by_address.info
    assert info is not None
    r = kvctl("bench", "transfer", *QUICK, "-t", "tcp", "--role", "initiator", "--peer",
              info.peer, "--verify", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["peer"] == info.peer
    assert all(f"->{info.address} (" in row["path"] for row in doc["rows"])
    assert all(row["verified"] for row in doc["rows"])


def test_initiator_by_name_through_metadata(kvctl: Callable[..., Any], tmp_path: Path) -> None:
    url = f"file://{tmp_path}/meta"
    spec = TargetSpec(region_bytes=8 * 4096, metadata=url, segment="bench-by-name")
    with BenchTarget(spec) as target:
        assert target.info is not None
        assert target.info.peer == "bench-by-name"
        r = kvctl("bench", "transfer", *QUICK, "-t", "tcp", "--op", "write",
                  "--peer", "bench-by-name", "--metadata", url, "--json")
    assert r.exit_code == 0, r.stderr
    assert f"->{target.info.address} (" in r.json()["rows"][0]["path"]


def test_initiator_refuses_a_too_small_target(kvctl: Callable[..., Any],
                                              target_by_address: BenchTarget) -> None:
    assert target_by_address.info is not None
    r = kvctl("bench", "transfer", "-b", "1MiB", "-n", "8", "-i", "1", "-t", "tcp",
              "--peer", target_by_address.info.peer)
    assert r.exit_code == 2
    assert "the sweep needs" in r.stderr


def test_target_role_serves_until_told(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", "--role", "target", "-b", "4KiB", "-n", "4",
              "--serve-for", "0.2s", "--json")
    assert r.exit_code == 0, r.stderr
    info = r.json()
    assert info["kind"] == "bench.target"
    assert info["segment"] == "kvctl-bench"
    assert info["peer"].startswith("127.0.0.1:")


def test_unavailable_engine_is_skipped_with_a_hint(kvctl: Callable[..., Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api", "nixl_cu13",
                 "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, name, None)  # as if NIXL were not installed
    r = kvctl("bench", "transfer", *QUICK, "-t", "shm", "--op", "write", "--engine", "kvctl",
              "--engine", "nixl", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert [row["engine"] for row in doc["rows"]] == ["kvctl"]
    assert doc["skipped"][0]["engine"] == "nixl"
    assert "nixl-cu12" in doc["skipped"][0]["hint"]
    r = kvctl("bench", "transfer", *QUICK, "--engine", "nixl")
    assert r.exit_code == 3
    assert "nixl" in r.stderr
    assert "Hint:" in r.stderr


def test_help_has_an_example(kvctl: Callable[..., Any]) -> None:
    r = kvctl("bench", "transfer", "--help")
    assert r.exit_code == 0
    assert "Example:" in r.stdout


def test_runbook_steps_and_environment_accept_the_old_key(
        caplog: pytest.LogCaptureFixture) -> None:
    from kvctl.bench.spec import BenchSettings
    from kvctl.config import from_mapping, load_section
    from kvctl.runbook.steps import BenchTransferParams

    params = from_mapping(BenchTransferParams, {"expect_gbps": 5}, "book.yaml: step 1")
    assert params.expect_gbytes_per_s == 5
    assert "book.yaml: step 1: expect_gbps is deprecated" in caplog.text
    env = {"KVCTL_BENCH_EXPECT_GBPS": "7"}
    assert load_section(BenchSettings, env=env).expect_gbytes_per_s == 7
    both = {"KVCTL_BENCH_EXPECT_GBPS": "7", "KVCTL_BENCH_EXPECT_GBYTES_PER_S": "9"}
    assert load_section(BenchSettings, env=both).expect_gbytes_per_s == 9  # new name wins
    both_reversed = dict(reversed(list(both.items())))
    assert load_section(BenchSettings, env=both_reversed).expect_gbytes_per_s == 9
