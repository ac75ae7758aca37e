"""The agent/client protocol in one process: simulated hosts with stand-in work.

Agents and a coordinator share one ``memory://`` metadata service; the agents' handlers are
fakes that answer at once, so these tests check the protocol itself: the writes a pair costs
(the planner's figure), vanished hosts, token refusals, leases.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvctl.bench.spec import CPU0, Op, Sweep
from kvctl.cluster.agent import Agent, JobContext, agree_policy, check_policy
from kvctl.cluster.bench import ClusterBenchOptions, run_cluster_bench
from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.protocol import (
    BENCH,
    TARGET,
    BenchParams,
    BenchResult,
    ClusterKeys,
    HostRecord,
    Job,
    Rail,
    RowSummary,
    TargetParams,
    TargetReady,
    raw,
    seal,
)
from kvctl.cluster.registry import read_hosts
from kvctl.cluster.scheduler import WRITES_PER_PAIR, plan_figures
from kvctl.errors import AuthError
from kvctl.metadata import LeaseId, MetadataClient, open_metadata

TOKEN = "protocol-secret-1"


class Counting(MetadataClient):
    """A metadata client that counts puts and deletes by key prefix."""

    def __init__(self, inner: MetadataClient) -> None:
        self.inner = inner
        self.url = inner.url
        self.writes: list[str] = []
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        with self._lock:
            self.writes.append(key)
        self.inner.put(key, value, lease=lease)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def list(self, prefix: str) -> dict[str, bytes]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> bool:
        with self._lock:
            self.writes.append(key)
        return self.inner.delete(key)

    def grant_lease(self, ttl_s: float) -> LeaseId:
        return self.inner.grant_lease(ttl_s)

    def keepalive(self, lease: LeaseId) -> None:
        self.inner.keepalive(lease)

    def revoke(self, lease: LeaseId) -> None:
        self.inner.revoke(lease)

    def close(self) -> None:
        self.inner.close()


def fake_target(ctx: JobContext) -> None:
    address = ctx.params(TargetParams).address or ctx.host.address
    ctx.ready(TargetReady(peer=f"{address}:7400", address=address, engines=["kvctl"]))
    ctx.hold()


def fake_bench(speed: dict[str, float]) -> Any:
    """Pairs run at the slower end's speed (by host, or by rail address ``host-rN``)."""

    def run(ctx: JobContext) -> BenchResult:
        p: BenchParams = ctx.params(BenchParams)
        target = p.peer.split(":")[0]
        rail = target.partition("-")[2]
        me = f"{ctx.host.hostname}-{rail}" if rail else ctx.host.hostname
        gbps = min(speed.get(ctx.host.hostname, 1.0), speed.get(target.partition("-")[0], 1.0),
                   speed.get(me, 1.0), speed.get(target, 1.0))
        return BenchResult(rows=[RowSummary("kvctl", op, "tcp", 65536, 8, gbps, 0, True,
                                            f"tcp -> {p.peer}", 80, 0.1)
                                 for op in ("read", "write")])
    return run


def record(name: str, ttl_s: float = 1.0, rails: int = 0) -> HostRecord:
    rail_list = [Rail(i, f"nic{i}", f"{name}-r{i}") for i in range(rails)]
    return HostRecord(hostname=name, agent_id=secrets.token_hex(6), version="0.1.0", pid=1,
                      started_at=time.time(), address=name,
                      addresses=[name, *(r.address for r in rail_list)], rails=rail_list,
                      lease_ttl_s=ttl_s, poll_s=0.02)


SWEEP = Sweep(ops=(Op.READ, Op.WRITE), transports=("tcp",), block_sizes_bytes=(65536,),
              batch_sizes=(8,), duration_s=0.1, verify=True, local=CPU0, remote=CPU0)


@pytest.fixture
def service() -> Iterator[Counting]:
    client = Counting(open_metadata(f"memory://cluster-{secrets.token_hex(4)}"))
    yield client
    client.close()


