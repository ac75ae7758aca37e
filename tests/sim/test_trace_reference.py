"""``kvctl sim trace --json`` against an independent replay written from docs/traffic.md.

The reference below knows nothing of kvctl.sim.trace: plain dicts and OrderedDicts, one
eviction after every insert, straight from the rules in "Semantics" and "Routing". It is
compared with the command's JSON on many small random traces that have what the format
allows and real traces rarely show: ids repeated inside a request, ids shared at other
positions, no ids, a last id for a partial block, equal timestamps.
"""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.schemas import validate_document

Kvctl = Callable[..., Any]
Row = tuple[float, int, list[int]]


class _Lru:
    """LRU set with a capacity in ids (None: never evicts), evicting after each insert."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.held = capacity, collections.OrderedDict[int, None]()

    def prefix(self, ids: list[int], start: int = 0) -> int:
        run = 0
        while start + run < len(ids) and ids[start + run] in self.held:
            run += 1
        return run

    def use(self, ids: list[int]) -> None:
        for key in ids:
            self.held[key] = None
            self.held.move_to_end(key)
            if self.capacity is not None and len(self.held) > self.capacity:
                self.held.popitem(last=False)


def reference(rows: list[Row], block: int, capacity: int, k: int, routing: str,
              pool: int | str | None, seed: int) -> list[tuple[int, int, int, int]]:
    """Per instance: (requests, input tokens, local hit tokens, pool hit tokens)."""
    local_ids = capacity // block
    caches = [_Lru(local_ids) for _ in range(k)]
    shared = None if pool is None else _Lru(None if pool == "unlimited" else int(pool) // block)
    rng = random.Random(f"route:{seed}")  # "seeded by --seed": the one detail taken from kvctl
    out = [[0, 0, 0, 0] for _ in range(k)]
    for i, (_, tokens, ids) in enumerate(rows):
        if k == 1:
            where = 0
        elif routing == "round-robin":
            where = i % k
        elif routing == "random":
            where = rng.randrange(k)
        else:  # prefix-aware: longest local prefix, then fewest input tokens, then lowest index
            runs = [c.prefix(ids) if local_ids else 0 for c in caches]
            where = min(range(k), key=lambda j: (-runs[j], out[j][1], j))
        local = caches[where].prefix(ids) if local_ids else 0
        hit = local
        if shared is not None and local < len(ids):
            hit += shared.prefix(ids, local)
            shared.use(ids[local:hit])   # a pool read counts as a use
            shared.use(ids[hit:])        # the pool gets what the instance computed
        if local_ids:
            caches[where].use(ids)
        local_tokens, hit_tokens = min(local * block, tokens), min(hit * block, tokens)
        row = out[where]
        row[0] += 1
        row[1] += tokens
        row[2] += local_tokens
        row[3] += hit_tokens - local_tokens
    return [(a, b, c, d) for a, b, c, d in out]


def ideal(rows: list[Row], block: int) -> int:
    cache = _Lru(None)
    hits = 0
    for _, tokens, ids in rows:
        hits += min(cache.prefix(ids) * block, tokens)
        cache.use(ids)
    return hits


def random_trace(rng: random.Random, block: int) -> list[Row]:
    rows: list[Row] = []
    chains: list[list[int]] = []
    ts = 0.0
    for _ in range(rng.randint(1, 40)):
        if chains and rng.random() < 0.6:  # continue or branch an earlier prefix
            base = rng.choice(chains)
            ids = base[:rng.randint(0, len(base))]
        else:
            ids = []
        ids = ids + [rng.randrange(30) for _ in range(rng.randint(0, 5))]
        if ids and rng.random() < 0.1:
            ids.append(ids[0])  # an id repeated inside a request
        chains.append(ids)
        n = len(ids)
        low = (n - 1) * block + 1 if n else 0
        tokens = rng.randint(low, n * block + rng.choice([0, 0, block, 3 * block]))
        ts += rng.choice([0.0, 0.0, 1.0, 250.0, 1234.5])
        rows.append((ts, tokens, ids))
    return rows


def _write(path: Path, rows: list[Row]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 3,
                                        "hash_ids": ids}) + "\n" for ts, n, ids in rows))
    return path


@pytest.mark.parametrize("case", range(60))
def test_json_agrees_with_the_reference_replay(kvctl: Kvctl, tmp_path: Path, case: int) -> None:
    rng = random.Random(case)
    block = rng.choice([1, 2, 3, 16, 512])
    rows = random_trace(rng, block)
    capacities = sorted({rng.choice([0, 1, block - 1, block, 2 * block, 3 * block + 1,
                                     5 * block, 40 * block]) for _ in range(3)})
    k = rng.choice([1, 2, 3, 5])
    pool = rng.choice([None, "unlimited", str(block), str(2 * block + 1), str(4 * block),
                       str(block - 1) if block > 1 else "unlimited"])
    seed = rng.randrange(5)
    args = ["sim", "trace", str(_write(tmp_path / "t.jsonl", rows)), "--block-tokens",
            str(block), "--capacity-tokens", ",".join(map(str, capacities)), "--instances",
            str(k), "--routing", "random,round-robin,prefix-aware", "--seed", str(seed), "--json"]
    if pool is not None:
        args[-1:-1] = ["--pool-tokens", pool]
    r = kvctl(*args)
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "sim.trace"
    assert doc["requests"] == len(rows)
    assert doc["trace"]["ideal_hit_tokens"] == ideal(rows, block)
    assert doc["trace"]["input_tokens"] == sum(t for _, t, _ in rows)
    assert doc["trace"]["duration_s"] == pytest.approx((rows[-1][0] - rows[0][0]) / 1000)
    seen: set[int] = set()
    occurs: collections.Counter[int] = collections.Counter()
    again = 0
    for _, _, ids in rows:
        for key in ids:
            again += key in seen
            seen.add(key)
            occurs[key] += 1
    uses = sum(occurs.values())
    assert doc["trace"]["distinct_ids"] == len(occurs)
    assert doc["trace"]["block_uses"] == uses
    assert doc["trace"]["any_position_id_ratio"] == pytest.approx(again / uses if uses else 0)
    buckets = {b["label"]: (b["ids"], b["uses"]) for b in doc["trace"]["reuse"]}
    for label, low, high in (("1", 1, 1), ("2-10", 2, 10), ("11-100", 11, 100)):
        inside = [n for n in occurs.values() if low <= n <= high]
        assert buckets[label] == (len(inside), sum(inside)), label
    want_rows = len(capacities) * (1 + (pool is not None and k == 1)
                                   + (3 * (1 + (pool is not None)) if k > 1 else 0))
    assert len(doc["results"]) == want_rows
    for res in doc["results"]:
        pool_tokens = res["pool_tokens"]
        want = reference(rows, block, res["capacity_tokens"], res["instances"], res["routing"],
                         pool_tokens, seed)
        got = [(i["requests"], i["input_tokens"], i["local_hit_tokens"], i["pool_hit_tokens"])
               for i in res["per_instance"]]
        assert got == want, res["label"]
        hits = sum(w[2] + w[3] for w in want)
        assert res["hit_ratio"] == pytest.approx(hits / max(1, sum(w[1] for w in want)))
        assert res["recompute_tokens"] == sum(w[1] - w[2] - w[3] for w in want)
