"""The built-in step kinds. Each calls one library function and judges its result.

Library modules are imported inside each step so a runbook loads only what it uses.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvctl.errors import ConfigError
from kvctl.runbook.model import CheckResult, RunContext, Verdict, register_step


@dataclasses.dataclass(frozen=True)
class DoctorEnvParams:
    """``doctor-env``: optional parts present; ``require`` lists those that must be usable."""

    require: list[str] = dataclasses.field(default_factory=list)
    metadata: list[str] = dataclasses.field(default_factory=list)


@register_step("doctor-env", DoctorEnvParams, "optional parts present and usable")
def doctor_env(params: DoctorEnvParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.doctor.env import Status, default_checks, run_checks

    results = run_checks(default_checks(params.metadata))
    rows: list[CheckResult] = []
    for r in results:
        required = r.name in params.require
        if r.status is Status.OK:
            verdict = Verdict.PASS
        elif required:
            verdict = Verdict.FAIL
        else:
            verdict = Verdict.SKIP
        rows.append(CheckResult(r.name, verdict, f"{r.status.value}: {r.detail}",
                                "required" if required else "optional", r.hint,
                                {"status": r.status.value}))
    return rows


@dataclasses.dataclass(frozen=True)
class TopoDoctorParams:
    """``topo-doctor``: host wiring; fails on findings at ``fail_on`` severity or worse."""

    sysfs_root: Path = Path("/")
    snapshot: Path | None = None
    fail_on: str = "error"


@register_step("topo-doctor", TopoDoctorParams, "GPU-NIC wiring and link health")
def topo_doctor(params: TopoDoctorParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.topo.doctor import Severity, run_doctor
    from kvctl.topo.sources import TopoSettings, load_topology

    order = [s.value for s in Severity]
    if params.fail_on not in order:
        raise ConfigError(f"topo-doctor: fail_on {params.fail_on!r} is not a severity",
                          f"use one of {', '.join(order)}")
    topology = load_topology(TopoSettings(sysfs_root=params.sysfs_root), params.snapshot)
    findings = run_doctor(topology)
    ctx.attach("topology", topology)
    ctx.attach("topo-findings", findings)
    threshold = _severity_rank(params.fail_on)
    failing = [f for f in findings if _severity_rank(f.severity.value) >= threshold]
    counts = {s.value: sum(1 for f in findings if f.severity is s) for s in Severity}
    measured = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no findings"
    first = failing[0] if failing else None
    return [CheckResult(
        "findings", Verdict.FAIL if failing else Verdict.PASS, measured,
        f"no {params.fail_on} findings",
        f"{first.subject}: {first.message} ({first.hint})" if first else None,
        {"findings": [dataclasses.asdict(f) for f in findings],
         "gpus": len(topology.gpus), "nics": len(topology.nics)},
    )]


def _severity_rank(name: str) -> int:
    ranks = {"info": 0, "warning": 1, "error": 2}
    return ranks.get(name, 0)


@dataclasses.dataclass(frozen=True)
class SimPoolParams:
    """``sim-pool``: what a shared pool saves on the reference chat workload.

    ``max_recompute`` (a fraction) fails the check when the best configuration with a pool
    recomputes more than that.
    """

    sessions: int = 300
    instances: int = 4
    local_blocks: list[int] = dataclasses.field(default_factory=lambda: [8000, 2000])
    pool_blocks: int = 400_000
    seed: int = 0
    max_recompute: float | None = None


@register_step("sim-pool", SimPoolParams, "shared-pool savings on a chat workload")
def sim_pool(params: SimPoolParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.sim.run import simulate_pool
    from kvctl.sim.settings import SimSettings

    report = simulate_pool(SimSettings(
        sessions=params.sessions, instances=params.instances,
        local_blocks=tuple(params.local_blocks), pool_blocks=params.pool_blocks,
        seed=params.seed,
    ))
    rows: list[CheckResult] = []
    for capacity in params.local_blocks:
        cells = {c.label: c for c in report.cells if c.local_blocks == capacity}
        without = min(c.recompute_fraction for c in cells.values() if not c.pool_blocks)
        with_pool = min(c.recompute_fraction for c in cells.values() if c.pool_blocks)
        failed = params.max_recompute is not None and with_pool > params.max_recompute
        rows.append(CheckResult(
            f"local {capacity} blocks",
            Verdict.FAIL if failed else Verdict.PASS,
            f"recompute {100 * with_pool:.1f}% with pool vs {100 * without:.1f}% without "
            f"(floor {100 * report.floor.fraction:.1f}%)",
            f"<= {100 * params.max_recompute:.0f}%" if params.max_recompute is not None else "",
            None if not failed else "grow the pool or route cache-aware; see kvctl sim pool",
            {c.label: c.recompute_fraction for c in cells.values()},
        ))
    return rows


@dataclasses.dataclass(frozen=True)
class VerifyKeysParams:
    """``verify-keys``: self-check of a key profile; with ``manifests``, compare instances."""

    profile: str = "kvctl:sha256"
    block_size: int | None = None
    manifests: list[Path] = dataclasses.field(default_factory=list)


@register_step("verify-keys", VerifyKeysParams, "block keys consistent and well-formed")
def verify_keys(params: VerifyKeysParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.keys.compare import compare
    from kvctl.keys.manifest import config_from_settings, read_manifest
    from kvctl.keys.selfcheck import self_check
    from kvctl.keys.settings import KeysSettings

    rows: list[CheckResult] = []
    if params.manifests:
        if len(params.manifests) < 2:
            raise ConfigError("verify-keys: comparing needs two or more manifests",
                              "list one manifest per instance under 'manifests'")
        comparison = compare([read_manifest(p) for p in params.manifests])
        bad = [r for r in comparison.results if r.status != "match"]
        first = bad[0] if bad else None
        hint = None
        if first is not None:
            why = "; ".join(c.detail for c in first.causes) or first.status
            hint = (f"prompt {first.prompt}: {first.a} vs {first.b} diverge at block "
                    f"{first.first_diverging_block}: {why}")
        rows.append(CheckResult(
            "instances agree", Verdict.FAIL if bad else Verdict.PASS,
            f"{len(comparison.results) - len(bad)}/{len(comparison.results)} prompt pairs match",
            "all match", hint,
        ))
        return rows
    config = config_from_settings(KeysSettings(profile=params.profile,
                                               block_size=params.block_size))
    checks = self_check(config)
    failed = [c for c in checks if not c.passed]
    rows.append(CheckResult(
        f"self-check {config.profile}", Verdict.FAIL if failed else Verdict.PASS,
        f"{len(checks) - len(failed)}/{len(checks)} invariants hold", "all hold",
        "; ".join(f"{c.name}: {c.detail}" for c in failed) or None,
        {"checks": [dataclasses.asdict(c) for c in checks]},
    ))
    return rows


@dataclasses.dataclass(frozen=True)
class BenchTransferParams:
    """``bench-transfer``: a short verified sweep; thresholds as in ``kvctl bench transfer``.

    Without ``peer`` an embedded target starts on loopback.
    """

    transport: str = "shm,tcp"
    op: str = "both"
    block_size: str = "64KiB,1MiB"
    batch_size: str = "32"
    iterations: int = 20
    warmup: int = 2
    verify: bool = True
    engine: list[str] = dataclasses.field(default_factory=lambda: ["kvctl"])
    peer: str | None = None
    metadata: str | None = None
    expect_gbytes_per_s: float | None = dataclasses.field(
        default=None, metadata={"old_name": "expect_gbps"})
    expect_line_rate: float | None = None
    timeout: float = dataclasses.field(default=30.0, metadata={"unit": "duration"})


@register_step("bench-transfer", BenchTransferParams, "fabric throughput with verified bytes")
def bench_transfer(params: BenchTransferParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.bench.result import shortfalls
    from kvctl.bench.session import RunOptions, run_transfer_bench, validate_engines
    from kvctl.bench.spec import BenchSettings, build_sweep
    from kvctl.config import CommonSettings

    settings = BenchSettings(
        transport=params.transport, op=params.op, block_size=params.block_size,
        batch_size=params.batch_size, iterations=params.iterations, warmup=params.warmup,
        verify=params.verify, engine=tuple(params.engine), peer=params.peer,
        metadata=params.metadata, timeout=params.timeout,
    )
    options = RunOptions(engines=validate_engines(settings.engine), peer=params.peer,
                         metadata=params.metadata, timeout_s=params.timeout,
                         expect_line_rate=params.expect_line_rate,
                         expect_gbytes_per_s=params.expect_gbytes_per_s,
                         token=ctx.settings(CommonSettings).token)
    report = run_transfer_bench(build_sweep(settings), options,
                                on_row=lambda row: ctx.progress(f"bench {row.label()}"))
    ctx.attach("bench-rows", report.rows)
    threshold = " and ".join(
        t for t in (f">= {params.expect_gbytes_per_s:g} GB/s" if params.expect_gbytes_per_s
                    else "",
                    f">= {params.expect_line_rate:.0%} of line rate"
                    if params.expect_line_rate else "") if t) or "no errors"
    rows: list[CheckResult] = []
    for row in report.rows:
        missed = shortfalls([row], expect_line_rate=params.expect_line_rate,
                            expect_gbytes_per_s=params.expect_gbytes_per_s)
        measured = f"{row.throughput_gbytes_per_s:.3f} GB/s"
        if row.line_rate_valid is False:
            measured += " (above its line rate: baseline invalid)"
        elif row.line_rate_fraction is not None:
            measured += f" ({row.line_rate_fraction:.0%} of line rate)"
        if row.verified:
            measured += ", verified"
        rows.append(CheckResult(
            row.label(), Verdict.FAIL if missed else Verdict.PASS, measured, threshold,
            "; ".join(m.reason for m in missed) or None,
            {"throughput_gbytes_per_s": row.throughput_gbytes_per_s, "transport": row.transport,
             "path": row.path, "errors": row.errors},
        ))
    for skip in report.skipped:
        what = skip.engine + (f" {skip.transport}" if skip.transport else "")
        rows.append(CheckResult(what, Verdict.SKIP, f"unavailable: {skip.reason}",
                                hint=skip.hint))
    return rows


@dataclasses.dataclass(frozen=True)
class StoreSmokeParams:
    """``store-smoke``: the end-to-end store validation (``kvctl store smoke``).

    Without ``master`` an embedded store starts here: kvctl's (master, two nodes, one with an
    SSD tier), or for ``backend: mooncake`` a ``mooncake_master`` on loopback.
    """

    backend: str = "kvctl"
    master: str | None = None


@register_step("store-smoke", StoreSmokeParams, "the KV store keeps and returns objects")
def store_smoke(params: StoreSmokeParams, ctx: RunContext) -> list[CheckResult]:
    from kvctl.config import CommonSettings
    from kvctl.store.settings import StoreSettings
    from kvctl.store.smoke import run_kvctl, run_mooncake

    token = ctx.settings(CommonSettings).token
    if params.backend == "kvctl":
        transport = ctx.settings(StoreSettings).transport
        report = run_kvctl(params.master, token=token, progress=ctx.progress,
                           transport=transport)
    elif params.backend == "mooncake":
        report = run_mooncake(params.master, progress=ctx.progress)
    else:
        raise ConfigError(f"store-smoke: unknown backend {params.backend!r}",
                          "use kvctl or mooncake")
    verdicts = {"pass": Verdict.PASS, "fail": Verdict.FAIL, "skip": Verdict.SKIP}
    return [CheckResult(c.name, verdicts.get(c.status, Verdict.FAIL), c.detail,
                        "byte-exact", None if c.status != "fail" else
                        f"run 'kvctl store smoke --backend {params.backend}' for details",
                        {"bytes_moved": c.bytes_moved}) for c in report.checks]