def agents(service: MetadataClient, names: list[str], *, token: str | None = None,
           speed: dict[str, float] | None = None, ttl_s: float = 1.0,
           rails: int = 0) -> list[Agent]:
    handlers = {TARGET: fake_target, BENCH: fake_bench(speed or {})}
    return [Agent(service, record(n, ttl_s, rails), handlers=handlers, token=token).start()
            for n in names]


def test_a_pair_costs_the_planners_writes(service: Counting) -> None:
    names = [f"h{i}" for i in range(6)]
    started = agents(service, names)
    try:
        registered = len(service.writes)
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02, ttl_s=2) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP))
            # let the agents see their jobs gone and withdraw their statuses
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and service.list(
                    ClusterKeys().status_prefix(coord.run_id)):
                time.sleep(0.02)
    finally:
        for a in started:
            a.close()
    assert len(report.outcomes) == 15
    assert all(o.state == "ok" and o.verified for o in report.outcomes)
    job_writes = [k for k in service.writes[registered:] if "/jobs/" in k or "/status/" in k]
    assert len(job_writes) == WRITES_PER_PAIR * 15
    figures = plan_figures(6, pair_duration_s=1.0)
    assert figures.rounds == len(report.schedule.rounds) == 5
    assert figures.pairs_per_round == report.schedule.max_concurrency == 3


def test_the_diagnosis_of_a_simulated_slow_host(service: Counting) -> None:
    names = [f"h{i}" for i in range(5)]
    started = agents(service, names, speed={"h2": 0.25})
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP))
    finally:
        for a in started:
            a.close()
    assert [c.subject.host for c in report.diagnosis.culprits] == ["h2"]
    assert not report.ok


def test_a_vanished_agent_is_missing_within_its_ttl(service: Counting) -> None:
    names = [f"h{i}" for i in range(4)]
    started = agents(service, names, ttl_s=1.0)
    victim = started[3]
    # stop renewing without revoking: as if the process died
    assert victim._keeper is not None
    victim._keeper._stop.set()
    victim._keeper._wake.set()
    victim._stop.set()
    died = time.time()
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            time.sleep(0.01)
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP, schedule="rounds"))
    finally:
        for a in started[:3]:
            a.close()
    assert [m.host for m in report.missing] == ["h3"]
    assert report.missing[0].detected_at - died < 1.0 + 0.5
    states = {(o.a.host, o.b.host): o.state for o in report.outcomes}
    assert all(s == "ok" for pair, s in states.items() if "h3" not in pair)
    assert all(s in ("missing", "not-run") for pair, s in states.items() if "h3" in pair), states
    assert not report.ok


def test_an_unsigned_job_is_dropped_unanswered(service: Counting) -> None:
    (agent,) = agents(service, ["h0"], token=TOKEN)
    try:
        keys = ClusterKeys()
        job = Job(job_id="r1-1", run_id="r1", kind=TARGET, host="h0", issued_at=0.0,
                  hold_s=5.0, params=raw({"region_bytes": 1, "engines": [], "transports": []}))
        service.put(keys.job("h0", "r1-1"), seal(keys.job("h0", "r1-1"), "job", job, None))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and agent.dropped == 0:
            time.sleep(0.02)
        # counted, and nothing written for whoever posted it (no signed status to collect)
        assert agent.dropped == 1
        assert agent.refused == 0
        assert service.list(keys.status_prefix("r1")) == {}
        # a client without the token is stopped by the policy before it posts anything
        with pytest.raises(AuthError, match="requires the shared token"):
            Coordinator(service, keys, token=None).start()
        with pytest.raises(AuthError, match="another token"):
            Coordinator(service, keys, token="wrong").start()
    finally:
        agent.close()


def test_an_agent_without_the_token_cannot_join(service: Counting) -> None:
    (agent,) = agents(service, ["h0"], token=TOKEN)
    try:
        with pytest.raises(AuthError, match="KVCTL_TOKEN is not set"):
            Agent(service, record("h1"), handlers={}, token=None).start()
        # and what it would write anyway is not trusted by holders of the token
        keys = ClusterKeys()
        service.put(keys.host("h1"), seal(keys.host("h1"), "host", record("h1"), None))
        entries = {e.name: e for e in read_hosts(service, keys, TOKEN)}
        assert entries["h0"].usable
        assert not entries["h1"].usable
        assert "not signed" in (entries["h1"].problem or "")
    finally:
        agent.close()


