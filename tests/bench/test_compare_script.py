"""benchmarks/bench_transfer_compare.py writes the README's markdown table."""

from pathlib import Path

import pytest

from benchmarks.bench_transfer_compare import main

pytestmark = pytest.mark.integration


def test_compare_writes_a_markdown_table(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    assert main(["--engine", "kvctl", "--block-size", "4KiB,16KiB", "--batch-size", "8",
                 "--duration", "0.05", "--op", "write", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "| op | block | kvctl GB/s | raw TCP loopback GB/s (same shape) |"
    assert lines[2].startswith("| write | 4 KiB | ")
    assert lines[3].startswith("| write | 16 KiB | ")
    assert "measured in the same run with each row's block and batch size" in out.read_text()
