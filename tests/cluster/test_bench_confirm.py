"""``cluster bench`` with simulated hosts (:mod:`tests.cluster.test_protocol`'s fakes): how a
failed pair is confirmed and what the diagnosis makes of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvctl.cluster.agent import Agent, JobContext
from kvctl.cluster.bench import ClusterBenchOptions, run_cluster_bench
from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.diagnosis import Endpoint
from kvctl.cluster.protocol import BENCH, TARGET, BenchParams, BenchResult, ClusterKeys
from kvctl.cluster.registry import read_hosts
from kvctl.commands.cluster import bench_hint
from kvctl.errors import KvctlError
from tests.cluster import test_protocol as proto
from tests.cluster.test_protocol import SWEEP, Counting, fake_bench, fake_target, record


@pytest.fixture
def service() -> Iterator[Counting]:
    client = Counting(proto.open_metadata("memory://cluster-bench-confirm"))
    yield client
    client.close()


def test_a_nic_no_pair_reaches_is_named_without_waiting_out_the_leases(
        service: Counting) -> None:
    """h0's rail 1 fails every pair (as a NIC that is down): it is named unreachable, the
    pairs stay failed (both agents answered), and no round waits a lease TTL to tell."""
    names = [f"h{i}" for i in range(4)]
    base = fake_bench({})

    def bench(ctx: JobContext) -> BenchResult:
        p: BenchParams = ctx.params(BenchParams)
        if p.local_address == "h0-r1" or p.peer.startswith("h0-r1:"):
            raise KvctlError(f"cannot reach the bench target at {p.peer}: timed out",
                                "check the link")
        result: BenchResult = base(ctx)
        return result

    handlers = {TARGET: fake_target, BENCH: bench}
    ttl_s = 2.0
    started = [Agent(service, record(n, ttl_s, 2), handlers=handlers).start() for n in names]
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP, per_rail=True))
    finally:
        for a in started:
            a.close()
    failed = {(o.a.label(), o.b.label()) for o in report.failed}
    assert len(failed) == 3, failed
    assert all("h0/nic1" in pair for pair in failed), failed
    assert not report.missing
    assert report.diagnosis.unreachable == (Endpoint("h0", "nic1"),)
    assert "no pair reached h0/nic1" in report.diagnosis.summary()
    assert report.diagnosis.culprits == ()
    # three rounds held a failed pair: waiting out the TTL in each took 3 x 3 s
    assert report.duration_s < ttl_s + 1.0, report.duration_s
    # every agent answered: the hint points at the link, not at an agent
    hint = bench_hint(report)
    assert hint.startswith("check the named host's link, NIC and cable"), hint
    assert "kvctl agent" not in hint


def test_the_vanished_warning_names_the_round_as_the_json_does(
        service: Counting, caplog: pytest.LogCaptureFixture) -> None:
    """The warning said "vanished (round 4)" where the JSON said ``round_index: 3``."""
    import logging
    import time

    handlers = {TARGET: fake_target, BENCH: fake_bench({})}
    started = [Agent(service, record(f"h{i}", 1.0), handlers=handlers).start()
               for i in range(4)]
    victim = started[3]
    assert victim._keeper is not None  # stop renewing without revoking: as if it died
    victim._keeper._stop.set()
    victim._keeper._wake.set()
    victim._stop.set()
    try:
        with caplog.at_level(logging.WARNING, logger="kvctl.cluster"), Coordinator(
                service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            time.sleep(0.01)
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP, schedule="rounds"))
    finally:
        for a in started[:3]:
            a.close()
    (missing,) = report.missing
    rounds = len(report.schedule.rounds)
    said = [r.getMessage() for r in caplog.records if "vanished" in r.getMessage()]
    assert said == [f"host h3 vanished in round {missing.round_index + 1} of {rounds} "
                    f"(round_index {missing.round_index} in --json)"], said


def _die(agent: Agent) -> None:
    """Stop renewing and following jobs without revoking or withdrawing: as if SIGKILLed."""
    assert agent._keeper is not None
    agent._keeper._stop.set()
    agent._keeper._wake.set()
    agent._stop.set()


def test_two_hosts_dying_in_one_round_are_both_missing(service: Counting) -> None:
    """Round 1 is h3->h0 and h1->h2; both targets die as their benches start, h0 with a 1 s
    lease, h2 with a 3 s one. The confirmation stopped waiting when the first lease went, so
    h2 (still registered for 2 s more) had its pair reported failed, not missing."""
    names = [f"h{i}" for i in range(4)]
    ttl = {"h0": 1.0, "h1": 3.0, "h2": 3.0, "h3": 3.0}
    base = fake_bench({})
    started: dict[str, Agent] = {}

    def bench(ctx: JobContext) -> BenchResult:
        p: BenchParams = ctx.params(BenchParams)
        peer = p.peer.split(":")[0]
        if peer in ("h0", "h2"):
            _die(started[peer])
            raise KvctlError(f"cannot reach the bench target at {p.peer}: connection reset",
                             "check the link")
        result: BenchResult = base(ctx)
        return result

    handlers = {TARGET: fake_target, BENCH: bench}
    for n in names:
        started[n] = Agent(service, record(n, ttl[n]), handlers=handlers).start()
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP, schedule="rounds"))
    finally:
        for n in ("h1", "h3"):
            started[n].close()
    assert {m.host for m in report.missing} == {"h0", "h2"}, report.missing
    assert report.failed == (), [(o.a.label(), o.b.label(), o.error) for o in report.failed]
    assert report.diagnosis.unreachable == ()
    # h0's and h2's pairs all went (missing or not run): nothing is left to call unreachable
    ok = {(o.a.label(), o.b.label()) for o in report.outcomes if o.state == "ok"}
    assert ok == {("h1", "h3")}, ok
