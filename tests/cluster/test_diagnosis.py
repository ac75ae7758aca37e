"""The diagnosis is a pure function: properties over generated matrices, and a few examples."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvctl.cluster.diagnosis import Endpoint, PairValue, diagnose


def _hosts(n: int) -> list[str]:
    return [f"h{i + 1}" for i in range(n)]


def _matrix(hosts: list[str], base: float, noise: list[float], *, bad: set[str] | None = None,
            factor: float = 1.0) -> list[PairValue]:
    out = []
    for (a, b), eps in zip(itertools.combinations(hosts, 2), itertools.cycle(noise),
                           strict=False):
        value = base * (1 + eps)
        if bad and (a in bad or b in bad):
            value *= factor
        out.append(PairValue(Endpoint(a), Endpoint(b), value))
    return out


noise_lists = st.lists(st.floats(-0.1, 0.1), min_size=1, max_size=60)
bases = st.floats(0.01, 1000.0)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(5, 14), base=bases, noise=noise_lists, factor=st.floats(0.02, 0.45),
       seed=st.integers(0, 10_000))
def test_one_planted_slow_host_is_named_and_only_it(n: int, base: float, noise: list[float],
                                                    factor: float, seed: int) -> None:
    hosts = _hosts(n)
    bad = random.Random(seed).choice(hosts)
    result = diagnose(_matrix(hosts, base, noise, bad={bad}, factor=factor))
    assert [c.subject for c in result.culprits] == [Endpoint(bad)]
    culprit = result.culprits[0]
    assert culprit.slow_pairs == n - 1 == culprit.measured_pairs
    assert {e.peer.host for e in culprit.row + culprit.column} == set(hosts) - {bad}
    assert all(e.slow for e in culprit.row + culprit.column)
    assert not result.unexplained


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 14), base=bases, noise=noise_lists)
def test_equal_links_name_nobody(n: int, base: float, noise: list[float]) -> None:
    result = diagnose(_matrix(_hosts(n), base, noise))
    assert not result.slow
    assert not result.culprits
    assert result.healthy


@settings(max_examples=100, deadline=None)
@given(n=st.integers(3, 10), values=st.lists(st.floats(0.0, 100.0), min_size=45, max_size=45),
       scale=st.floats(0.001, 1000.0))
def test_scaling_every_value_changes_nothing_but_the_units(n: int, values: list[float],
                                                           scale: float) -> None:
    pairs = [PairValue(Endpoint(a), Endpoint(b), v)
             for (a, b), v in zip(itertools.combinations(_hosts(n), 2), values, strict=False)]
    assume(all(p.gbps is not None and p.gbps * scale > 0 for p in pairs))
    median = statistics.median(p.gbps or 0.0 for p in pairs)
    assume(all(abs((p.gbps or 0.0) - 0.7 * median) > 1e-9 * median for p in pairs))  # no ties
    scaled = [PairValue(p.a, p.b, (p.gbps or 0.0) * scale) for p in pairs]
    one, two = diagnose(pairs), diagnose(scaled)
    assert [(s.a, s.b) for s in one.slow] == [(s.a, s.b) for s in two.slow]
    assert [c.subject for c in one.culprits] == [c.subject for c in two.culprits]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(3, 10), values=st.lists(st.floats(0.0, 100.0), min_size=45, max_size=45),
       fraction=st.floats(0.05, 0.95))
def test_slow_pairs_are_exactly_those_below_the_fraction_of_the_median(
        n: int, values: list[float], fraction: float) -> None:
    pairs = [PairValue(Endpoint(a), Endpoint(b), v)
             for (a, b), v in zip(itertools.combinations(_hosts(n), 2), values, strict=False)]
    result = diagnose(pairs, slow_fraction=fraction)
    assert result.median_gbps is not None
    assert result.threshold_gbps is not None
    below = {(p.a, p.b) for p in pairs if (p.gbps or 0.0) < fraction * result.median_gbps}
    assert {(s.a, s.b) for s in result.slow} == below
    for culprit in result.culprits:
        assert culprit.slow_pairs >= 2
        assert culprit.slow_pairs / culprit.measured_pairs > 0.5
    explained = sum(c.slow_pairs for c in result.culprits)
    assert explained + len(result.unexplained) == len(result.slow)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(5, 10), noise=noise_lists, factor=st.floats(0.02, 0.45),
       seed=st.integers(0, 10_000))
def test_renaming_hosts_renames_the_culprit(n: int, noise: list[float], factor: float,
                                            seed: int) -> None:
    hosts = _hosts(n)
    rng = random.Random(seed)
    bad = rng.choice(hosts)
    renamed = dict(zip(hosts, rng.sample([f"node-{i}" for i in range(n)], n), strict=True))
    pairs = _matrix(hosts, 1.0, noise, bad={bad}, factor=factor)
    moved = [PairValue(Endpoint(renamed[p.a.host]), Endpoint(renamed[p.b.host]), p.gbps)
             for p in pairs]
    rng.shuffle(moved)
    assert [c.subject.host for c in diagnose(moved).culprits] == [renamed[bad]]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(4, 10), noise=noise_lists, lost=st.integers(1, 5))
def test_unmeasured_pairs_are_listed_never_slow(n: int, noise: list[float], lost: int) -> None:
    pairs = _matrix(_hosts(n), 2.0, noise)
    gone = {(p.a, p.b) for p in pairs[:lost]}
    pairs = [PairValue(p.a, p.b, None) if (p.a, p.b) in gone else p for p in pairs]
    result = diagnose(pairs)
    assert {(p.a, p.b) for p in result.unmeasured} == gone
    assert not {(s.a, s.b) for s in result.slow} & gone
    assert result.measured == len(pairs) - len(gone)
    assert not result.healthy


@settings(max_examples=80, deadline=None)
@given(n=st.integers(4, 10), noise=noise_lists, factor=st.floats(0.02, 0.45),
       seed=st.integers(0, 10_000))
def test_a_bad_nic_is_named_rather_than_its_host(n: int, noise: list[float], factor: float,
                                                 seed: int) -> None:
    """Two rails; only rail 1 of one host is slow: that host's NIC is named, not the host."""
    hosts = _hosts(n)
    bad = random.Random(seed).choice(hosts)
    jitter = itertools.cycle(noise)
    pairs = []
    for a, b in itertools.combinations(hosts, 2):
        for rail in ("nic0", "nic1"):
            value = 1.0 + next(jitter)
            if rail == "nic1" and bad in (a, b):
                value *= factor
            pairs.append(PairValue(Endpoint(a, rail), Endpoint(b, rail), value))
    result = diagnose(pairs)
    assert [c.subject for c in result.culprits] == [Endpoint(bad, "nic1")]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(8, 14), noise=noise_lists, factor=st.floats(0.02, 0.4),
       seed=st.integers(0, 10_000))
