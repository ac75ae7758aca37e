"""``kvctl cluster bench``: every planned pair benchmarked through the agents, one report.

Per round of the plan (:mod:`kvctl.cluster.scheduler`), for every pair ``(a, b)`` (and every
rail, rail by rail):

1. ``b``'s agent serves a target sized for the sweep, at its address (a rail's address when
   rail by rail), and publishes where;
2. ``a``'s agent runs the sweep against it (READ and WRITE, KV-page-sized with a model,
   verified by default) and publishes the rows;
3. both jobs are deleted: the target is freed.

A host whose agent vanishes (its lease expired) is *missing*: its pending pairs end at once,
its later pairs are not tried, and the report says when it was seen gone. A pair whose bench
failed is confirmed before it is blamed: its jobs are deleted and each host's agent must
answer by withdrawing its statuses; a host that turns out gone instead (within its lease TTL)
makes the pair missing, not failed. Failed pairs enter the diagnosis without a value, so a
host or NIC that no pair reached is named (``unreachable``). ``stop`` (Ctrl-C) ends the run
after the current poll with what was measured. The pair's value for the matrix and the
diagnosis is the slower of its directions (min over its rows, GB/s).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvctl.bench.runner import REQUEST_SHARE
from kvctl.bench.spec import Sweep
from kvctl.cluster.coordinator import WAIT_FINAL, WAIT_READY, Coordinator, JobRef
from kvctl.cluster.diagnosis import DEFAULT_SLOW_FRACTION, Diagnosis, Endpoint, PairValue, diagnose
from kvctl.cluster.protocol import (
    BENCH,
    DONE,
    READY,
    TARGET,
    BenchParams,
    BenchResult,
    HostRecord,
    Rail,
    RowSummary,
    SweepParams,
    TargetParams,
    TargetReady,
    now,
)
from kvctl.cluster.registry import HostEntry
from kvctl.cluster.scheduler import Schedule, plan_schedule
from kvctl.errors import KvctlError, UsageError

_log = logging.getLogger("kvctl.cluster")

#: Seconds a target may take to come up before its pair fails.
TARGET_START_S = 30.0

# Pair outcomes.
OK = "ok"
FAILED = "failed"
MISSING = "missing"
INTERRUPTED = "interrupted"
NOT_RUN = "not-run"


@dataclasses.dataclass(frozen=True)
class ClusterBenchOptions:
    """How to bench the cluster.

    Attributes:
        sweep: what each pair runs (``kvctl bench transfer``'s sweep).
        engines: transfer engines, the first is the baseline.
        schedule / pairs / seed: the plan (:func:`~kvctl.cluster.scheduler.plan_schedule`).
        per_rail: bench NIC rail i against rail i where both hosts have several rails.
        cross_rail: also rail i against every rail j != i (implies ``per_rail``).
        timeout_s: longest one batch may take.
        slow_fraction: pairs below this fraction of the median are slow.
        hosts: bench only these hosts (empty: every usable one).
    """

    sweep: Sweep
    engines: tuple[str, ...] = ("kvctl",)
    schedule: str = "auto"
    pairs: int | None = None
    seed: int = 0
    per_rail: bool = False
    cross_rail: bool = False
    timeout_s: float = 10.0
    slow_fraction: float = DEFAULT_SLOW_FRACTION
    hosts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PairOutcome:
    """One pair (on one rail) of the run.

    Attributes:
        a / b: initiator and target (with their NIC when rail by rail).
        a_address / b_address: addresses used (``b_address``: where the target served).
        state: ``ok``, ``failed``, ``missing`` (a host vanished), ``interrupted`` or
            ``not-run`` (a host was already missing).
        rows: the bench's rows (both ops).
        error: why it is not ``ok``.
        round_index: the plan's round (0-based).
        duration_s: wall time from the target's job to the last status.
    """

    a: Endpoint
    b: Endpoint
    a_address: str
    b_address: str
    state: str
    rows: tuple[RowSummary, ...] = ()
    error: str | None = None
    round_index: int = 0
    duration_s: float = 0.0

    @property
    def gbps(self) -> float | None:
        """The slower direction's throughput, GB/s; ``None`` unless ``ok``."""
        if self.state != OK or not self.rows:
            return None
        return min(r.gbps for r in self.rows)

    def op_gbps(self, op: str) -> float | None:
        """The throughput of ``op`` (``read``/``write``), the slowest row of that op."""
        values = [r.gbps for r in self.rows if r.op == op]
        return min(values) if values and self.state == OK else None

    @property
    def verified(self) -> bool:
        """Every row was verified end to end."""
        return bool(self.rows) and all(r.verified for r in self.rows)


@dataclasses.dataclass(frozen=True)
class MissingHost:
    """A host whose agent vanished during the run.

    Attributes:
        host: its name.
        detected_at: Unix time the client saw its lease gone.
        round_index: the round it was noticed in.
    """

    host: str
    detected_at: float
    round_index: int


@dataclasses.dataclass(frozen=True)
class BenchEvent:
    """Progress: ``done`` of ``total`` pairs finished, in round ``round_index`` of
    ``rounds``; ``message`` says what just happened."""

    round_index: int
    rounds: int
    done: int
    total: int
    message: str


@dataclasses.dataclass(frozen=True)
class ClusterBenchReport:
    """Everything one cluster bench found.

    Attributes:
        run_id: the run's id (its jobs' prefix).
        hosts: hosts benched, in order.
        untrusted: hosts registered but not given work, with why.
        schedule: the plan.
        sweep / engines / per_rail: what each pair ran.
        outcomes: one per pair (and rail).
        missing: hosts that vanished.
        diagnosis: slow pairs and culprits over the ``ok`` pairs.
        records: the benched hosts' records (for the culprits' topo findings).
        interrupted: stopped before the end.
        started_at / duration_s: Unix start time and wall time, seconds.
    """

    run_id: str
    hosts: tuple[str, ...]
    untrusted: tuple[tuple[str, str], ...]
    schedule: Schedule
    sweep: Sweep
    engines: tuple[str, ...]
    per_rail: bool
    outcomes: tuple[PairOutcome, ...]
    missing: tuple[MissingHost, ...]
    diagnosis: Diagnosis
    records: dict[str, HostRecord]
    interrupted: bool
    started_at: float
    duration_s: float

    @property
    def failed(self) -> tuple[PairOutcome, ...]:
        """Pairs whose bench failed (errors, bad bytes, a target that did not come up)."""
        return tuple(o for o in self.outcomes if o.state == FAILED)

    @property
    def ok(self) -> bool:
        """Every pair measured and intact, nobody missing, no slow pair."""
        return (not self.interrupted and not self.missing and not self.diagnosis.slow
                and all(o.state == OK for o in self.outcomes))


def sweep_params(sweep: Sweep) -> SweepParams:
    """The sweep as a bench job carries it."""
    sizing = sweep.sizing
    return SweepParams(
        ops=[o.value for o in sweep.ops], transports=list(sweep.transports),
        block_sizes_bytes=list(sweep.block_sizes_bytes), batch_sizes=list(sweep.batch_sizes),
        duration_s=sweep.duration_s, iterations=sweep.iterations, warmup=sweep.warmup_batches,
        verify=sweep.verify, threads=sweep.threads, local_location=str(sweep.local),
        remote_location=str(sweep.remote),
        model=sizing.model if sizing else None,
        tokens_per_block=sizing.tokens_per_block if sizing else None,
        kv_bytes_per_token=sizing.kv_bytes_per_token if sizing else None)


def estimate_pair_s(sweep: Sweep) -> float:
    """Seconds one pair's bench takes with ``sweep`` (duration mode; iterations count as
    a tenth of a second per batch): timed phase, latency samples, verification, setup."""
    per_config = (sweep.duration_s if sweep.duration_s is not None
                  else 0.1 * (sweep.iterations or 1)) * (1 + REQUEST_SHARE) + 0.2
    return len(sweep.configs()) * per_config + 0.5


def _rails_for(a: HostRecord, b: HostRecord, options: ClusterBenchOptions
               ) -> list[tuple[Rail | None, Rail | None]]:
    if not (options.per_rail or options.cross_rail) or not a.rails or not b.rails:
        return [(None, None)]
    same: list[tuple[Rail | None, Rail | None]] = [
        (ra, rb) for ra in a.rails for rb in b.rails if ra.index == rb.index]
    if options.cross_rail:
        return same + [(ra, rb) for ra in a.rails for rb in b.rails if ra.index != rb.index]
    return same


@dataclasses.dataclass
class _Task:
    a: str
    b: str
    rail_a: Rail | None
    rail_b: Rail | None
    started: float
    target: JobRef | None = None
    bench: JobRef | None = None

    def endpoints(self) -> tuple[Endpoint, Endpoint]:
        return (Endpoint(self.a, self.rail_a.nic if self.rail_a else None),
                Endpoint(self.b, self.rail_b.nic if self.rail_b else None))


class _Run:
    def __init__(self, coordinator: Coordinator, records: dict[str, HostRecord],
                 options: ClusterBenchOptions, schedule: Schedule,
                 on_event: Callable[[BenchEvent], None] | None,
                 stop: threading.Event | None) -> None:
        self.c = coordinator
        self.records = records
        self.options = options
        self.schedule = schedule
        self.on_event = on_event
        self.stop = stop
        self.outcomes: list[PairOutcome] = []
        self.missing: dict[str, MissingHost] = {}
        self.total = sum(len(_rails_for(records[a], records[b], options))
                         for a, b in schedule.pairs)
        self.params = sweep_params(options.sweep)
        self.pair_timeout_s = (3 * estimate_pair_s(options.sweep)
                               + 3 * options.timeout_s * len(options.sweep.configs()) + 30)
        self.interrupted = False
        self.cancelled: set[str] = set()  # job ids deleted already

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def event(self, index: int, message: str) -> None:
        if self.on_event is not None:
            self.on_event(BenchEvent(index, len(self.schedule.rounds), len(self.outcomes),
                                     self.total, message))

    def note_missing(self, host: str, index: int, at: float | None = None) -> None:
        if host not in self.missing:
            self.missing[host] = MissingHost(host, at or now(), index)
            _log.warning("host %s vanished in round %d of %d (round_index %d in --json)",
                         host, index + 1, len(self.schedule.rounds), index)
            self.event(index, f"{host} vanished: its pairs are skipped")

    def run(self) -> None:
        for index, pairs in enumerate(self.schedule.rounds):
            tasks: list[_Task] = []
            for a, b in pairs:
                for ra, rb in _rails_for(self.records[a], self.records[b], self.options):
                    task = _Task(a, b, ra, rb, time.monotonic())
                    gone = [h for h in (a, b) if h in self.missing]
                    if self.interrupted or self.stopped():
                        self.interrupted = True
                        self.finish(task, index, INTERRUPTED, error="the run was interrupted")
                    elif gone:
                        self.finish(task, index, NOT_RUN, error=f"{gone[0]} is missing")
                    else:
                        tasks.append(task)
            if tasks:
                self.event(index, "round " + ", ".join(
                    f"{t.a}->{t.b}" + (f" (rail {t.rail_a.index})" if t.rail_a else "")
                    for t in tasks))
                self.run_round(index, tasks)

    def run_round(self, index: int, tasks: list[_Task]) -> None:
        o = self.options
        hold = self.pair_timeout_s + TARGET_START_S
        try:
            for t in tasks:
                t.target = self.c.submit(t.b, TARGET, TargetParams(
                    region_bytes=o.sweep.region_bytes, engines=list(o.engines),
                    transports=list(o.sweep.transports),
                    address=t.rail_b.address if t.rail_b else None,
                    location=str(o.sweep.remote)), hold_s=hold)
            targets = [t.target for t in tasks if t.target is not None]
            if not self.c.wait(targets, want=WAIT_READY, timeout_s=TARGET_START_S,
                               stop=self.stop):
                self.interrupted = True
            for t in tasks:
                ref = t.target
                if self.interrupted or ref is None or ref.state != READY:
                    continue
                try:
                    ready = ref.status.result_as(TargetReady) if ref.status else None
                except UsageError as exc:
                    ref.untrusted = exc.cause
                    continue
                if ready is None:
                    continue
                t.bench = self.c.submit(t.a, BENCH, BenchParams(
                    peer=ready.peer, sweep=self.params, engines=list(o.engines),
                    timeout_s=o.timeout_s,
                    local_address=t.rail_a.address if t.rail_a else None),
                    hold_s=self.pair_timeout_s)
            benches = [t.bench for t in tasks if t.bench is not None]
            if benches and not self.c.wait(benches, want=WAIT_FINAL,
                                           timeout_s=self.pair_timeout_s, stop=self.stop):
                self.interrupted = True
            self.confirm(tasks)
            for t in tasks:
                self.conclude(index, t)
        finally:
            self._cancel([r for t in tasks for r in (t.target, t.bench) if r is not None])

    def confirm(self, tasks: list[_Task]) -> None:
        """A failed pair may be a host dying: tell which before blaming the pair.

        The suspect pairs' jobs are deleted at once; a live agent answers by withdrawing the
        job's status within a poll (a dead one cannot: its statuses stay until its lease
        expires, and its liveness key goes with them). So the wait ends as soon as every
        host of a suspect pair has answered or vanished (each on its own: one lease ending is
        not the others' answer), at most its lease TTL (and always that long for a host with
        no status to withdraw).
        """
        suspects = [t for t in tasks if not self.interrupted and self._failed(t)
                    and all(r.missing_at is None for r in self._refs(t))]
        if not suspects:
            return
        hosts = {h for t in suspects for h in (t.a, t.b)}
        asked: dict[str, set[str]] = {h: set() for h in hosts}  # host -> status keys
        for t in suspects:
            for ref in self._refs(t):
                if ref.status is not None:
                    asked[ref.host].add(ref.status_key)
        self._cancel([r for t in suspects for r in self._refs(t)])
        ttl = max([1.0, *(self.records[h].lease_ttl_s for h in hosts)])
        deadline = time.monotonic() + ttl + 1.0
        answered: set[str] = set()
        gone: set[str] = set()
        while time.monotonic() < deadline and not self.stopped():
            answered |= self._answered({h: k for h, k in asked.items()
                                        if k and h not in answered})
            if self.c.refresh():
                gone |= {h for h in hosts - answered if not self.c.alive(h)}
            # every host must have answered or be gone: one lease ending first is not the
            # others' answer (two hosts dying in one round expire one after the other)
            if answered | gone >= hosts:
                break
            time.sleep(self.c.poll_s)
        for t in suspects:
            for ref in self._refs(t):
                if ref.host not in answered and not self.c.alive(ref.host):
                    ref.missing_at = now()

    def _answered(self, asked: dict[str, set[str]]) -> set[str]:
        """Hosts whose agents withdrew every status in ``asked`` and are still registered.

        The statuses are read before the liveness keys: an agent's lease takes both at
        once, so a host whose statuses went with its lease is not registered either."""
        if not asked:
            return set()
        client, keys = self.c.client, self.c.keys
        try:
            present = set(client.list(keys.status_prefix(self.c.run_id)))
            withdrawn = [h for h, k in asked.items() if not k & present]
            return {h for h in withdrawn if client.get(keys.alive(h)) is not None}
        except KvctlError as exc:  # the metadata service did not answer
            _log.warning("reading the run's statuses failed: %s", exc.cause)
            return set()

    def _cancel(self, refs: list[JobRef]) -> None:
        fresh = [r for r in refs if r.job_id not in self.cancelled]
        self.cancelled.update(r.job_id for r in fresh)
        self.c.cancel(fresh)

    @staticmethod
    def _refs(t: _Task) -> list[JobRef]:
        return [r for r in (t.target, t.bench) if r is not None]

    @staticmethod
    def _failed(t: _Task) -> bool:
        refs = [r for r in (t.target, t.bench) if r is not None]
        if t.bench is None:
            return True
        return any(r.error() is not None for r in refs) or t.bench.state != DONE

    def conclude(self, index: int, t: _Task) -> None:
        for ref in self._refs(t):
            if ref.missing_at is not None:
                self.note_missing(ref.host, index, ref.missing_at)
        gone = [h for h in (t.a, t.b) if h in self.missing]
        if gone:
            self.finish(t, index, MISSING, error=f"{gone[0]} vanished during the pair")
            return
        target, bench = t.target, t.bench
        if target is None or target.state != READY:
            if self.interrupted:
                self.finish(t, index, INTERRUPTED, error="the run was interrupted")
                return
            why = target.error() if target is not None else None
            self.finish(t, index, FAILED, error=f"target on {t.b} did not start: "
                        f"{why or 'no status'}")
            return
        if bench is None or bench.state != DONE:
            if self.interrupted and (bench is None or bench.state is None):
                self.finish(t, index, INTERRUPTED, error="the run was interrupted")
                return
            why = bench.error() if bench is not None else None
            self.finish(t, index, FAILED, error=f"bench on {t.a}: {why or 'no result'}")
            return
        try:
            result = bench.status.result_as(BenchResult) if bench.status else None
        except UsageError as exc:
            self.finish(t, index, FAILED, error=exc.cause)
            return
        if result is None:  # pragma: no cover - DONE always carries a status
            return
        rows = tuple(result.rows)
        bad = [r for r in rows if r.errors]
        unverified = [r for r in rows if self.options.sweep.verify and not r.verified]
        if not rows:
            self.finish(t, index, FAILED, error="no row: " + "; ".join(result.skipped))
        elif bad or unverified:
            what = (f"{sum(r.errors for r in bad)} request(s) failed" if bad
                    else "rows not verified")
            self.finish(t, index, FAILED, rows=rows, error=what)
        else:
            self.finish(t, index, OK, rows=rows)

    def finish(self, t: _Task, index: int, state: str, *, rows: tuple[RowSummary, ...] = (),
               error: str | None = None) -> None:
        a, b = t.endpoints()
        a_addr = t.rail_a.address if t.rail_a else self.records[t.a].address
        b_addr = t.rail_b.address if t.rail_b else self.records[t.b].address
        outcome = PairOutcome(a, b, a_addr, b_addr, state, rows, error, index,
                              time.monotonic() - t.started)
        self.outcomes.append(outcome)
        if state in (OK, FAILED):
            value = f"{outcome.gbps:.3g} GB/s" if outcome.gbps is not None else error
            self.event(index, f"{a.label()} -> {b.label()}: {value}")


def run_cluster_bench(coordinator: Coordinator, entries: Sequence[HostEntry],
                      options: ClusterBenchOptions, *,
                      on_event: Callable[[BenchEvent], None] | None = None,
                      stop: threading.Event | None = None) -> ClusterBenchReport:
    """Bench every planned pair of the usable hosts in ``entries`` (see the module docstring).

    Raises:
        UsageError: fewer than two usable hosts, or a host asked for that is not registered.
        AuthError: the agents refuse this client's jobs (token missing or wrong).
    """
    started_at, t0 = now(), time.monotonic()
    usable = {e.name: e.record for e in entries if e.usable and e.record is not None}
    untrusted = tuple((e.name, e.problem or "unusable") for e in entries if not e.usable)
    if options.hosts:
        unknown = [h for h in options.hosts if h not in usable]
        if unknown:
            raise UsageError(f"host(s) {', '.join(unknown)} are not registered (or untrusted)",
                             "to list the registered hosts, run 'kvctl cluster ls'")
        usable = {h: usable[h] for h in options.hosts}
    if len(usable) < 2:
        raise UsageError(f"{len(usable)} usable host(s) registered: a bench needs two",
                         "start kvctl agent on every host (same metadata URL and token), "
                         "then kvctl cluster ls")
    names = sorted(usable)
    schedule = plan_schedule(names, mode=options.schedule, pairs=options.pairs,
                             seed=options.seed)
    run = _Run(coordinator, usable, options, schedule, on_event, stop)
    run.run()
    # failed pairs go in without a value: a NIC that no pair reached is named unreachable
    values = [PairValue(o.a, o.b, o.gbps) for o in run.outcomes if o.state in (OK, FAILED)]
    diagnosis = diagnose(values, slow_fraction=options.slow_fraction)
    return ClusterBenchReport(
        run_id=coordinator.run_id, hosts=tuple(names), untrusted=untrusted, schedule=schedule,
        sweep=options.sweep, engines=options.engines,
        per_rail=options.per_rail or options.cross_rail, outcomes=tuple(run.outcomes),
        missing=tuple(run.missing.values()), diagnosis=diagnosis, records=usable,
        interrupted=run.interrupted, started_at=started_at,
        duration_s=time.monotonic() - t0)
