"""``kvctl sim pool`` on the command line: JSON schema, rendering, plot, bad input."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SMALL = ("--sessions", "20", "--local-blocks", "100,50", "--pool-blocks", "5000")


def test_json_schema(kvctl: Callable[..., Any]) -> None:
    r = kvctl("sim", "pool", *SMALL, "--seed", "3", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["kind"] == "sim.pool"
    assert isinstance(doc["schema_version"], int)
    assert set(doc) >= {"settings", "workload", "cells", "floor", "floor_explanation",
                        "time_view"}
    assert doc["time_view"] is None
    assert doc["settings"]["local_blocks"] == [100, 50]
    assert doc["settings"]["seed"] == 3
    assert [(c["routing"], c["pool_blocks"], c["local_blocks"]) for c in doc["cells"]] == [
        ("random", 0, 100), ("random", 0, 50), ("random", 5000, 100), ("random", 5000, 50),
        ("cache-aware", 0, 100), ("cache-aware", 0, 50),
        ("cache-aware", 5000, 100), ("cache-aware", 5000, 50),
    ]
    for cell in doc["cells"]:
        assert set(cell) == {"routing", "local_blocks", "pool_blocks", "prefill_tokens",
                             "local_hit_tokens", "pool_hit_tokens", "recomputed_tokens",
                             "recompute_fraction"}
        assert cell["local_hit_tokens"] + cell["pool_hit_tokens"] + cell["recomputed_tokens"] \
            == cell["prefill_tokens"]
    assert doc["workload"]["pool_backend"] == "lru"
    again = kvctl("sim", "pool", *SMALL, "--seed", "3", "--json").json()
    assert again["cells"] == doc["cells"]  # --seed makes runs repeatable
    other = kvctl("sim", "pool", *SMALL, "--seed", "4", "--json").json()
    assert other["cells"] != doc["cells"]


def test_time_view_in_json_and_table(kvctl: Callable[..., Any]) -> None:
    args = (*SMALL, "--model", "llama-3-70b", "--prefill-tps", "5000", "--pool-gbytes-per-s", "20")
    doc = kvctl("sim", "pool", *args, "--json").json()
    view = doc["time_view"]
    assert view["kv_bytes_per_token"] == 327680
    assert view["model"] == "Llama-3-70B"
    assert len(view["rows"]) == 8
    row = view["rows"][2]  # random + pool, 100 blocks
    cell = doc["cells"][2]
    assert row["pool_read_s"] == pytest.approx(cell["pool_hit_tokens"] * 327680 / 20e9)
    r = kvctl("sim", "pool", *args)
    assert r.exit_code == 0
    assert "Prefill tokens recomputed" in r.stdout
    assert "cache-aware + shared pool" in r.stdout
    assert "Floor" in r.stdout
    assert "previous answer" in r.stdout
    assert "Prefill seconds" in r.stdout


def test_config_file_and_flags_layer(kvctl: Callable[..., Any], tmp_path: Path) -> None:
    cfg = tmp_path / "kvctl.yaml"
    cfg.write_text("sim:\n  sessions: 12\n  local_blocks: [30]\n  instances: 2\n")
    doc = kvctl("--config", str(cfg), "sim", "pool", "--instances", "3", "--json").json()
    assert doc["workload"]["spec"]["sessions"] == 12
    assert doc["workload"]["instances"] == 3  # the flag beats the file
    assert {c["local_blocks"] for c in doc["cells"]} == {30}


def test_plot_writes_png(kvctl: Callable[..., Any], tmp_path: Path) -> None:
    png = tmp_path / "pool.png"
    r = kvctl("sim", "pool", *SMALL, "--plot", str(png), "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(
    kvctl: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    r = kvctl("sim", "pool", *SMALL, "--plot", str(tmp_path / "x.png"))
    assert r.exit_code == 3
    assert "Error: unavailable: plotting needs matplotlib" in r.stderr
    assert "Hint: install the plot extra: pip install 'kvctl[plot]'" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--local-blocks", "8000,lots"), "--local-blocks"),
        (("--local-blocks", "-5"), "negative"),
        (("--min-turns", "4", "--max-turns", "2"), "--max-turns 2 is below --min-turns 4"),
        (("--answer-kv", "sometimes"), "--answer-kv"),
        (("--sessions", "0"), "--sessions 0 is not positive"),
        (("--pool-blocks", "0"), "--pool-blocks 0"),
        (("--model", "llama-3-70b"), "missing --prefill-tps, --pool-gbytes-per-s"),
        (("--model", "gpt-17", "--prefill-tps", "1", "--pool-gbytes-per-s", "1"), "unknown model"),
        (("--model", "llama-3-8b", "--prefill-tps", "-1", "--pool-gbytes-per-s", "1"),
         "--prefill-tps -1.0 is not a positive number"),
        (("--keep",), "--keep needs --store"),
    ],
)
def test_bad_input_exits_2_with_error_and_hint(
    kvctl: Callable[..., Any], args: tuple[str, ...], message: str
) -> None:
    r = kvctl("sim", "pool", "--sessions", "5", *args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("Error: ")
    assert message in r.stderr
    assert "\nHint: " in r.stderr