def test_two_bad_hosts_in_a_large_enough_cluster_are_both_named(
        n: int, noise: list[float], factor: float, seed: int) -> None:
    hosts = _hosts(n)
    bad = set(random.Random(seed).sample(hosts, 2))
    result = diagnose(_matrix(hosts, 1.0, noise, bad=bad, factor=factor))
    assert {c.subject.host for c in result.culprits} == bad


def test_a_noisy_pair_elsewhere_does_not_add_a_culprit() -> None:
    hosts = _hosts(5)
    pairs = _matrix(hosts, 1.0, [0.0], bad={"h3"}, factor=0.25)
    pairs = [PairValue(p.a, p.b, 0.5) if (p.a.host, p.b.host) == ("h1", "h2") else p
             for p in pairs]
    result = diagnose(pairs)
    assert [c.subject.label() for c in result.culprits] == ["h3"]
    assert [(s.a.host, s.b.host) for s in result.unexplained] == [("h1", "h2")]
    assert "likely culprit: h3" in result.summary()


@settings(max_examples=60, deadline=None)
@given(noise=noise_lists, factor=st.floats(0.02, 0.4), seed=st.integers(0, 3))
def test_four_hosts_name_a_host_at_under_half_the_others(noise: list[float], factor: float,
                                                        seed: int) -> None:
    """At N = 4 the bad host owns half the pairs and the median sits between them."""
    hosts = _hosts(4)
    result = diagnose(_matrix(hosts, 1.0, noise, bad={hosts[seed]}, factor=factor))
    assert [c.subject.host for c in result.culprits] == [hosts[seed]]


