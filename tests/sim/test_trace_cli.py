"""``kvctl sim trace`` on the command line: JSON, table, cost view, plot, and bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvctl.sim import traceformat
from tests.fixtures.schemas import validate_document

FIXTURES = Path(__file__).parent / "fixtures"
CONVERSATION = str(FIXTURES / "mooncake_conversation_300.jsonl")
SYNTHETIC = str(FIXTURES / "mooncake_synthetic_300.jsonl.gz")
Kvctl = Callable[..., Any]


def test_json_document(kvctl: Kvctl) -> None:
    r = kvctl("sim", "trace", CONVERSATION, "--capacity-tokens", "100k,1M", "--instances", "4",
              "--routing", "random,round-robin,prefix-aware", "--pool-tokens", "4M", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "sim.trace"
    assert doc["requests"] == 300
    assert doc["input_tokens_mean"] == pytest.approx(4_269_971 / 300)
    assert doc["output_tokens_mean"] == pytest.approx(113_079 / 300)
    assert doc["ideal_hit_ratio"] == pytest.approx(345_966 / 4_269_971)
    rows = [(x["instances"], x["routing"], x["capacity_tokens"], x["pool_tokens"])
            for x in doc["results"]]
    assert rows[:2] == [(1, "single", 100_000, None), (1, "single", 1_000_000, None)]
    assert (4, "prefix-aware", 1_000_000, 4_000_000) in rows
    assert len(rows) == 2 + 3 * 2 * 2
    for x in doc["results"]:
        assert 0 <= x["hit_ratio"] <= doc["ideal_hit_ratio"] + 1e-12 or x["instances"] > 1
        assert x["local_hit_tokens"] + x["pool_hit_tokens"] + x["recompute_tokens"] == \
            x["input_tokens"]
    assert doc["cost"] is None


def test_gz_and_plain_agree(kvctl: Kvctl, tmp_path: Path) -> None:
    import gzip

    plain = tmp_path / "s.jsonl"
    plain.write_bytes(gzip.decompress(Path(SYNTHETIC).read_bytes()))
    a = kvctl("sim", "trace", SYNTHETIC, "--json").json()
    b = kvctl("sim", "trace", str(plain), "--json").json()
    assert a["results"] == b["results"]
    assert a["trace"]["ideal_hit_ratio"] == b["trace"]["ideal_hit_ratio"]


def test_table_for_people(kvctl: Kvctl) -> None:
    r = kvctl("sim", "trace", CONVERSATION, "--instances", "2", "--pool-tokens", "unlimited",
              env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())  # the summary sentence wraps where the path makes it
    assert "300 requests" in text
    assert "ideal prefix hit ratio 8.1%" in text
    assert "unlimited" in text
    assert "Block ids by uses" in text


def test_a_narrow_terminal_wraps_figures_but_never_cuts_them(kvctl: Kvctl) -> None:
    r = kvctl("sim", "trace", CONVERSATION, "--instances", "2", "--pool-tokens", "unlimited",
              "--model", "llama-3-70b", "--prefill-tps", "1000", "--nic-gbytes-per-s", "10",
              env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.stderr
    assert "\u2026" not in r.stdout  # Rich's ellipsis: a count cut short
    assert "3,924,0" in r.stdout  # the pooled row's recompute tokens, whole or folded


def test_cost_view(kvctl: Kvctl) -> None:
    r = kvctl("sim", "trace", CONVERSATION, "--capacity-tokens", "0", "--instances", "2",
              "--routing", "round-robin", "--pool-tokens", "unlimited", "--model",
              "llama-3-70b", "--prefill-tps", "1000", "--nic-gbytes-per-s", "10", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "sim.trace"
    cost = doc["cost"]
    assert cost["kv_bytes_per_token"] == 327_680
    assert cost["nic_source"] == "--nic-gbytes-per-s"
    pooled = doc["results"][-1]
    row = cost["rows"][-1]
    hits = pooled["local_hit_tokens"] + pooled["pool_hit_tokens"]
    assert pooled["local_hit_tokens"] == 0  # no local cache: every hit is read back
    assert row["gpu_seconds_saved"] == pytest.approx(hits / 1000)
    assert row["gpu_seconds_no_cache"] == pytest.approx(4_269_971 / 1000)
    rate = pooled["pool_hit_tokens"] * 327_680 / 102.0 / 1e9
    assert row["pool_readback_gbytes_per_s"] == pytest.approx(rate)
    per = [p["readback_gbytes_per_s"] for p in row["per_instance"]]
    assert sum(per) == pytest.approx(rate)
    assert row["busiest_nic_share"] == pytest.approx(max(per) / 10)
    table = kvctl("sim", "trace", CONVERSATION, "--model", "llama-3-70b", "--gpu", "H100 SXM")
    assert table.exit_code == 0, table.stderr
    assert "Cost view" in table.stdout


def test_cost_flags_need_a_model(kvctl: Kvctl) -> None:
    r = kvctl("sim", "trace", CONVERSATION, "--prefill-tps", "1000")
    assert r.exit_code == 2
    assert "--model" in r.stderr


def test_plot(kvctl: Kvctl, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "hit.png"
    r = kvctl("sim", "trace", CONVERSATION, "--capacity-tokens", "10k,100k,1M", "--instances",
              "2", "--pool-tokens", "1M", "--plot", str(out))
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("flags", "words"), [
    (["--capacity-tokens", "3x"], "not a token count"),
    (["--capacity-tokens", "1,,2"], "empty entry"),
    (["--routing", "sticky"], "round-robin"),
    (["--pool-tokens", "lots"], "--pool-tokens"),
    (["--instances", "0"], "--instances"),
    (["--format", "csv"], "mooncake"),
    (["--block-tokens", "0"], "--block-tokens"),
])
def test_bad_flags(kvctl: Kvctl, flags: list[str], words: str) -> None:
    r = kvctl("sim", "trace", CONVERSATION, *flags)
    assert r.exit_code == 2
    assert words in r.stderr
    assert "Hint:" in r.stderr


GOOD = {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}


def _lines(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


BAD = {
    "timestamp goes back": (_lines(GOOD, {**GOOD, "timestamp": 10}, {**GOOD, "timestamp": 5}),
                            3, "before the previous one"),
    "missing field": (_lines(GOOD, {"timestamp": 1, "input_length": 5}), 2, "hash_ids"),
    "negative length": (_lines({**GOOD, "input_length": -1}), 1, "negative"),
    "negative output": (_lines(GOOD, GOOD, {**GOOD, "output_length": -4}), 3, "negative"),
    "too many ids": (_lines(GOOD, {**GOOD, "input_length": 1025, "hash_ids": [1, 2, 3, 4]}),
                     2, "allows at most 3"),
    "not json": (_lines(GOOD, "{oops"), 2, "not a JSON object"),
    "wrong type": (_lines({**GOOD, "hash_ids": "abc"}), 1, "hash_ids"),
    "not an object": (_lines(GOOD, "[1, 2]"), 2, "line 2"),
    "infinite time": (_lines(GOOD, '{"timestamp": 1e999, "input_length": 1, "hash_ids": []}'),
                      2, "out of range"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_name_file_and_line(kvctl: Kvctl, tmp_path: Path, case: str) -> None:
    text, line, words = BAD[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    r = kvctl("sim", "trace", str(path))
    assert r.exit_code == 2, r.stderr
    assert f"Error: {path} line {line}: " in r.stderr
    assert words in r.stderr
    assert "Hint:" in r.stderr


def test_a_huge_line_is_refused_not_read(kvctl: Kvctl, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traceformat, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "huge.jsonl"
    ids = ", ".join(str(i) for i in range(2000))
    path.write_text(_lines(GOOD) + '{"timestamp": 1, "input_length": 1, "hash_ids": [' + ids
                    + "]}\n")
    r = kvctl("sim", "trace", str(path))
    assert r.exit_code == 2
    assert f"{path} line 2: the line is longer than 4,096 bytes" in r.stderr
    assert "Hint:" in r.stderr


def test_the_default_bound_is_64_mib() -> None:
    assert traceformat.MAX_LINE_BYTES == 64 * 2**20


def test_missing_file(kvctl: Kvctl, tmp_path: Path) -> None:
    r = kvctl("sim", "trace", str(tmp_path / "none.jsonl"))
    assert r.exit_code == 2
    assert "none.jsonl" in r.stderr


def test_sim_pool_is_unchanged(kvctl: Kvctl) -> None:
    doc = kvctl("sim", "pool", "--sessions", "10", "--local-blocks", "100", "--json").json()
    assert doc["kind"] == "sim.pool"
    assert len(doc["cells"]) == 4
