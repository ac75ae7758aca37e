"""One benchmark run end to end: engines in turn, skips explained, ratios and verdict.

Engines run one after another (never at the same time, so they do not share the cores); each
gets the same sweep and its own target. An engine that is not installed, or a transport it
cannot use here, is skipped with the reason and an install hint; a run where nothing at all
could run is an :class:`~kvctl.errors.UnavailableError`.

Foreign engines (Mooncake, NIXL: ``EngineDriver.isolated``) run in a child process of their
own (:mod:`kvctl.bench.isolated`) whose rows come back here, so their libraries'
crashes at exit never become kvctl's; a ``tamper`` hook (tests) keeps them in process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvctl.bench.engines.base import driver_class, open_driver
from kvctl.bench.isolated import IsolatedJob, run_isolated
from kvctl.bench.linerate import LineRate, LineRates, nic_line_rate
from kvctl.bench.report import BenchReport
from kvctl.bench.result import ResultRow, shortfalls, with_ratios
from kvctl.bench.runner import ProgressEvent, Skipped, SweepRunner, Tamper, new_run_id, plan_for
from kvctl.bench.spec import Sweep
from kvctl.errors import UnavailableError, UsageError

if TYPE_CHECKING:
    from kvctl.topo.model import Topology

_log = logging.getLogger("kvctl.bench")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run a sweep.

    Attributes:
        engines: engine names in order; the first is the ratio baseline.
        peer: two-host target (segment name with ``metadata``, else ``HOST:PORT``); ``None``
            starts an embedded target on loopback.
        metadata: metadata URL of a two-host run.
        timeout_s: seconds one batch may take.
        expect_line_rate / expect_gbytes_per_s: thresholds that make the run a check.
        nic_rates: line rate of cross-host paths by medium (``tcp``, ``rdma``), from topology.
        token: shared secret both ends (and the metadata service) authenticate with.
        local_addresses: local IPs kvctl's TCP connections leave from (a rail's address);
            empty: the kernel's route.
    """

    engines: tuple[str, ...] = ("kvctl",)
    peer: str | None = None
    metadata: str | None = None
    timeout_s: float = 30.0
    expect_line_rate: float | None = None
    expect_gbytes_per_s: float | None = None
    nic_rates: Mapping[str, LineRate] = dataclasses.field(default_factory=dict)
    token: str | None = dataclasses.field(default=None, repr=False)
    local_addresses: tuple[str, ...] = ()


def validate_engines(names: Sequence[str]) -> tuple[str, ...]:
    """Engine names, lower-cased, de-duplicated, each known (comma lists are split).

    Raises:
        UsageError: an unknown engine (the hint lists the known ones) or none at all.
    """
    out: list[str] = []
    for raw in names:
        for part in raw.split(","):
            name = part.strip().lower()
            if name:
                driver_class(name)  # raises UsageError for unknown names
                out.append(name)
    if not out:
        raise UsageError("no engine given", "use --engine kvctl (repeatable)")
    return tuple(dict.fromkeys(out))


def nic_rates_for(location: str, topology: Topology | None) -> dict[str, LineRate]:
    """Cross-host line rates for a local buffer at ``location``: the best NIC per medium.

    ``topology`` ``None`` (not readable here) gives no rates; rows then show no line rate.
    """
    if topology is None:
        return {}
    rates: dict[str, LineRate] = {}
    for medium, rdma_only in (("rdma", True), ("tcp", False)):
        rate = nic_line_rate(topology, location, rdma_only=rdma_only)
        if rate is not None:
            rates[medium] = rate
    return rates


