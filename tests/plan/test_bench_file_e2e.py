"""kvctl bench transfer --json feeds kvctl plan readback --bench-file, unchanged."""

from pathlib import Path

import pytest


@pytest.mark.integration
def test_plan_reads_a_real_bench_result(kvctl, tmp_path: Path) -> None:
    bench = kvctl("bench", "transfer", "--json", "-t", "shm", "--op", "both", "-b", "64KiB",
                  "-n", "8", "-i", "20", "--warmup", "2")
    assert bench.exit_code == 0, bench.stderr
    doc = bench.json()
    reads = [r for r in doc["rows"] if r["op"] == "read"]
    assert reads
    path = tmp_path / "bench.json"
    path.write_text(bench.stdout)
    plan = kvctl("plan", "readback", "--json", "--model", "llama-3-8b", "--prefill-tps", "5000",
                 "--bench-file", str(path), "--bench-size", "64KiB")
    assert plan.exit_code == 0, plan.stderr
    used = plan.json()
    assert used["read_gbytes_per_s"] == max(r["throughput_gbytes_per_s"] for r in reads)
    assert str(path) in used["read_source"] or str(path) in str(used)
