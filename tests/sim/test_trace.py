"""The trace replay engine: semantics on hand-worked traces, the published samples, the LRU."""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvctl.cache import LruCache
from kvctl.errors import UsageError
from kvctl.sim.trace import (
    UNLIMITED,
    TraceConfig,
    TraceRouting,
    _IdLru,
    grid,
    replay_trace,
)

FIXTURES = Path(__file__).parent / "fixtures"
CONVERSATION = FIXTURES / "mooncake_conversation_300.jsonl"
SYNTHETIC = FIXTURES / "mooncake_synthetic_300.jsonl.gz"


def write(path: Path, rows: Sequence[tuple[float, int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 1,
                                        "hash_ids": ids}) + "\n" for ts, n, ids in rows))
    return path


def test_single_lru_by_hand(tmp_path: Path) -> None:
    # 10 tokens per id, a local cache of 2 ids:
    # r1 [1,2] miss -> {1,2}; r2 [1,3] hits 1 -> {1,3}; r3 [1,2] hits 1 -> {1,2};
    # r4 [1,2,5] hits 2 (20 tokens) -> {2,5}; r5 [2] in 5 tokens hits 1 id: min(10, 5) = 5.
    trace = write(tmp_path / "t.jsonl", [(0, 20, [1, 2]), (1, 15, [1, 3]), (2, 20, [1, 2]),
                                         (3, 25, [1, 2, 5]), (4, 5, [2])])
    replay = replay_trace(trace, [TraceConfig(20)], block_tokens=10)
    (result,) = replay.results
    assert result.input_tokens == 85
    assert result.local_hit_tokens == 10 + 10 + 20 + 5
    assert result.pool_hit_tokens == 0
    assert result.recompute_tokens == 85 - 45
    # the ideal: r2 10, r3 20, r4 20, r5: 2 was seen -> min(10, 5) = 5
    assert replay.summary.ideal_hit_tokens == 55
    assert replay.summary.ideal_hit_ratio == pytest.approx(55 / 85)


def test_local_then_pool_by_hand(tmp_path: Path) -> None:
    # 2 instances round-robin, 1 id of local cache each, an unlimited pool:
    # r1 (i0) [1,2]: nothing; pool gets 1,2; i0 keeps {2}.
    # r2 (i1) [1,2]: local 0, pool 1,2 -> 20 pool tokens; i1 keeps {2}.
    # r3 (i0) [1,3]: local 1? no (i0 has {2}); pool 1 yes, 3 no -> 10 pool; pool gets 3.
    # r4 (i1) [2]:   local hit 10.
    trace = write(tmp_path / "t.jsonl", [(0, 20, [1, 2]), (5, 20, [1, 2]), (6, 20, [1, 3]),
                                         (9, 10, [2])])
    config = TraceConfig(10, 2, TraceRouting.ROUND_ROBIN, UNLIMITED)
    bounded = TraceConfig(10, 2, TraceRouting.ROUND_ROBIN, 1000)
    alone = TraceConfig(10, 2, TraceRouting.ROUND_ROBIN)
    replay = replay_trace(trace, [config, bounded, alone], block_tokens=10)
    pooled, lru_pooled, local_only = replay.results
    assert (pooled.local_hit_tokens, pooled.pool_hit_tokens) == (10, 30)
    assert pooled.hit_ratio == pytest.approx(40 / 70)
    assert lru_pooled.hit_ratio == pooled.hit_ratio  # a pool that never fills = unlimited
    assert [(i.requests, i.input_tokens, i.local_hit_tokens, i.pool_hit_tokens)
            for i in pooled.per_instance] == [(2, 40, 0, 10), (2, 30, 10, 20)]
    assert (local_only.local_hit_tokens, local_only.pool_hit_tokens) == (10, 0)
    assert replay.summary.duration_s == pytest.approx(0.009)
    assert pooled.label == "2 x 10 round-robin + pool unlimited"


