"""Replay semantics: the floor by hand, monotonicity, the pool interface, the time view."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import UsageError
from kvctl.models import resolve_model
from kvctl.sim.pool import LruPool, PoolBackend
from kvctl.sim.replay import AnswerKv, Routing, floor, replay, run_grid
from kvctl.sim.timing import TimeModel, time_view
from kvctl.sim.workload import Workload, WorkloadSpec, generate


def small(seed: int, sessions: int = 20, **kw: int) -> Workload:
    return generate(WorkloadSpec(sessions=sessions, seed=seed, **kw))


def test_workload_shape() -> None:
    w = small(3, sessions=50)
    seen: dict[int, int] = {}
    for arrival in w.arrivals:  # each session's turns arrive in order, all of them
        assert arrival.turn == seen.get(arrival.session, 0)
        seen[arrival.session] = arrival.turn + 1
    for i, s in enumerate(w.sessions):
        assert 2 <= len(s.prompt_ends) <= 6
        assert seen[i] == len(s.prompt_ends)
        assert s.prompt_ends[0] == 512 + 128
        assert all(b - a == 384 for a, b in zip(s.prompt_ends, s.prompt_ends[1:], strict=False))
        assert len(s.keys) == len(s.tokens) // 16
    # sessions on the same system prompt share its 32 block keys, and nothing after it
    a, b = [s for s in w.sessions if s.system_prompt == w.sessions[0].system_prompt][:2]
    assert a.keys[:32] == b.keys[:32]
    assert a.keys[32] != b.keys[32]
    assert generate(WorkloadSpec(sessions=50, seed=3)).arrivals == w.arrivals  # repeatable


def test_floor_by_hand() -> None:
    w = small(1, sessions=40)
    turns = [len(s.prompt_ends) for s in w.sessions]
    prompts_used = len({s.system_prompt for s in w.sessions})
    fl = floor(w)
    assert fl.new_user_message_tokens == 128 * sum(turns)
    assert fl.previous_answer_tokens == 256 * sum(t - 1 for t in turns)
    assert fl.system_prompt_tokens == 512 * prompts_used
    assert fl.partial_block_tokens == 0
    assert fl.prefill_tokens == sum(640 * t + 384 * t * (t - 1) // 2 for t in turns)
    cached = floor(w, AnswerKv.CACHED)
    assert cached.previous_answer_tokens == 0
    assert cached.new_user_message_tokens == fl.new_user_message_tokens


def test_partial_blocks_are_recomputed() -> None:
    # 100-token user messages and 50-token answers do not fill 16-token blocks
    w = small(2, sessions=10, user_tokens=100, answer_tokens=50)
    fl = floor(w)
    assert fl.partial_block_tokens > 0
    assert fl.recomputed_tokens == (fl.new_user_message_tokens + fl.previous_answer_tokens
                                    + fl.system_prompt_tokens + fl.partial_block_tokens)


def test_big_pool_reaches_the_floor_with_any_routing() -> None:
    w = small(4, sessions=60)
    fl = floor(w)
    for routing in Routing:
        cell = replay(w, routing=routing, instances=4, local_blocks=100,
                      pool=LruPool(10**6), pool_blocks=10**6)
        assert cell.recomputed_tokens == fl.recomputed_tokens
        assert cell.local_hit_tokens + cell.pool_hit_tokens + cell.recomputed_tokens == (
            cell.prefill_tokens)


def test_no_cache_recomputes_everything_and_one_instance_equals_routings() -> None:
    w = small(5)
    none = replay(w, routing=Routing.RANDOM, instances=4, local_blocks=0, pool=None)
    assert none.recompute_fraction == 1.0
    one = [replay(w, routing=r, instances=1, local_blocks=500, pool=None) for r in Routing]
    assert one[0].recomputed_tokens == one[1].recomputed_tokens


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    sessions=st.integers(3, 25),
    capacities=st.lists(st.integers(0, 600), min_size=2, max_size=4, unique=True),
    routing=st.sampled_from(list(Routing)),
)
def test_more_local_capacity_never_recomputes_more(
    seed: int, sessions: int, capacities: list[int], routing: Routing
) -> None:
    w = small(seed, sessions=sessions, system_prompt_tokens=64, user_tokens=32,
              answer_tokens=48)
    results = [
        replay(w, routing=routing, instances=3, local_blocks=c, pool=None).recomputed_tokens
        for c in sorted(capacities)
    ]
    assert results == sorted(results, reverse=True)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    local=st.integers(0, 300),
    pool_blocks=st.integers(1, 400),
    routing=st.sampled_from(list(Routing)),
)
def test_a_pool_never_recomputes_more(
    seed: int, local: int, pool_blocks: int, routing: Routing
) -> None:
    w = small(seed, sessions=15, system_prompt_tokens=64, user_tokens=32, answer_tokens=48)
    without = replay(w, routing=routing, instances=3, local_blocks=local, pool=None)
    pool = LruPool(pool_blocks)
    with_pool = replay(w, routing=routing, instances=3, local_blocks=local, pool=pool,
                       pool_blocks=pool_blocks)
    assert with_pool.recomputed_tokens <= without.recomputed_tokens
    assert with_pool.local_hit_tokens == without.local_hit_tokens
    assert pool.used_blocks <= pool_blocks


class DictPool:
    """A PoolBackend that never evicts and records the calls it gets."""

    name = "dict"

    def __init__(self, _capacity_blocks: int) -> None:
        self.keys: set[bytes] = set()
        self.reads = 0

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.keys for k in keys]

    def read_many(self, keys: Sequence[bytes]) -> None:
        assert all(k in self.keys for k in keys)
        self.reads += len(keys)

    def insert_many(self, keys: Sequence[bytes]) -> None:
        self.keys.update(keys)


def test_any_pool_backend_plugs_in() -> None:
    w = small(6, sessions=30)
    pools: list[DictPool] = []

    def factory(capacity: int) -> PoolBackend:
        pools.append(DictPool(capacity))
        return pools[-1]

    cells = run_grid(w, instances=4, local_blocks=[50], pool_blocks=10**6, pool_factory=factory)
    reference = run_grid(w, instances=4, local_blocks=[50], pool_blocks=10**6,
                         pool_factory=LruPool)
    assert isinstance(pools[0], PoolBackend)
    assert len(pools) == 2
    assert [c.recomputed_tokens for c in cells] == [c.recomputed_tokens for c in reference]
    assert sum(p.reads for p in pools) * 16 == sum(c.pool_hit_tokens for c in cells)


def test_time_view_by_hand() -> None:
    w = small(7, sessions=30)
    cells = run_grid(w, instances=2, local_blocks=[40], pool_blocks=10**5, pool_factory=LruPool)
    costs = TimeModel(resolve_model("llama-3-70b"), prefill_tokens_per_s=4000.0,
                      pool_read_gbytes_per_s=10.0)
    rows = time_view(cells, costs)
    no_pool, with_pool = cells[0], cells[1]
    assert with_pool.pool_hit_tokens > 0
    row = rows[1]
    assert row.recompute_s == pytest.approx(with_pool.recomputed_tokens / 4000)
    assert row.pool_read_s == pytest.approx(with_pool.pool_hit_tokens * 327680 / 10e9)
    assert row.saved_vs_no_cache_s == pytest.approx(with_pool.prefill_tokens / 4000
                                                    - row.prefill_s)
    assert row.saved_vs_no_pool_s == pytest.approx(no_pool.recomputed_tokens / 4000
                                                   - row.prefill_s)
    assert rows[0].saved_vs_no_pool_s is None
    with pytest.raises(UsageError):
        TimeModel(resolve_model("llama-3-8b"), prefill_tokens_per_s=0.0, pool_read_gbytes_per_s=1.0)


def test_bad_workloads_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="--max-turns 1 is below --min-turns 2"):
        generate(WorkloadSpec(max_turns=1))
    with pytest.raises(UsageError, match="--user-tokens 0"):
        generate(WorkloadSpec(user_tokens=0))
    with pytest.raises(UsageError, match="--instances"):
        replay(small(0, sessions=2), routing=Routing.RANDOM, instances=0, local_blocks=1,
               pool=None)