def test_three_hosts_cannot_be_told_apart_and_say_so() -> None:
    pairs = _matrix(_hosts(3), 1.0, [0.0], bad={"h3"}, factor=0.25)
    result = diagnose(pairs)
    assert not result.culprits
    assert result.note is not None
    assert "4 hosts" in result.note


def test_evidence_is_the_culprits_row_and_column() -> None:
    pairs = [PairValue(Endpoint("h1"), Endpoint("h2"), 1.0),
             PairValue(Endpoint("h1"), Endpoint("h3"), 0.2),
             PairValue(Endpoint("h3"), Endpoint("h2"), 0.25),
             PairValue(Endpoint("h4"), Endpoint("h3"), 0.3),
             PairValue(Endpoint("h4"), Endpoint("h1"), 1.1),
             PairValue(Endpoint("h2"), Endpoint("h4"), 0.9)]
    (culprit,) = diagnose(pairs).culprits
    assert culprit.subject == Endpoint("h3")
    assert [(e.peer.host, e.gbps) for e in culprit.row] == [("h2", 0.25)]
    assert [(e.peer.host, e.gbps) for e in culprit.column] == [("h1", 0.2), ("h4", 0.3)]
    assert culprit.median_gbps == 0.25


def test_nothing_measured_and_bad_arguments() -> None:
    empty = diagnose([PairValue(Endpoint("a"), Endpoint("b"), None)])
    assert empty.median_gbps is None
    assert empty.summary() == "no pair was measured"
    with pytest.raises(ValueError, match="slow_fraction"):
        diagnose([], slow_fraction=1.5)
    with pytest.raises(ValueError, match="bad value"):
        diagnose([PairValue(Endpoint("a"), Endpoint("b"), -1.0)])


def _rails(hosts: list[str], dead: set[Endpoint]) -> list[PairValue]:
    pairs = []
    for a, b in itertools.combinations(hosts, 2):
        for rail in ("nic0", "nic1"):
            ends = (Endpoint(a, rail), Endpoint(b, rail))
            lost = any(e in dead or e.host_only in dead for e in ends)
            pairs.append(PairValue(*ends, None if lost else 1.0))
    return pairs


@pytest.mark.parametrize("n", [3, 4, 6])
def test_a_nic_no_pair_reached_is_named_not_its_host(n: int) -> None:
    """A dead rail has no value to be slow with: it used to be named by nobody."""
    hosts = _hosts(n)
    result = diagnose(_rails(hosts, {Endpoint("h2", "nic1")}))
    assert result.unreachable == (Endpoint("h2", "nic1"),)
    assert not result.culprits
    assert "no pair reached h2/nic1" in result.summary()


def test_a_host_no_pair_reached_is_named_as_the_host() -> None:
    result = diagnose(_rails(_hosts(5), {Endpoint("h4")}))
    assert result.unreachable == (Endpoint("h4"),)


def test_scattered_failures_and_total_failure_name_nobody_unreachable() -> None:
    pairs = _matrix(_hosts(6), 1.0, [0.0])
    scattered = [PairValue(p.a, p.b, None) if i % 4 == 0 else p for i, p in enumerate(pairs)]
    assert diagnose(scattered).unreachable == ()
    assert diagnose([PairValue(p.a, p.b, None) for p in pairs]).unreachable == ()
