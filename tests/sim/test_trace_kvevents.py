"""``kvctl sim trace --format kv-events``: a watch's --record file replayed as a trace
(streams recorded from vLLM 0.33.0's own publisher, tests/keys/events/)."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

from tests.fixtures.cli import CliResult

EVENTS = Path(__file__).resolve().parents[1] / "keys" / "events"


def test_a_record_replays_as_a_trace(kvctl: Callable[..., CliResult], tmp_path: Path) -> None:
    # two instances in one record, as one watch of both writes it (the header once)
    a = (EVENTS / "vllm_sha256_cbor.jsonl").read_text().splitlines()
    b = (EVENTS / "vllm_sha256_cbor_variant.jsonl").read_text().splitlines()[1:]
    record = tmp_path / "kv.jsonl.gz"
    record.write_bytes(gzip.compress(("\n".join(a + b) + "\n").encode()))
    result = kvctl("sim", "trace", str(record), "--format", "kv-events", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["requests"] == 22  # one per BlockStored, both instances
    assert doc["settings"]["block_tokens"] == 16
    assert doc["output_tokens_mean"] == 0
    # multi-turn sessions and a system prompt both instances hashed alike: prefixes repeat
    assert 0.3 < doc["ideal_hit_ratio"] < 1