def test_policy_is_written_once_and_agreed(service: Counting) -> None:
    keys = ClusterKeys("blue")
    assert check_policy(service, keys, None) is None  # reading writes nothing
    agree_policy(service, keys, None, who="h9")
    assert service.get(keys.policy) is None  # nor does a member without a token
    agree_policy(service, keys, TOKEN, who="h0")
    agree_policy(service, keys, TOKEN, who="h1")
    stored = service.get(keys.policy)
    assert stored is not None
    assert msgspec.json.decode(stored)["written_by"] == "h0"
    assert TOKEN not in stored.decode()


def test_a_closed_agent_leaves_nothing(service: Counting) -> None:
    (agent,) = agents(service, ["h0"])
    keys = ClusterKeys()
    assert service.get(keys.host("h0")) is not None
    agent.close()
    assert service.get(keys.host("h0")) is None
    assert service.get(keys.alive("h0")) is None


def test_rail_by_rail_names_the_bad_nic(service: Counting) -> None:
    names = [f"h{i}" for i in range(4)]
    started = agents(service, names, speed={"h2-r1": 0.2}, rails=2)
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP, per_rail=True))
    finally:
        for a in started:
            a.close()
    assert len(report.outcomes) == 12  # 6 pairs x 2 rails, rail i against rail i
    assert {(o.a.nic, o.b.nic) for o in report.outcomes} == {("nic0", "nic0"),
                                                            ("nic1", "nic1")}
    assert {o.b_address.rpartition("-")[2] for o in report.outcomes} == {"r0", "r1"}
    (culprit,) = report.diagnosis.culprits
    assert culprit.subject.label() == "h2/nic1"
    from kvctl.cluster.report import matrices

    assert [m.label for m in matrices(report)] == ["rail 0", "rail 1"]


def test_cross_rail_adds_every_other_rail(service: Counting) -> None:
    started = agents(service, ["h0", "h1"], rails=2)
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP, cross_rail=True))
    finally:
        for a in started:
            a.close()
    assert sorted((o.a.nic, o.b.nic) for o in report.outcomes) == [
        ("nic0", "nic0"), ("nic0", "nic1"), ("nic1", "nic0"), ("nic1", "nic1")]
    from kvctl.cluster.report import matrices

    assert [m.label for m in matrices(report)] == ["rail 0", "rail 1", "rail 0 x rail 1",
                                                   "rail 1 x rail 0"]


def test_a_stopped_run_ends_with_what_was_measured(service: Counting) -> None:
    started = agents(service, [f"h{i}" for i in range(5)])
    stop = threading.Event()

    def on_event(event: Any) -> None:
        if event.done >= 2:
            stop.set()  # as Ctrl-C does

    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP), on_event=on_event,
                                       stop=stop)
    finally:
        for a in started:
            a.close()
    assert report.interrupted
    assert not report.ok
    states = [o.state for o in report.outcomes]
    assert len(states) == 10
    assert states.count("ok") >= 2
    assert "interrupted" in states


def test_agent_metrics_count_jobs_by_kind_and_outcome(service: Counting) -> None:
    from kvctl.metrics import ServerMetrics

    metrics = ServerMetrics("kvctl_agent")
    handlers = {TARGET: fake_target, BENCH: fake_bench({})}
    started = [Agent(service, record(n), handlers=handlers, metrics=metrics if n == "h0"
                     else None).start() for n in ("h0", "h1")]
    try:
        with Coordinator(service, ClusterKeys(), token=None, poll_s=0.02) as coord:
            run_cluster_bench(coord, read_hosts(service, ClusterKeys(), None),
                              ClusterBenchOptions(sweep=SWEEP))
        text = metrics.render()
    finally:
        for a in started:
            a.close()
    assert 'kvctl_agent_registered 1.0' in text
    assert 'op="job_' in text
    assert "kvctl_agent_jobs_running" in text