def test_a_small_pool_evicts_least_recent(tmp_path: Path) -> None:
    # no local cache, a pool of 2 ids: [1,2] -> {1,2}; [3] -> {2,3}; [1] misses; [2] hits.
    trace = write(tmp_path / "t.jsonl", [(0, 20, [1, 2]), (1, 10, [3]), (2, 10, [1]),
                                         (3, 10, [3])])
    (result,) = replay_trace(trace, [TraceConfig(0, pool_tokens=20)], block_tokens=10).results
    # [1] misses and goes in: {3, 1}; [3] hits.
    assert result.pool_hit_tokens == 10
    assert result.local_hit_tokens == 0


def test_prefix_aware_takes_the_longest_prefix_then_the_least_loaded(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [
        (0, 30, [1, 2, 3]),  # all empty: tie -> lowest index 0
        (1, 10, [7]),        # tie at 0 -> least loaded: 1 (0 has 30 tokens)
        (2, 30, [1, 2, 9]),  # longest prefix: instance 0 (2 ids)
        (3, 10, [8]),        # tie -> least loaded: 2
        (4, 10, [7]),        # instance 1 holds [7]
    ])
    config = TraceConfig(1000, 3, TraceRouting.PREFIX_AWARE)
    (result,) = replay_trace(trace, [config], block_tokens=10).results
    assert [i.requests for i in result.per_instance] == [2, 2, 1]
    assert [i.local_hit_tokens for i in result.per_instance] == [20, 10, 0]


def test_random_routing_is_seeded(tmp_path: Path) -> None:
    rows = [(float(i), 40, [i % 7, 100 + i % 5, 200 + i]) for i in range(300)]
    trace = write(tmp_path / "t.jsonl", rows)
    config = [TraceConfig(40, 4, TraceRouting.RANDOM)]
    one = replay_trace(trace, config, block_tokens=10, seed=1).results[0]
    again = replay_trace(trace, config, block_tokens=10, seed=1).results[0]
    other = replay_trace(trace, config, block_tokens=10, seed=2).results[0]
    assert one.per_instance == again.per_instance
    assert [i.requests for i in one.per_instance] != [i.requests for i in other.per_instance]


def _independent(path: Path) -> tuple[int, int, int, int, float, int]:
    """Requests, input and output tokens, ideal hit tokens, duration (s), distinct ids —
    with json and a set, not kvctl."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    seen: set[int] = set()
    hits = 0
    for row in rows:
        run = 0
        for key in row["hash_ids"]:
            if key not in seen:
                break
            run += 1
        hits += min(run * 512, row["input_length"])
        seen.update(row["hash_ids"])
    return (len(rows), sum(r["input_length"] for r in rows),
            sum(r["output_length"] for r in rows), hits,
            (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000, len(seen))


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC], ids=["conversation", "synthetic.gz"])
def test_the_published_samples(path: Path) -> None:
    replay = replay_trace(path, grid([10**12]))
    s = replay.summary
    requests, inputs, outputs, hits, duration, distinct = _independent(path)
    assert (s.requests, s.input_tokens, s.output_tokens) == (requests, inputs, outputs)
    assert s.requests == 300
    assert s.input_tokens_mean == pytest.approx(inputs / 300)
    assert s.ideal_hit_tokens == hits
    assert s.duration_s == pytest.approx(duration)
    assert s.distinct_ids == distinct
    assert s.block_tokens == 512
    # a cache larger than the whole trace is the ideal
    assert replay.results[0].hit_ratio == pytest.approx(s.ideal_hit_ratio)
    assert sum(b.uses for b in s.reuse) == s.block_uses
    assert sum(b.ids for b in s.reuse) == s.distinct_ids


def test_conversation_sample_figures_by_hand() -> None:
    # Computed once with json + a set (see _independent); pinned so that a change shows.
    s = replay_trace(CONVERSATION, grid([0])).summary
    assert (s.requests, s.input_tokens, s.output_tokens, s.ideal_hit_tokens) == (
        300, 4_269_971, 113_079, 345_966)
    assert s.duration_s == pytest.approx(102.0)


def test_hit_ratio_grows_with_capacity() -> None:
    results = replay_trace(CONVERSATION, grid([0, 10**5, 10**6, 10**7])).results
    ratios = [r.hit_ratio for r in results]
    assert ratios[0] == 0
    assert ratios == sorted(ratios)


def test_id_lru_keeps_what_lru_cache_keeps() -> None:
    """The fast int LRU evicts exactly as kvctl.cache.LruCache does under the replay's use."""
    rng = random.Random(5)
    for capacity in (1, 3, 17):
        fast, reference = _IdLru(capacity), LruCache[int](capacity)
        for _ in range(400):
            keys = [rng.randrange(40) for _ in range(rng.randrange(1, 8))]
            run = fast.hit_run(keys, 0)
            ref_run = 0
            while ref_run < len(keys) and reference.lookup(keys[ref_run]):
                ref_run += 1
            assert run == ref_run
            fast.insert_from(keys, run)
            for key in keys:
                reference.insert(key)
            assert list(fast.ids) == list(reference)


