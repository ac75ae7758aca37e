"""``kvctl plan readback``: the arithmetic by hand, the bench file shape, the CLI."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvctl.errors import UsageError
from kvctl.models import resolve_model
from kvctl.plan.bandwidth import read_bench_file
from kvctl.plan.gpus import lookup_gpu
from kvctl.plan.readback import (
    NO_READ_HINT,
    PlanSettings,
    Winner,
    break_even,
    capacity,
    compare,
    plan_readback,
)
from kvctl.probe.nvml import NvmlGpu, NvmlReport, RecordedNvml
from kvctl.probe.types import Unavailable

KVB_70B = 80 * 8 * 128 * 2 * 2  # 327,680 bytes = 320 KiB


def test_compare_by_hand() -> None:
    case = compare(1000, kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000,
                   read_gbytes_per_s=20)
    assert case.kv_bytes == 327_680_000
    assert case.recompute_s == pytest.approx(0.2)  # 1000 / 5000
    assert case.readback_s == pytest.approx(0.016384)  # 327.68 MB / 20 GB/s
    assert case.speedup == pytest.approx(0.2 / 0.016384)
    assert case.winner is Winner.READ_BACK
    slow = compare(1000, kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000, read_gbytes_per_s=1)
    assert slow.readback_s == pytest.approx(0.32768)
    assert slow.winner is Winner.RECOMPUTE
    tie = compare(1000, kv_bytes_per_token=1_000_000, prefill_tokens_per_s=1000,
                  read_gbytes_per_s=1)
    assert tie.winner is Winner.TIE
    assert tie.speedup == pytest.approx(1.0)


def test_break_even_by_hand() -> None:
    # per token: recompute 200 us, read 16.384 us -> 500 us fixed cost repaid after 2.72 tokens
    be = break_even(kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000, read_gbytes_per_s=20,
                    latency_us=500)
    assert be.prefix_tokens == 3
    assert be.read_gbytes_per_s == pytest.approx(1.6384)  # 327,680 B x 5000/s
    # 100 ms fixed cost: 0.1 / (200e-6 - 16.384e-6) = 544.6 -> 545 tokens
    be = break_even(kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000, read_gbytes_per_s=20,
                    latency_us=100_000)
    assert be.prefix_tokens == 545
    at_545 = compare(545, kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000,
                     read_gbytes_per_s=20, latency_us=100_000)
    at_544 = compare(544, kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000,
                     read_gbytes_per_s=20, latency_us=100_000)
    assert at_545.winner is Winner.READ_BACK
    assert at_544.winner is Winner.RECOMPUTE
    never = break_even(kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000, read_gbytes_per_s=1.5)
    assert never.prefix_tokens is None
    assert "never wins" in never.summary
    always = break_even(kv_bytes_per_token=KVB_70B, prefill_tokens_per_s=5000, read_gbytes_per_s=2)
    assert always.prefix_tokens == 0
    assert "every prefix length" in always.summary


def test_capacity_million_tokens_of_70b() -> None:
    view = capacity(resolve_model("llama-3-70b"), 1000, 1000)
    assert view.tokens == 1_000_000
    assert view.kv_bytes == 327_680_000_000
    assert view.gb == pytest.approx(327.68)  # decimal GB
    assert view.gib == pytest.approx(305.18, abs=0.01)  # binary GiB


def test_gpu_tflops_mode_uses_two_flops_per_param() -> None:
    plan = plan_readback(PlanSettings(model="llama-3-8b", gpu_tflops=1000, efficiency=0.5,
                                      read_gbytes_per_s=10, prefix_tokens=(4096,)))
    assert plan.prefill_tokens_per_s == pytest.approx(1000e12 * 0.5 / (2 * 8.03e9))
    moe = plan_readback(PlanSettings(model="deepseek-v3", gpu_tflops=1000, read_gbytes_per_s=10))
    assert moe.prefill_tokens_per_s == pytest.approx(1000e12 * 0.5 / (2 * 37e9))  # activated


def write_bench(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    return path


def test_bench_file_picks_fastest_read_row(tmp_path: Path) -> None:
    doc = {"schema_version": 1, "kind": "bench-transfer", "rows": [
        {"op": "read", "block_size_bytes": 65536, "throughput_gbytes_per_s": 8.5},
        {"op": "READ", "block_size_bytes": 1048576, "throughput_gbytes_per_s": 21.0},
        {"op": "write", "block_size_bytes": 1048576, "throughput_gbytes_per_s": 40.0},
    ]}
    path = write_bench(tmp_path, doc)
    bw = read_bench_file(path)
    assert bw.gbytes_per_s == 21.0
    assert "row 1" in bw.source
    assert "1 MiB" in bw.source
    assert read_bench_file(path, size_bytes=65536).gbytes_per_s == 8.5
    with pytest.raises(UsageError, match="no read rows of block_size_bytes 4096"):
        read_bench_file(path, size_bytes=4096)
    # a bare list of rows, without op
    bare = write_bench(tmp_path, [{"throughput_gbytes_per_s": 3},
                                  {"throughput_gbytes_per_s": 4.5}])
    assert read_bench_file(bare).gbytes_per_s == 4.5
    # a result of row schema 1 names the field throughput_gbps
    old = write_bench(tmp_path, [{"op": "read", "throughput_gbps": 2.5}])
    assert read_bench_file(old).gbytes_per_s == 2.5


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"rows": []}, "no 'rows' list"),
        ({"results": [{"throughput_gbytes_per_s": 1}]}, "no 'rows' list"),
        ({"rows": [{"throughput_gbytes_per_s": "fast"}]},
         "row 0 has throughput_gbytes_per_s 'fast'"),
        ({"rows": [{"throughput_gbps": "fast"}]}, "row 0 has throughput_gbps 'fast'"),
        ({"rows": [{"op": "read", "throughput_gbytes_per_s": -1}]}, "expected a positive number"),
        ({"rows": [{"op": "write", "throughput_gbytes_per_s": 3}]}, "no read rows"),
        ({"rows": [3]}, "row 0 is not an object"),
    ],
)
def test_bad_bench_files(tmp_path: Path, doc: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        read_bench_file(write_bench(tmp_path, doc))
    assert info.value.hint


def test_cli_json_schema(kvctl: Callable[..., Any]) -> None:
    r = kvctl("plan", "readback", "--model", "LLAMA-3-70B", "--prefill-tps", "5000",
              "--read-gbytes-per-s", "20", "--prefix-tokens", "1000,4000", "--latency-us", "500",
              "--sessions", "1000", "--context-tokens", "1000", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["kind"] == "plan.readback"
    assert "schema_version" in doc
    assert doc["kv_bytes_per_token"] == KVB_70B
    assert [c["prefix_tokens"] for c in doc["cases"]] == [1000, 4000]
    first = doc["cases"][0]
    assert first["recompute_s"] == pytest.approx(0.2)
    assert first["readback_s"] == pytest.approx(0.016384 + 0.0005)
    assert first["winner"] == "read-back"
    assert doc["break_even"]["prefix_tokens"] == 3
    assert doc["capacity"]["kv_bytes"] == 327_680_000_000
    assert doc["assumptions"]
    assert doc["read_source"] == "--read-gbytes-per-s"


def test_cli_table_says_which_side_wins(kvctl: Callable[..., Any], tmp_path: Path) -> None:
    bench = write_bench(tmp_path, {"rows": [
        {"op": "read", "block_size_bytes": 4096, "throughput_gbytes_per_s": 1.0}]})
    r = kvctl("plan", "readback", "--model", "llama-3-70b", "--prefill-tps", "5000",
              "--bench-file", str(bench), "--sessions", "10", "--context-tokens", "100000")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("│ recompute │") == 5
    assert "│ read back │" not in r.stdout
    assert "never wins" in r.stdout
    assert "327.7 GB (decimal" in r.stdout
    assert "GiB (binary" in r.stdout
    assert "2 x params" not in r.stdout  # the FLOPs approximation is not used here
    flops = kvctl("plan", "readback", "--model", "llama-3-70b", "--gpu-tflops", "989",
                  "--read-gbytes-per-s", "50")
    assert "Assumes prefill FLOPs ~= 2 x params per token" in flops.stdout
    assert flops.stdout.count("│ read back │") == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no model given"),
        (("--model", "gpt-17", "--prefill-tps", "1", "--read-gbytes-per-s", "1"), "Llama-3-70B"),
        (("--model", "llama-3-8b", "--prefill-tps", "1", "--gpu-tflops", "1",
          "--read-gbytes-per-s", "1"), "both --prefill-tps and --gpu-tflops"),
        (("--model", "llama-3-8b", "--gpu", "H100", "--gpu-tflops", "1"),
         "both --gpu-tflops and --gpu"),
        (("--model", "llama-3-8b", "--gpu", "Radeon 9000"), "no peak TFLOP/s is known"),
        (("--model", "llama-3-8b", "--gpu", "H100", "--gpus", "0"), "--gpus 0"),
        (("--model", "llama-3-8b", "--prefill-tps", "1", "--read-gbytes-per-s", "0"),
         "--read-gbytes-per-s 0.0 is not a positive number"),
        (("--model", "llama-3-8b", "--gpu-tflops", "100", "--efficiency", "2",
          "--read-gbytes-per-s", "1"), "--efficiency 2.0 is outside"),
        (("--model", "llama-3-8b", "--prefill-tps", "1", "--read-gbytes-per-s", "1",
          "--prefix-tokens", "10,zero"), "--prefix-tokens"),
        (("--model", "llama-3-8b", "--prefill-tps", "1", "--read-gbytes-per-s", "1",
          "--sessions", "10"), "needs both --sessions and --context-tokens"),
        (("--model", "llama-3-8b", "--prefill-tps", "1", "--bench-file", "/nonexistent.json"),
         "cannot read bench result"),
    ],
)
def test_cli_bad_input_exits_2(
    kvctl: Callable[..., Any], args: tuple[str, ...], message: str
) -> None:
    r = kvctl("plan", "readback", "--no-nvml", *args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("Error: ")
    assert "\nHint: " in r.stderr
    assert message in r.stderr


def test_no_fixed_cost_means_one_side_wins_everywhere() -> None:
    plan = plan_readback(PlanSettings(model="qwen2.5-7b", prefill_tps=10_000, read_gbytes_per_s=5,
                                      prefix_tokens=(16, 1 << 20)))
    # 57,344 B/token: 11.5 us to read vs 100 us to recompute, at every length
    assert {c.winner for c in plan.cases} == {Winner.READ_BACK}
    assert all(math.isclose(c.speedup, 100e-6 / (57344 / 5e9)) for c in plan.cases)
    assert plan.break_even.prefix_tokens == 0


def _nvml(name: str | None, memory: int | None = 141 * 2**30) -> RecordedNvml:
    return RecordedNvml(NvmlReport("570.1", (NvmlGpu(0, "0000:18:00.0", name=name,
                                                      memory_total_bytes=memory),)))


def test_no_rate_still_sizes_the_kv() -> None:
    # The command: no rate at all. Sizing and the prefix table come back anyway.
    plan = plan_readback(PlanSettings(model="llama-3-70b", sessions=1000,
                                      context_tokens=1000))
    assert plan.prefill_tokens_per_s is None
    assert plan.read_gbytes_per_s is None
    assert plan.break_even is None
    assert plan.break_even_gbytes_per_s is None
    assert plan.sizing.kv_bytes_per_token == KVB_70B
    assert plan.sizing.tokens_per_gib == 2**30 // KVB_70B == 3276
    assert plan.sizing.tokens_per_tb == 10**12 // KVB_70B
    assert [c.kv_bytes for c in plan.cases] == [n * KVB_70B for n in (256, 1024, 4096, 16384,
                                                                      65536)]
    assert all(c.recompute_s is None and c.winner is None for c in plan.cases)
    assert plan.capacity is not None
    assert plan.capacity.kv_bytes == 327_680_000_000
    assert len(plan.missing) == 2
    assert "NVML not asked" in plan.prefill_source


def test_prefill_rate_from_the_gpu_nvml_reports() -> None:
    plan = plan_readback(PlanSettings(model="llama-3-8b", read_gbytes_per_s=10),
                         nvml=_nvml("NVIDIA H200"))
    assert plan.gpu is not None
    assert plan.gpu.name == "H200 SXM"
    assert plan.prefill_tokens_per_s == pytest.approx(989.4e12 * 0.5 / (2 * 8.03e9))
    assert "NVML GPU 0 'NVIDIA H200'" in plan.prefill_source
    assert plan.break_even is not None
    assert plan.sizing.gpu_memory_bytes == 141 * 2**30
    assert plan.sizing.tokens_per_gpu_memory == 141 * 2**30 // (32 * 8 * 128 * 2 * 2)
    assert any("dense BF16" in a for a in plan.assumptions)
    # An explicit rate wins over NVML; NVML still sizes the GPU's memory.
    given = plan_readback(PlanSettings(model="llama-3-8b", prefill_tps=100),
                          nvml=_nvml("NVIDIA H200"))
    assert given.prefill_tokens_per_s == 100
    assert given.gpu is None
    assert given.sizing.gpu_memory_bytes == 141 * 2**30


def test_unknown_or_absent_gpu_leaves_prefill_unknown_and_says_why() -> None:
    unknown = plan_readback(PlanSettings(model="llama-3-8b"), nvml=_nvml("NVIDIA A10G"))
    assert unknown.prefill_tokens_per_s is None
    assert "no peak TFLOP/s is known for 'NVIDIA A10G'" in unknown.prefill_source
    absent = plan_readback(PlanSettings(model="llama-3-8b"),
                           nvml=RecordedNvml(Unavailable("nvml", "no driver")))
    assert "NVML unavailable: no driver" in absent.prefill_source
    assert absent.sizing.gpu_memory_bytes is None


def test_prefill_only_gives_the_break_even_bandwidth() -> None:
    plan = plan_readback(PlanSettings(model="llama-3-70b", gpu="H100 SXM", gpus=8,
                                      prefix_tokens=(1000,)))
    tps = 8 * 989.4e12 * 0.5 / (2 * 70.55e9)
    assert plan.prefill_tokens_per_s == pytest.approx(tps, rel=1e-3)
    assert plan.break_even_gbytes_per_s == pytest.approx(KVB_70B * tps / 1e9, rel=1e-3)
    assert plan.cases[0].recompute_s == pytest.approx(1000 / tps, rel=1e-3)
    assert plan.cases[0].readback_s is None
    assert plan.missing == [NO_READ_HINT]


@pytest.mark.parametrize(("reported", "name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA A30", "A30", 165.0),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L40", "L40", 181.05),
    ("NVIDIA L4", "L4", 121.0),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", 125.0),
    ("Tesla V100-PCIE-16GB", "V100 PCIe", 112.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2),
    ("H100 SXM", "H100 SXM", 989.4),
])
def test_nvml_product_names_find_their_peak(reported: str, name: str, tflops: float) -> None:
    peak = lookup_gpu(reported)
    assert peak is not None
    assert (peak.name, peak.tflops) == (name, tflops)
    assert "nvidia.com" in peak.source


@pytest.mark.parametrize("reported", ["NVIDIA A10G", "NVIDIA H800", "AMD Instinct MI300X", ""])
def test_gpus_without_a_published_peak_are_not_guessed(reported: str) -> None:
    assert lookup_gpu(reported) is None


def test_cli_without_any_rate_exits_0_with_the_sizing(kvctl: Callable[..., Any]) -> None:
    r = kvctl("plan", "readback", "--model", "llama-3-70b", "--no-nvml")
    assert r.exit_code == 0, r.stderr
    assert "327,680 bytes (320 KiB) of KV per token" in r.stdout
    assert "3,276 tokens per GiB" in r.stdout
    assert "Prefill: unknown" in r.stdout
    assert "To compare, give a prefill rate" in r.stdout
    assert "To compare, give a read-back bandwidth" in r.stdout
    doc = kvctl("plan", "readback", "--model", "llama-3-70b", "--no-nvml", "--json").json()
    assert doc["prefill_tokens_per_s"] is None
    assert doc["sizing"]["kv_bytes_per_token"] == KVB_70B
    assert doc["cases"][0]["kv_bytes"] == 256 * KVB_70B
    assert doc["cases"][0]["recompute_s"] is None
    gpu = kvctl("plan", "readback", "--model", "llama-3-70b", "--gpu", "L40S",
                "--read-gbytes-per-s", "20", "--no-nvml")
    assert gpu.exit_code == 0, gpu.stderr
    assert "GPU peak 362.05 TFLOP/s (L40S)" in gpu.stdout
    assert "Break-even: reading back" in gpu.stdout
