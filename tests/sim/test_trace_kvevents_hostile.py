"""``sim trace --format kv-events`` on records of hostile publishers (the watch records what
it receives, whatever it is)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import msgspec

from kvctl.sim.trace_kvevents import read_kv_events


def _record(path: Path, batches: list[list[dict[str, Any]]]) -> Path:
    lines = [{"format": "kvctl.kv-events", "version": 1, "profile": "vllm:sha256_cbor",
              "block_size": 16}]
    for i, events in enumerate(batches):
        payload = msgspec.msgpack.encode([1.0 + i, events, 0])
        lines.append({"instance": "a", "recv_ts": 1.0 + i, "seq": i, "replayed": False,
                      "topic": "", "payload": base64.b64encode(payload).decode()})
    path.write_text("".join(json.dumps(doc) + "\n" for doc in lines))
    return path


def _stored(h: int, parent: int | None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": list(range(16)), "block_size": 16}


def test_a_parent_loop_ends_the_chain(tmp_path: Path) -> None:
    # 1's parent is 2 and 2's parent is 1: the chain used to be followed 2**20 links deep
    # for every event below the loop (about a second each)
    batches = [[_stored(1, 2)], [_stored(2, 1)]] + [[_stored(3 + i, 1)] for i in range(20)]
    started = time.monotonic()
    requests = list(read_kv_events(_record(tmp_path / "loop.jsonl", batches)))
    assert time.monotonic() - started < 5
    assert [list(r.hash_ids) for r in requests[:3]] == [[2, 1], [2, 1, 2], [2, 1, 3]]
    assert max(len(r.hash_ids) for r in requests) == 3