def test_grid_shapes() -> None:
    assert grid([1, 2]) == [TraceConfig(1), TraceConfig(2)]
    cluster = grid([5], instances=4, routings=[TraceRouting.RANDOM, TraceRouting.PREFIX_AWARE],
                   pool_tokens=100)
    assert [(c.instances, c.routing, c.pool_tokens) for c in cluster] == [
        (1, TraceRouting.SINGLE, None), (4, TraceRouting.RANDOM, None),
        (4, TraceRouting.RANDOM, 100), (4, TraceRouting.PREFIX_AWARE, None),
        (4, TraceRouting.PREFIX_AWARE, 100)]


@pytest.mark.parametrize(("config", "words"), [
    (TraceConfig(-1), "negative"), (TraceConfig(1, 0), "--instances"),
    (TraceConfig(1, pool_tokens=0), "--pool-tokens")])
def test_bad_configurations(tmp_path: Path, config: TraceConfig, words: str) -> None:
    trace = write(tmp_path / "t.jsonl", [(0, 10, [1])])
    with pytest.raises(UsageError) as err:
        replay_trace(trace, [config])
    assert words in err.value.cause
    assert err.value.hint


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(UsageError) as err:
        replay_trace(empty, grid([10]))
    assert "no requests" in err.value.cause


def test_the_timeline_doubles_its_window_and_keeps_every_token(tmp_path: Path) -> None:
    # 1,000 requests 1 s apart: more than 256 one-second windows, so they widen to 4 s
    rows = [(1000.0 * i, 10, [i % 3]) for i in range(1000)]
    replay = replay_trace(write(tmp_path / "t.jsonl", rows), [TraceConfig(100)], block_tokens=10)
    timeline = replay.results[0].timeline
    assert len(timeline) <= 256
    assert timeline[0].width_s == 4.0
    assert sum(p.requests for p in timeline) == 1000
    assert timeline[0].hit_ratio == pytest.approx(1 / 4)  # ids 0, 1, 2 miss once each
    assert timeline[-1].hit_ratio == 1.0
    assert [p.start_s for p in timeline[:3]] == [0.0, 4.0, 8.0]


def test_prefix_aware_without_local_caches_is_least_loaded(tmp_path: Path) -> None:
    rows = [(float(i), 10 * (1 + i % 2), [1]) for i in range(6)]
    config = TraceConfig(0, 3, TraceRouting.PREFIX_AWARE, UNLIMITED)
    (result,) = replay_trace(write(tmp_path / "t.jsonl", rows), [config], block_tokens=10).results
    assert [i.requests for i in result.per_instance] == [2, 2, 2]
    assert result.pool_hit_tokens == 5 * 10  # one 10-token id each, whatever the input