def _run_isolated(name: str, sweep: Sweep, options: RunOptions,
                  run_id: int, rows: list[ResultRow], skipped: list[Skipped], *,
                  on_progress: Callable[[ProgressEvent], None] | None,
                  on_row: Callable[[ResultRow], None] | None) -> None:
    """Run engine ``name`` in a child process, adding its rows and skips to ours."""
    cls = driver_class(name)
    reason = cls.unavailable_reason()  # imports the engine's module, creates nothing
    if reason is not None:
        _log.warning("skipping engine %s: %s", name, reason)
        skipped.append(Skipped(name, None, f"engine {cls.name} unavailable: {reason}",
                               cls.install_hint))
        return
    plan = plan_for(sweep, timeout_s=options.timeout_s, peer=options.peer,
                    metadata=options.metadata, token=options.token)
    job = IsolatedJob(engine=name, sweep=sweep, plan=plan, nic_rates=dict(options.nic_rates),
                      run_id=run_id)
    for event in run_isolated(job):
        if isinstance(event, ProgressEvent):
            if on_progress is not None:
                on_progress(event)
        elif isinstance(event, ResultRow):
            rows.append(event)
            if on_row is not None:
                on_row(event)
        else:
            if event.transport is None:
                _log.warning("skipping engine %s: %s", name, event.reason)
            skipped.append(event)


def run_transfer_bench(
    sweep: Sweep,
    options: RunOptions,
    *,
    on_progress: Callable[[ProgressEvent], None] | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
    tamper: Tamper | None = None,
    run_id: int | None = None,
) -> BenchReport:
    """Run ``sweep`` through every engine of ``options`` and judge the result.

    Raises:
        UnavailableError: no engine (or no transport of any engine) could run here.
        IntegrityError: ``--verify`` found a corrupted or misplaced block.
        KvctlError: an engine failed outright.
    """
    run_id = new_run_id() if run_id is None else run_id
    line_rates = LineRates()
    rows: list[ResultRow] = []
    skipped: list[Skipped] = []
    first_unavailable: UnavailableError | None = None
    for name in options.engines:
        if driver_class(name).isolated and tamper is None:
            _run_isolated(name, sweep, options, run_id, rows, skipped,
                          on_progress=on_progress, on_row=on_row)
            continue
        try:
            driver = open_driver(name)
        except UnavailableError as exc:
            _log.warning("skipping engine %s: %s", name, exc.cause)
            skipped.append(Skipped(name, None, exc.cause, exc.hint))
            first_unavailable = first_unavailable or exc
            continue
        plan = plan_for(sweep, timeout_s=options.timeout_s, peer=options.peer,
                        metadata=options.metadata, token=options.token,
                        local_addresses=options.local_addresses)
        with driver:
            try:
                driver.start(plan)
            except UnavailableError as exc:
                _log.warning("skipping engine %s: %s", name, exc.cause)
                skipped.append(Skipped(name, None, exc.cause, exc.hint))
                first_unavailable = first_unavailable or exc
                continue
            runner = SweepRunner(driver, sweep, line_rates=line_rates,
                                 nic_rates=options.nic_rates, run_id=run_id,
                                 on_progress=on_progress, tamper=tamper)
            for row in runner.rows():
                rows.append(row)
                if on_row is not None:
                    on_row(row)
            skipped.extend(runner.skipped)
    if not rows:
        reasons = "; ".join(f"{s.engine}{'/' + s.transport if s.transport else ''}: {s.reason}"
                            for s in skipped)
        hint = next((s.hint for s in skipped if s.hint), None)
        raise UnavailableError(f"nothing could run: {reasons}",
                               hint or (first_unavailable.hint if first_unavailable else None))
    final = with_ratios(rows, options.engines[0])
    missed = shortfalls(final, expect_line_rate=options.expect_line_rate,
                        expect_gbytes_per_s=options.expect_gbytes_per_s)
    return BenchReport(
        run_id=run_id, engines=options.engines, sweep=sweep, rows=tuple(final),
        skipped=tuple(skipped), shortfalls=tuple(missed),
        expect_line_rate=options.expect_line_rate,
        expect_gbytes_per_s=options.expect_gbytes_per_s,
        peer=options.peer)
