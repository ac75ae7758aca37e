"""``kvctl cluster``: the registered hosts, the host x host fabric matrix, the cluster runbook."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvctl.commands._common import GlobalOptions, JsonOpt, global_options, stop_on_signal
from kvctl.config import CommonSettings
from kvctl.errors import CheckFailedError, UsageError
from kvctl.output import Output, safe_cell, safe_markup, safe_text
from kvctl.units import parse_duration
from kvctl.verdict import check_entry
from kvctl.wording import plural

if TYPE_CHECKING:
    from kvctl.cluster.bench import ClusterBenchOptions, ClusterBenchReport
    from kvctl.cluster.coordinator import Coordinator
    from kvctl.cluster.registry import HostEntry
    from kvctl.cluster.runbook import ClusterRunbookReport

app = typer.Typer(help="The whole cluster through its agents: hosts, fabric matrix, runbook."
                  "\n\nExample: kvctl cluster bench --metadata etcd://10.0.0.5:2379",
                  no_args_is_help=True)

MetadataOpt = Annotated[str | None, typer.Option(
    "--metadata", "-m", help="Metadata URL the agents registered in (default "
    "KVCTL_METADATA).", show_default=False)]
_S = "Sweep (each pair)"
_P = "Plan"
_O = "Output"


# ---------------------------------------------------------------- shared


def _url(opts: GlobalOptions, metadata: str | None) -> tuple[str, CommonSettings]:
    common = opts.settings(CommonSettings, metadata=metadata)
    if common.metadata.startswith("memory://"):
        raise UsageError("no metadata service given: the agents register in one the "
                         "cluster shares", "give --metadata etcd://HOST:2379 (or set "
                         "KVCTL_METADATA)")
    return common.metadata, common


@contextmanager
def _session(opts: GlobalOptions, metadata: str | None, *, poll_s: float = 0.2,
             ttl_s: float = 10.0) -> Iterator[tuple[Coordinator, list[HostEntry]]]:
    from kvctl.cluster.coordinator import Coordinator
    from kvctl.cluster.protocol import ClusterKeys
    from kvctl.cluster.registry import read_hosts
    from kvctl.metadata import open_metadata

    url, common = _url(opts, metadata)
    keys = ClusterKeys(common.cluster_id)
    with open_metadata(url, token=common.token) as client, \
            Coordinator(client, keys, token=common.token, poll_s=poll_s,
                        ttl_s=ttl_s) as coordinator:
        yield coordinator, read_hosts(client, keys, common.token)


def _console(out: Output) -> Console:
    return out.console if out.console.is_terminal else Console(file=sys.stdout, width=160,
                                                               highlight=False)


# ---------------------------------------------------------------- ls


@app.command("ls")
def ls(ctx: typer.Context, metadata: MetadataOpt = None, json_out: JsonOpt = False) -> None:
    """List the registered hosts: liveness, version skew, GPUs, NICs, doctor findings.

    A host is live while its agent renews its lease. With KVCTL_TOKEN, a record not
    signed with it is listed as untrusted and never given work.

    Example: kvctl cluster ls --metadata etcd://10.0.0.5:2379 --json
    """
    import msgspec

    from kvctl import __version__
    from kvctl.cluster.agent import check_policy
    from kvctl.cluster.protocol import ClusterKeys
    from kvctl.cluster.registry import read_hosts
    from kvctl.metadata import open_metadata

    opts = global_options(ctx)
    out = opts.output(json_mode=json_out)
    url, common = _url(opts, metadata)
    keys = ClusterKeys(common.cluster_id)
    with open_metadata(url, token=common.token) as client:
        check_policy(client, keys, common.token)
        entries = read_hosts(client, keys, common.token)
    if json_out:
        out.emit_json("cluster.ls", {
            "metadata": url, "client_version": __version__,
            "hosts": [{"host": e.name, "state": "live" if e.trusted else "untrusted",
                       "problem": e.problem, "version_skew": e.skew,
                       "record": msgspec.to_builtins(e.record) if e.record else None}
                      for e in entries]})
        return
    table = Table(title=f"{sum(e.usable for e in entries)} host(s) registered in {url}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("host", "state", "address", "version", "GPUs", "NICs", "doctor",
                "transports", "up"):
        table.add_column(col, overflow="fold")
    for e in entries:
        r = e.record
        state = Text("live", style="green") if e.trusted else Text("untrusted", style="red")
        if r is None:
            table.add_row(safe_cell(e.name), state, "-", "-", "-", "-", "-", "-", "-")
            continue
        version = safe_cell(r.version + (" (skew)" if e.skew else ""),
                            style="yellow" if e.skew else "")
        gpus = ", ".join(f"{g.name} {g.model}" for g in r.gpus) or "-"
        nics = ", ".join(f"{n.name} {n.rate_gbps:g}G {n.state}" if n.rate_gbps else
                         f"{n.name} {n.state}" for n in r.nics) or "-"
        d = r.doctor
        doctor = d.error or (", ".join(f"{n} {s}" for s, n in (("error", d.errors),
                                                                ("warning", d.warnings),
                                                                ("info", d.infos)) if n)
                             or "clean")
        up = _age(r.started_at)
        table.add_row(safe_cell(e.name), state, safe_cell(r.address), version, safe_cell(gpus),
                      safe_cell(nics), safe_cell(doctor, style="red" if d.errors else ""),
                      safe_cell(",".join(r.transports)), up)
    _console(out).print(table)
    for e in entries:
        if not e.trusted:
            out.warn(safe_markup(f"{e.name}: {e.problem}"))


def _age(started_at: float) -> str:
    import time

    seconds = max(0.0, time.time() - started_at)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------- bench


def _bench_options(opts: GlobalOptions, *, op: str, transport: str, block_size: str,
                   batch_size: str, duration: str | None, iterations: int | None, warmup: int,
                   model: str | None, page_tokens: int, engine: list[str] | None,
                   verify: bool, schedule: str, pairs: int | None, seed: int, per_rail: bool,
                   cross_rail: bool, hosts: str | None, slow_fraction: float, timeout: str,
                   max_buffer: str, local_location: str = "cpu:0",
                   remote_location: str = "cpu:0") -> ClusterBenchOptions:
    from kvctl.bench.session import validate_engines
    from kvctl.bench.spec import BenchSettings, build_sweep
    from kvctl.cluster.bench import ClusterBenchOptions
    from kvctl.models import resolve_model
    from kvctl.units import parse_size

    if not 0 < slow_fraction < 1 or math.isnan(slow_fraction):
        raise UsageError(f"--slow-fraction {slow_fraction} is not between 0 and 1",
                         "use e.g. --slow-fraction 0.7")
    settings = BenchSettings(
        op=op, transport=transport, block_size=block_size, batch_size=batch_size,
        duration=parse_duration(duration, what="--duration") if duration else None,
        iterations=iterations, warmup=warmup, verify=verify, model=model,
        page_tokens=page_tokens, max_buffer_bytes=parse_size(max_buffer, what="--max-buffer"),
        local_location=local_location, remote_location=remote_location)
    sweep = build_sweep(settings, model=resolve_model(model) if model else None)
    if "shm" in sweep.transports:
        raise UsageError("shm moves bytes within one host, never between two",
                         "use --transport tcp, rdma or auto")
    return ClusterBenchOptions(
        sweep=sweep, engines=validate_engines(engine or ["kvctl"]), schedule=schedule,
        pairs=pairs, seed=seed, per_rail=per_rail or cross_rail, cross_rail=cross_rail,
        timeout_s=parse_duration(timeout, what="--timeout"), slow_fraction=slow_fraction,
        hosts=tuple(h.strip() for h in (hosts or "").split(",") if h.strip()))


OpOpt = Annotated[str, typer.Option("--op", help="read, write or both.", rich_help_panel=_S)]
TransportOpt = Annotated[str, typer.Option(
    "--transport", "-t", help="tcp, rdma or auto; comma list.", rich_help_panel=_S)]
BlockOpt = Annotated[str, typer.Option(
    "--block-size", "-b", help="Block sizes (64KiB,1MiB).", rich_help_panel=_S)]
BatchOpt = Annotated[str, typer.Option(
    "--batch-size", "-n", help="Requests per batch.", rich_help_panel=_S)]
DurationOpt = Annotated[str | None, typer.Option(
    "--duration", "-d", help="Timed time per configuration. (default: 1s)",
    show_default=False, rich_help_panel=_S)]
IterationsOpt = Annotated[int | None, typer.Option(
    "--iterations", "-i", help="Timed batches per configuration (instead of --duration).",
    show_default=False, rich_help_panel=_S)]
WarmupOpt = Annotated[int, typer.Option("--warmup", help="Untimed batches first.",
                                        rich_help_panel=_S)]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="Blocks sized as KV pages of a model (built-in name).",
    show_default=False, rich_help_panel=_S)]
PageOpt = Annotated[int, typer.Option("--page-tokens", help="Tokens per KV page with --model.",
                                      rich_help_panel=_S)]
EngineOpt = Annotated[list[str] | None, typer.Option(
    "--engine", "-e", help="kvctl, mooncake or nixl; repeatable. (default: kvctl)",
    show_default=False, rich_help_panel=_S)]
VerifyOpt = Annotated[bool, typer.Option("--verify/--no-verify",
                                         help="Check every block end to end.",
                                         rich_help_panel=_S)]
ScheduleOpt = Annotated[str, typer.Option(
    "--schedule", help="auto (one pair at a time up to 4 hosts, else rounds), sequential or "
    "rounds (disjoint pairs at once, N-1 rounds).", rich_help_panel=_P)]
PairsOpt = Annotated[int | None, typer.Option(
    "--pairs", help="Test only this many pairs, sampled evenly over the hosts.",
    show_default=False, rich_help_panel=_P)]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the --pairs sample.",
                                      rich_help_panel=_P)]
RailOpt = Annotated[bool, typer.Option(
    "--per-rail", help="Bench NIC i against NIC i where hosts have several NICs (both "
    "ends bound to their rail's address; the agents' rails, see kvctl agent --rail).",
    rich_help_panel=_P)]
CrossOpt = Annotated[bool, typer.Option(
    "--cross-rail", help="Also NIC i against every NIC j (implies --per-rail).",
    rich_help_panel=_P)]
HostsOpt = Annotated[str | None, typer.Option(
    "--hosts", help="Only these hosts (comma list).", show_default=False, rich_help_panel=_P)]
SlowOpt = Annotated[float, typer.Option(
    "--slow-fraction", help="A pair below this fraction of the median is slow.",
    rich_help_panel=_P)]
TimeoutOpt = Annotated[str, typer.Option("--timeout", help="Longest one batch may take.",
                                         rich_help_panel=_P)]
PollOpt = Annotated[str, typer.Option("--poll", help="How often to poll the agents' statuses "
                                      "where the metadata service cannot push them (etcd "
                                      "pushes at once).", rich_help_panel=_P)]
LocalOpt = Annotated[str, typer.Option(
    "--local-location", help="Initiator's buffer: cpu:N or file:PATH.", rich_help_panel=_S)]
RemoteOpt = Annotated[str, typer.Option(
    "--remote-location", help="Target's buffer: cpu:N, cuda:N (the decode side's GPU) or "
    "file:PATH.", rich_help_panel=_S)]
MaxBufferOpt = Annotated[str, typer.Option(
    "--max-buffer", help="Refuse sweeps needing more memory per side.", rich_help_panel=_S)]


@app.command("reset-policy")
def reset_policy(
    ctx: typer.Context,
    metadata: MetadataOpt = None,
    yes: Annotated[bool, typer.Option(
        "--yes", help="Delete it (without --yes: say what would be deleted).")] = False,
) -> None:
    """Delete the cluster's token policy, for a cluster that no longer runs with a token.

    The first agent or client with KVCTL_TOKEN writes the policy; from then on agents and
    clients without the token are refused. This removes it (no etcdctl needed); the next
    holder of a token writes a new one.

    Example: kvctl cluster reset-policy --metadata etcd://10.0.0.5:2379 --yes
    """
    import msgspec

    from kvctl.cluster.protocol import ClusterKeys, Policy
    from kvctl.metadata import open_metadata

    opts = global_options(ctx)
    out = opts.output()
    url, common = _url(opts, metadata)
    keys = ClusterKeys(common.cluster_id)
    with open_metadata(url, token=common.token) as client:
        stored = client.get(keys.policy)
        if stored is None:
            out.print(f"no token policy at {keys.policy} in {url}: nothing to delete")
            return
        try:
            who = msgspec.json.decode(stored, type=Policy).written_by
        except msgspec.DecodeError:
            who = "an unknown writer"
        if not yes:
            raise UsageError(f"{keys.policy} in {url} (written by {who}) was not deleted: "
                             "without it, agents and clients without the token may join",
                             "rerun with --yes to delete it")
        client.delete(keys.policy)
    out.print(f"deleted the token policy {keys.policy} (written by {who}) from {url}")


@app.command("bench")
def bench(
    ctx: typer.Context,
    metadata: MetadataOpt = None,
    op: OpOpt = "both",
    transport: TransportOpt = "tcp",
    block_size: BlockOpt = "1MiB",
    batch_size: BatchOpt = "32",
    duration: DurationOpt = None,
    iterations: IterationsOpt = None,
    warmup: WarmupOpt = 2,
    model: ModelOpt = None,
    page_tokens: PageOpt = 16,
    engine: EngineOpt = None,
    local_location: LocalOpt = "cpu:0",
    remote_location: RemoteOpt = "cpu:0",
    verify: VerifyOpt = True,
    schedule: ScheduleOpt = "auto",
    pairs: PairsOpt = None,
    seed: SeedOpt = 0,
    per_rail: RailOpt = False,
    cross_rail: CrossOpt = False,
    hosts: HostsOpt = None,
    slow_fraction: SlowOpt = 0.7,
    timeout: TimeoutOpt = "10s",
    poll: PollOpt = "0.2s",
    max_buffer: MaxBufferOpt = "2GiB",
    json_out: JsonOpt = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="The matrices as CSV on stdout.",
                                          rich_help_panel=_O)] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write the matrices as a heatmap PNG (needs matplotlib).",
        show_default=False, rich_help_panel=_O)] = None,
) -> None:
    """Benchmark every pair of registered hosts and name the host or NIC the slow pairs share.

    Each pair: a target on one host (sized for the sweep, freed after), READ and WRITE from
    the other, verified. Prints the host x host GB/s matrix (the slower direction of each
    pair), per rail with --per-rail, and a diagnosis: pairs below --slow-fraction of the
    median, and the host common to most of them with its row and column as evidence. A host
    that vanishes is reported missing; Ctrl-C stops with what was measured. Exit 1 when a
    pair is slow, failed or missing.

    Example: kvctl cluster bench -m etcd://10.0.0.5:2379 --model llama-3-70b --plot fabric.png
    """
    from kvctl.cluster.bench import BenchEvent, run_cluster_bench
    from kvctl.cluster.report import matrix_csv, plot_heatmap, report_payload

    opts = global_options(ctx)
    if json_out and csv_out:
        raise UsageError("--json and --csv are exclusive", "pick one output format")
    out = opts.output(json_mode=json_out or csv_out)
    options = _bench_options(
        opts, op=op, transport=transport, block_size=block_size, batch_size=batch_size,
        duration=duration if duration or iterations else "1s", iterations=iterations,
        warmup=warmup, model=model, page_tokens=page_tokens, engine=engine, verify=verify,
        schedule=schedule, pairs=pairs, seed=seed, per_rail=per_rail, cross_rail=cross_rail,
        hosts=hosts, slow_fraction=slow_fraction, timeout=timeout, max_buffer=max_buffer,
        local_location=local_location, remote_location=remote_location)
    if plot is not None:
        from kvctl.bench.plot import require_matplotlib

        require_matplotlib()
    with stop_on_signal() as stop, _session(opts, metadata,
                                            poll_s=parse_duration(poll, what="--poll")) as (
            coordinator, entries):
        usable = sum(e.usable for e in entries)
        out.info(f"Benchmarking {usable} host(s) ({options.sweep.configs()[0].label()}"
                 f"{' ...' if len(options.sweep.configs()) > 1 else ''}) through their agents")
        with out.progress("cluster bench", total=None) as bar:
            task = bar.task_ids[0]

            def progress(event: BenchEvent) -> None:
                bar.update(task, total=event.total, completed=event.done,
                           description=f"round {event.round_index + 1}/{event.rounds}: "
                           f"{event.message}")
                out.debug(event.message)

            report = run_cluster_bench(coordinator, entries, options, on_event=progress,
                                       stop=stop)
    if json_out:
        out.emit_json("cluster.bench", {**report_payload(report), "checks": _bench_checks(report)})
    elif csv_out:
        sys.stdout.write(matrix_csv(report))
    else:
        _render_bench(out, report)
    if plot is not None:
        out.info(f"Heatmap written to {plot_heatmap(report, plot)}")
    _bench_verdict(report)


def _cell(value: float | None, state: str | None, slow: bool) -> Text:
    if value is None:
        return Text(state or "", style="red" if state else "dim")
    return Text(f"{value:.3g}", style="bold red" if slow else "")


def _render_bench(out: Output, report: ClusterBenchReport) -> None:
    from kvctl.cluster.report import describe_sweep, matrices

    console = _console(out)
    slow = {(s.a.host, s.b.host) for s in report.diagnosis.slow}
    slow |= {(b, a) for a, b in slow}
    for m in matrices(report):
        console.print(f"{safe_markup(m.label)}: GB/s (10^9 B/s), the slower direction of each "
                      f"pair; "
                      f"{describe_sweep(report)}")
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("")
        for h in m.hosts:
            table.add_column(safe_markup(h), justify="right")
        for i, h in enumerate(m.hosts):
            cells = [Text("-", style="dim") if i == j else
                     _cell(m.cells[i][j], m.states.get((h, other)), (h, other) in slow)
                     for j, other in enumerate(m.hosts)]
            table.add_row(safe_cell(h), *cells)
        console.print(table)
    d = report.diagnosis
    console.print(f"schedule: {report.schedule.mode}, {len(report.schedule.rounds)} round(s), "
                  f"{len(report.outcomes)} pair(s) in {report.duration_s:.1f} s")
    console.print(Text(safe_text(f"diagnosis: {d.summary()}")))
    if d.note:
        console.print(f"[yellow]note:[/yellow] {d.note}")
    for c in d.culprits:
        row = ", ".join(f"{e.peer.label()} {e.gbps:.3g}" for e in c.row if e.gbps is not None)
        col = ", ".join(f"{e.peer.label()} {e.gbps:.3g}" for e in c.column
                        if e.gbps is not None)
        console.print(Text(safe_text(f"  {c.subject.label()}: as initiator (its row): "
                                     f"{row or '-'}; as target (its column): {col or '-'}")))
        record = report.records.get(c.subject.host)
        for f in (record.doctor.findings if record else []):
            if f.severity in ("error", "warning"):
                console.print(Text(safe_text(f"  {c.subject.host} topo doctor {f.severity}: "
                                             f"{f.subject}: {f.message} ({f.hint})")))
    for gone in report.missing:
        console.print(f"[red]missing:[/red] {safe_markup(gone.host)} (agent vanished, seen gone "
                      f"in round {gone.round_index + 1})")
    for o in report.failed:
        console.print(Text(safe_text(f"failed: {o.a.label()} -> {o.b.label()}: {o.error}"),
                           style="red"))
    for host, problem in report.untrusted:
        out.warn(safe_markup(f"{host} not benched: {problem}"))


def _bench_checks(report: ClusterBenchReport) -> list[dict[str, Any]]:
    """One check per pair (fails when not measured intact, or slow) and per vanished host."""
    slow = {(s.a.label(), s.b.label()): s for s in report.diagnosis.slow}
    checks = []
    for o in report.outcomes:
        a, b = o.a.label(), o.b.label()
        if o.state != "ok":
            checks.append(check_entry(f"{a} -> {b}", "fail", detail=o.error or o.state))
        elif (a, b) in slow:
            checks.append(check_entry(f"{a} -> {b}", "fail", detail=(
                f"{slow[a, b].gbps:.3g} GB/s, {slow[a, b].ratio:.0%} of the cluster's median")))
        else:
            checks.append(check_entry(f"{a} -> {b}", "pass", detail=f"{o.gbps:.3g} GB/s"
                                      if o.gbps is not None else "measured"))
    checks += [check_entry(m.host, "fail", detail="its agent vanished during the run")
               for m in report.missing]
    return checks


def _bench_verdict(report: ClusterBenchReport) -> None:
    if report.interrupted:
        sys.stderr.write("Interrupted: the matrix above has what was measured.\n")
        raise typer.Exit(130)
    if report.ok:
        return
    parts = []
    d = report.diagnosis
    if d.culprits:
        parts.append("likely culprit " + ", ".join(c.subject.label() for c in d.culprits))
    if d.slow:
        parts.append(f"{len(d.slow)} slow pair(s)")
    if d.unreachable:
        parts.append("no pair reached " + ", ".join(e.label() for e in d.unreachable))
    if report.missing:
        parts.append("missing " + ", ".join(m.host for m in report.missing))
    if report.failed:
        parts.append(f"{len(report.failed)} failed pair(s)")
    raise CheckFailedError("cluster bench: " + "; ".join(parts), bench_hint(report))


def bench_hint(report: ClusterBenchReport) -> str:
    """What to do about a bench that is not ok: an agent that is gone is restarted (its
    lease expired: the process or its host stopped, not the link), a pair that failed or
    is slow points at its link."""
    hints = []
    if report.missing:
        gone = ", ".join(m.host for m in report.missing)
        hints.append(f"the agent on {gone} stopped renewing its lease (the process or the "
                     f"host is gone, not the link): check or restart 'kvctl agent' there "
                     "('kvctl cluster ls' lists it again once it is back)")
    d = report.diagnosis
    if d.culprits or d.slow or d.unreachable or report.failed:
        hints.append("check the named host's link, NIC and cable ('ip link' on it shows a "
                      "NIC down, 'kvctl topo doctor' the rest); rerun with -v for each pair")
    return "; ".join(hints) or "rerun with -v for each pair"


# ---------------------------------------------------------------- runbook


@app.command("runbook")
def runbook(
    ctx: typer.Context,
    metadata: MetadataOpt = None,
    host_runbook: Annotated[Path | None, typer.Option(
        "--host-runbook", help="Runbook each host runs (default: the built-in single-host "
        "runbook); sent to the agents, no shared files.", show_default=False)] = None,
    hosts: HostsOpt = None,
    block_size: BlockOpt = "1MiB",
    batch_size: BatchOpt = "32",
    duration: DurationOpt = None,
    store: Annotated[bool, typer.Option("--store/--no-store",
                                        help="Run the store smoke across the hosts.")] = True,
    keys_profile: Annotated[str, typer.Option(
        "--key-profile", help="Key profile every host computes keys with.")] = "kvctl:sha256",
    json_out: JsonOpt = False,
) -> None:
    """Validate every host and the fabric between them: one verdict table, exit 1 on a fail.

    Through the agents: the single-host runbook on every host at once, the cross-host
    transfer matrix with its diagnosis, a store smoke with a node and a client on every
    host (objects read back across hosts byte for byte), and block keys compared across
    hosts.

    Example: kvctl cluster runbook -m etcd://10.0.0.5:2379 --json > cluster-report.json
    """
    from kvctl.cluster.runbook import ClusterRunbookOptions, run_cluster_runbook

    opts = global_options(ctx)
    out = opts.output(json_mode=json_out)
    text = None
    if host_runbook is not None:
        try:
            text = host_runbook.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot read {host_runbook}: {exc.strerror or exc}",
                             "give a runbook YAML file (examples/runbooks/)") from exc
        from kvctl.runbook.model import load_runbook

        load_runbook(host_runbook)  # refuse a bad runbook here, before any host runs it
    bench_options = _bench_options(
        opts, op="both", transport="tcp", block_size=block_size, batch_size=batch_size,
        duration=duration or "1s", iterations=None, warmup=2, model=None, page_tokens=16,
        engine=None, verify=True, schedule="auto", pairs=None, seed=0, per_rail=False,
        cross_rail=False, hosts=hosts, slow_fraction=0.7, timeout="10s", max_buffer="2GiB")
    options = ClusterRunbookOptions(
        host_runbook=text, host_runbook_name=host_runbook.stem if host_runbook else
        "single-host", bench=bench_options, store=store, keys_profile=keys_profile)
    with stop_on_signal() as stop, _session(opts, metadata) as (coordinator, entries), \
            out.progress("cluster runbook", total=None) as bar:
        report = run_cluster_runbook(
            coordinator, entries, options, stop=stop,
            progress=lambda m: bar.update(bar.task_ids[0], description=m))
    if json_out:
        from kvctl.cluster.report import report_payload

        # passed and results: schema 1's names, deprecated aliases of ok and checks.
        out.emit_json("cluster.runbook", {
            "ok": report.passed, "duration_s": report.duration_s,
            "hosts": list(report.hosts),
            "checks": [check_entry(f"{r.host}: {r.check}", r.verdict.value, host=r.host,
                                   measured=r.measured, hint=r.hint) for r in report.rows],
            "passed": report.passed,
            "results": [{"host": r.host, "check": r.check, "verdict": r.verdict.value,
                         "measured": r.measured, "hint": r.hint} for r in report.rows],
            "bench": report_payload(report.bench) if report.bench is not None else None})
    else:
        _render_runbook(out, report)
    if stop.is_set():
        raise typer.Exit(130)
    if not report.passed:
        failed = [f"{r.host}: {r.check}" for r in report.failed()]
        raise CheckFailedError(f"{plural(len(failed), 'check')} failed: {', '.join(failed)}",
                               "see the measured and hint columns of each failed check")


def _render_runbook(out: Output, report: ClusterRunbookReport) -> None:
    from kvctl.runbook.model import Verdict

    style = {Verdict.PASS: "green", Verdict.FAIL: "bold red", Verdict.SKIP: "yellow"}
    console = _console(out)
    table = Table(title=f"cluster runbook: {'PASSED' if report.passed else 'FAILED'} in "
                  f"{report.duration_s:.1f} s ({len(report.hosts)} hosts)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("host", "check", "result", "measured", "hint"):
        table.add_column(column, overflow="fold")
    for r in report.rows:
        s = style[r.verdict]
        table.add_row(safe_cell(r.host), safe_cell(r.check), f"[{s}]{r.verdict.value}[/{s}]",
                      safe_cell(r.measured), safe_cell(r.hint or ""))
    console.print(table)
    summary = Table(title="overall", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    summary.add_column("host")
    summary.add_column("result")
    summary.add_column("checks", justify="right")
    for host in [*report.hosts, "cluster"]:
        mine = [r for r in report.rows if r.host == host]
        if not mine:
            continue
        failed = sum(r.verdict is Verdict.FAIL for r in mine)
        verdict = Verdict.FAIL if failed else Verdict.PASS
        summary.add_row(safe_cell(host), f"[{style[verdict]}]{verdict.value}[/{style[verdict]}]",
                        f"{len(mine) - failed}/{len(mine)} pass")
    console.print(summary)


# ---------------------------------------------------------------- plan


@app.command("plan")
def plan(
    ctx: typer.Context,
    hosts: Annotated[list[int], typer.Argument(help="Cluster sizes to plan for.")],
    pair_duration: Annotated[str, typer.Option(
        "--pair-duration", help="Seconds one pair's bench takes.")] = "3s",
    schedule: Annotated[str, typer.Option("--schedule", help="rounds or sequential.")] =
        "rounds",
    pairs: PairsOpt = None,
    rails: Annotated[int, typer.Option("--rails", help="NIC rails benched per pair.")] = 1,
    ttl: Annotated[str, typer.Option("--ttl", help="Agents' lease TTL.")] = "10s",
    agent_poll: Annotated[str, typer.Option("--agent-poll", help="Agents' job poll.")] =
        "0.5s",
    client_poll: Annotated[str, typer.Option("--client-poll", help="Client's status poll.")]
        = "0.2s",
    watch: Annotated[bool, typer.Option(
        "--watch/--no-watch", help="The service pushes changes (etcd); --no-watch: agents "
        "and client poll (file://, http://, redis://).")] = True,
    json_out: JsonOpt = False,
) -> None:
    """What a cluster bench costs at a size: rounds, wall time, metadata-service load.

    Computed from the plan's shape (a 10,000-host tournament has 50 million pairs) and
    the protocol's writes per pair; nothing is contacted.

    Example: kvctl cluster plan 1000 10000 --pair-duration 3s
    """
    from kvctl.cluster.scheduler import plan_figures

    opts = global_options(ctx)
    out = opts.output(json_mode=json_out)
    figures = [plan_figures(n, pair_duration_s=parse_duration(pair_duration,
                                                              what="--pair-duration"),
                            mode=schedule, pairs=pairs, rails=rails,
                            lease_ttl_s=parse_duration(ttl, what="--ttl"),
                            agent_poll_s=parse_duration(agent_poll, what="--agent-poll"),
                            client_poll_s=parse_duration(client_poll, what="--client-poll"),
                            watch=watch)
               for n in hosts]
    if json_out:
        out.emit_json("cluster.plan", {"plans": figures})
        return
    table = Table(title="kvctl cluster plan", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    right: dict[str, Any] = {"justify": "right"}
    for col in ("hosts", "pairs", "rounds", "pairs/round", "wall time", "keys (peak)",
                "writes/pair", "writes/s", "renewals/s", "reads/s", "watches", "events/s"):
        table.add_column(col, **right)
    for f in figures:
        table.add_row(f"{f.hosts:,}", f"{f.pairs:,}", f"{f.rounds:,}", f"{f.pairs_per_round:,}",
                      _duration(f.wall_time_s), f"{f.metadata_keys_peak:,}",
                      str(f.writes_per_pair), f"{f.writes_per_s:,.0f}",
                      f"{f.lease_renewals_per_s:,.0f}", f"{f.reads_per_s:,.0f}",
                      f"{f.watch_streams:,}", f"{f.events_per_s:,.0f}")
    _console(out).print(table)
    first = figures[0]
    handoffs = "four pushed hand-offs" if first.watch else "two agent polls, two client polls"
    out.info(f"per round: {first.pair_duration_s:g} s per pair + {first.round_overhead_s:.2f} s "
             f"of coordination ({handoffs}, a target start)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
