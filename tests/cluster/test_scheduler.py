"""Pair plans: the tournament covers every pair once in O(N) rounds; the planner's figures."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.cluster.scheduler import (
    WRITES_PER_PAIR,
    all_pairs,
    plan_figures,
    plan_schedule,
    round_robin,
)
from kvctl.errors import UsageError


def _hosts(n: int) -> list[str]:
    return [f"h{i}" for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 41))
def test_the_tournament_covers_every_pair_once_in_o_n_rounds(n: int) -> None:
    hosts = _hosts(n)
    rounds = round_robin(hosts)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    seen = [frozenset(p) for r in rounds for p in r]
    assert len(seen) == len(set(seen)) == n * (n - 1) // 2
    assert set(seen) == {frozenset(p) for p in itertools.combinations(hosts, 2)}
    for r in rounds:
        busy = [h for p in r for h in p]
        assert len(busy) == len(set(busy))  # every host in at most one pair
        assert len(r) == n // 2
    initiated = collections.Counter(a for r in rounds for a, _ in r)
    for host in hosts:  # each host initiates about half of its n - 1 pairs
        assert abs(2 * initiated[host] - (n - 1)) <= 1, (host, initiated[host])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(3, 30), k=st.integers(1, 200), seed=st.integers(0, 1000))
def test_a_sample_has_k_pairs_spread_evenly(n: int, k: int, seed: int) -> None:
    hosts = _hosts(n)
    plan = plan_schedule(hosts, mode="rounds", pairs=k, seed=seed)
    total = n * (n - 1) // 2
    assert len(plan.pairs) == min(k, total)
    assert len({frozenset(p) for p in plan.pairs}) == len(plan.pairs)
    for r in plan.rounds:
        busy = [h for p in r for h in p]
        assert len(busy) == len(set(busy))
    if k < total:
        assert plan.sampled
        per_host = collections.Counter(h for p in plan.pairs for h in p)
        counts = [per_host.get(h, 0) for h in hosts]
        assert max(counts) - min(counts) <= 2
        assert plan == plan_schedule(hosts, mode="rounds", pairs=k, seed=seed)


def test_auto_is_sequential_for_small_clusters_and_rounds_above() -> None:
    small = plan_schedule(_hosts(4))
    assert small.mode == "sequential"
    assert small.max_concurrency == 1
    assert set(map(frozenset, small.pairs)) == set(map(frozenset, all_pairs(_hosts(4))))
    five = plan_schedule(_hosts(5))
    assert five.mode == "rounds"
    assert len(five.rounds) == 5
    assert five.max_concurrency == 2
    assert len(five.pairs) == 10


def test_bad_plans_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown"):
        plan_schedule(_hosts(3), mode="mesh")
    with pytest.raises(UsageError, match="twice"):
        plan_schedule(["a", "a"])
    with pytest.raises(UsageError, match="below 1"):
        plan_schedule(_hosts(3), pairs=0)
    with pytest.raises(UsageError, match="no pair"):
        plan_figures(1, pair_duration_s=1.0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), mode=st.sampled_from(["sequential", "rounds"]),
       k=st.one_of(st.none(), st.integers(1, 300)))
def test_the_figures_are_those_of_the_plan_itself(n: int, mode: str, k: int | None) -> None:
    plan = plan_schedule(_hosts(n), mode=mode, pairs=k)
    figures = plan_figures(n, pair_duration_s=2.0, mode=mode, pairs=k)
    assert figures.rounds == len(plan.rounds)
    assert figures.pairs == len(plan.pairs)
    assert figures.pairs_per_round == plan.max_concurrency
    assert figures.wall_time_s == pytest.approx(len(plan.rounds) * (2.0 + figures.round_overhead_s))


def test_the_planner_with_watches_for_1000_and_10000_hosts() -> None:
    """etcd pushes jobs and statuses: no polling reads, 4 hand-offs of 10 ms per round."""
    k = plan_figures(1000, pair_duration_s=3.0)
    assert k.watch
    assert k.round_overhead_s == pytest.approx(0.5 + 4 * 0.01)
    assert k.wall_time_s == pytest.approx(999 * 3.54)  # 3,536 s: 59 min
    assert k.reads_per_s == pytest.approx(1002 / 30)  # 33 stream reopens/s, at most
    assert k.watch_streams == 1002
    assert k.events_per_s == pytest.approx(k.writes_per_s) == pytest.approx(500 * 8 / 3.54)
    m = plan_figures(10_000, pair_duration_s=3.0)
    assert m.reads_per_s == pytest.approx(10_002 / 30)
    assert m.events_per_s == pytest.approx(5000 * 8 / 3.54)  # 11,299 events/s


def test_the_planner_for_1000_and_10000_hosts() -> None:
    """Polled services (file, http, Redis): 3 s per pair (the default sweep), TTL 10 s,
    agents polling every 0.5 s, the client every 0.2 s."""
    k = plan_figures(1000, pair_duration_s=3.0, watch=False)
    assert (k.pairs, k.rounds, k.pairs_per_round) == (499_500, 999, 500)
    assert k.round_overhead_s == pytest.approx(1.9)
    assert k.wall_time_s == pytest.approx(999 * 4.9)  # 4,895 s: 1 h 22 min
    assert k.metadata_keys_peak == 2 * 1000 + 1 + 4 * 500
    assert k.writes_per_pair == WRITES_PER_PAIR == 8
    assert k.writes_per_s == pytest.approx(500 * 8 / 4.9)  # 816 writes/s
    assert k.lease_renewals_per_s == pytest.approx(1001 * 3 / 10)
    assert k.reads_per_s == pytest.approx(1000 / 0.5 + 2 / 0.2)  # 2,010 reads/s

    m = plan_figures(10_000, pair_duration_s=3.0, watch=False)
    assert (m.pairs, m.rounds, m.pairs_per_round) == (49_995_000, 9_999, 5_000)
    assert m.wall_time_s == pytest.approx(9_999 * 4.9)  # 48,995 s: 13.6 h
    assert m.metadata_keys_peak == 40_001
    assert m.writes_per_s == pytest.approx(5000 * 8 / 4.9)  # 8,163 writes/s
    assert m.reads_per_s == pytest.approx(20_010)

    sample = plan_figures(10_000, pair_duration_s=3.0, pairs=50_000,
                          watch=False)  # 10 pairs per host
    assert sample.rounds == 10
    assert sample.wall_time_s == pytest.approx(49.0)

    rails = plan_figures(1000, pair_duration_s=3.0, rails=8)  # 8 NICs per host, rail by rail
    assert rails.writes_per_pair == 64
    assert rails.metadata_keys_peak == 2001 + 4 * 500 * 8
