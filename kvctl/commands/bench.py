"""``kvctl bench``: fabric benchmarks (``bench transfer``: batched READ/WRITE, verified)."""

from __future__ import annotations

import dataclasses
import math
import shlex
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kvctl.bench.linerate import LineRate
from kvctl.bench.plot import plot_rows, require_matplotlib
from kvctl.bench.report import BenchReport, report_payload, to_csv, to_jsonl
from kvctl.bench.result import ResultRow, raise_shortfalls
from kvctl.bench.runner import ProgressEvent
from kvctl.bench.session import (
    RunOptions,
    nic_rates_for,
    run_transfer_bench,
    validate_engines,
)
from kvctl.bench.spec import ROLES, BenchSettings, build_sweep
from kvctl.bench.target.kvctl import TargetSpec
from kvctl.bench.target.serve import TargetSet
from kvctl.commands._common import GlobalOptions, JsonOpt, global_options, renamed_flag
from kvctl.config import CommonSettings
from kvctl.errors import KvctlError, UsageError
from kvctl.models import resolve_model
from kvctl.output import Output
from kvctl.units import format_size, parse_duration
from kvctl.verdict import check_entry

app = typer.Typer(help="Benchmarks: fabric throughput, latency and integrity.\n\n"
                  "Example: kvctl bench transfer --verify",
                  no_args_is_help=True)

_S = "Sweep"
_R = "Roles (two hosts)"
_C = "Checks"
_O = "Output"


@app.command("transfer")
def transfer(
    ctx: typer.Context,
    op: Annotated[str | None, typer.Option(
        "--op", help="read, write or both. (default: both)", rich_help_panel=_S)] = None,
    transport: Annotated[str | None, typer.Option(
        "--transport", "-t", help="shm, tcp, rdma or auto; comma list. (default: shm,tcp)",
        rich_help_panel=_S)] = None,
    block_size: Annotated[str | None, typer.Option(
        "--block-size", "-b", help="Sizes (4KiB,1MiB) or a power-of-two range (4KiB-4MiB). "
        "(default: 4KiB,64KiB,1MiB,4MiB)", rich_help_panel=_S)] = None,
    batch_size: Annotated[str | None, typer.Option(
        "--batch-size", "-n", help="Requests per batch; comma list. (default: 128)",
        rich_help_panel=_S)] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="Initiator threads, each with its own batches. (default: 1)",
        rich_help_panel=_S)] = None,
    duration: Annotated[str | None, typer.Option(
        "--duration", "-d", help="Timed time per configuration (e.g. 2s). (default: 0.6s)",
        rich_help_panel=_S)] = None,
    iterations: Annotated[int | None, typer.Option(
        "--iterations", "-i", help="Timed batches per thread and configuration (instead of "
        "--duration).", rich_help_panel=_S)] = None,
    warmup: Annotated[int | None, typer.Option(
        "--warmup", help="Untimed batches per thread first. (default: 2)",
        rich_help_panel=_S)] = None,
    local_location: Annotated[str | None, typer.Option(
        "--local-location", help="Initiator buffer: cpu:N, cuda:N (GPU memory, CUDA "
        "ordinal) or file:PATH. (default: cpu:0)",
        rich_help_panel=_S)] = None,
    remote_location: Annotated[str | None, typer.Option(
        "--remote-location", help="Target buffer: cpu:N, cuda:N or file:PATH. "
        "(default: cpu:0)", rich_help_panel=_S)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Size blocks as KV pages of a model: built-in name or config.json.",
        rich_help_panel=_S)] = None,
    page_tokens: Annotated[int | None, typer.Option(
        "--page-tokens", help="Tokens per KV page with --model. (default: 16)",
        rich_help_panel=_S)] = None,
    engine: Annotated[list[str] | None, typer.Option(
        "--engine", "-e", help="kvctl, mooncake or nixl; repeatable, the first is the ratio "
        "baseline. (default: kvctl)", rich_help_panel=_S)] = None,
    max_buffer: Annotated[str | None, typer.Option(
        "--max-buffer", help="Most buffer memory per side. (default: 2GiB)",
        rich_help_panel=_S)] = None,
    timeout: Annotated[str | None, typer.Option(
        "--timeout", help="Longest one batch may take. (default: 30s)",
        rich_help_panel=_S)] = None,
    nic: Annotated[str | None, typer.Option(
        "--nic", help="RDMA NICs to use and nothing else, best first: mlx5_0 or mlx5_0:1; "
        "comma list (rdma/auto). (default: topo's ranking per buffer)",
        rich_help_panel=_S)] = None,
    gid_index: Annotated[int | None, typer.Option(
        "--gid-index", help="RoCE GID index on every port. (default: the port's RoCE v2 "
        "IPv4-mapped entry)", rich_help_panel=_S)] = None,
    role: Annotated[str | None, typer.Option(
        "--role", help="local (embedded target), initiator or target. (default: local)",
        rich_help_panel=_R)] = None,
    listen: Annotated[str | None, typer.Option(
        "--listen", help="Target: HOST:PORT to serve on. (default: 127.0.0.1:0; with a "
        "--metadata service on another host, the address that routes to it)",
        rich_help_panel=_R)] = None,
    advertise: Annotated[str | None, typer.Option(
        "--advertise", help="Target: HOST peers reach it at (default: the --listen host, or "
        "this host's interface addresses for 0.0.0.0).", rich_help_panel=_R)] = None,
    peer: Annotated[str | None, typer.Option(
        "--peer", help="Initiator: the target's segment NAME (with --metadata) or HOST:PORT.",
        rich_help_panel=_R)] = None,
    metadata: Annotated[str | None, typer.Option(
        "--metadata", help="Metadata URL shared by both hosts (etcd://, redis://, http://); "
        "without it the target serves its own and --peer is its address.",
        rich_help_panel=_R)] = None,
    segment: Annotated[str | None, typer.Option(
        "--segment", help="Segment name the target publishes. (default: kvctl-bench)",
        rich_help_panel=_R)] = None,
    serve_for: Annotated[str | None, typer.Option(
        "--serve-for", help="Target: stop after this long (default: until Ctrl-C).",
        rich_help_panel=_R)] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Target: serve Prometheus metrics on this port of the "
        "--listen host (loopback only with a token; 0 = any free).", show_default=False,
        rich_help_panel=_R)] = None,
    verify: Annotated[bool | None, typer.Option(
        "--verify/--no-verify", help="Check every block's pattern end to end.",
        rich_help_panel=_C)] = None,
    expect_line_rate: Annotated[float | None, typer.Option(
        "--expect-line-rate", help="Exit 1 when a configuration is below this fraction of "
        "its line rate (e.g. 0.9).", rich_help_panel=_C)] = None,
    expect_gbytes_per_s: Annotated[float | None, typer.Option(
        "--expect-gbytes-per-s", help="Exit 1 when a configuration is below this many GB/s "
        "(gigabytes: 10^9 bytes per second; Gbit/s / 8).", rich_help_panel=_C)] = None,
    expect_gbps: Annotated[float | None, typer.Option(
        "--expect-gbps", hidden=True,
        help="Deprecated name of --expect-gbytes-per-s (GB/s).")] = None,
    json_out: JsonOpt = False,
    jsonl: Annotated[bool, typer.Option(
        "--jsonl", help="One JSON row per line on stdout.", rich_help_panel=_O)] = False,
    csv_out: Annotated[bool, typer.Option(
        "--csv", help="CSV rows on stdout.", rich_help_panel=_O)] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write a PNG of throughput and p99 latency against block size "
        "(needs matplotlib: the plot extra).", show_default=False, rich_help_panel=_O)] = None,
) -> None:
    """Measure batched READ/WRITE throughput and latency, checked against line rate.

    With no arguments it starts an embedded target in a separate process on loopback and
    sweeps shm and tcp, read and write, 4 KiB to 4 MiB blocks, batches of 128. Throughput is
    GB/s (decimal, 10^9 B/s) and Gbit/s; latencies are microseconds.

    Two hosts: 'kvctl bench transfer --role target --listen 0.0.0.0:7400' on one,
    'kvctl bench transfer --role initiator --peer HOSTA:7400' on the other.

    Example: kvctl bench transfer --engine kvctl --engine mooncake -t tcp --verify
    """
    opts = global_options(ctx)
    expect_gbytes_per_s = renamed_flag(opts, "--expect-gbps", expect_gbps,
                                       "--expect-gbytes-per-s", expect_gbytes_per_s)
    modes = [name for name, on in (("--json", json_out), ("--jsonl", jsonl), ("--csv", csv_out))
             if on]
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)} are exclusive", "pick one output format")
    settings: BenchSettings = opts.settings(
        BenchSettings, op=op, transport=transport, block_size=block_size, batch_size=batch_size,
        threads=threads, duration=duration, iterations=iterations, warmup=warmup,
        local_location=local_location, remote_location=remote_location, model=model,
        page_tokens=page_tokens, engine=tuple(engine) if engine else None,
        max_buffer_bytes=max_buffer, timeout=timeout, role=role, listen=listen,
        advertise=advertise, peer=peer,
        metadata=metadata, segment=segment, verify=verify, expect_line_rate=expect_line_rate,
        expect_gbytes_per_s=expect_gbytes_per_s, nic=nic, gid_index=gid_index)
    out = opts.output(json_mode=bool(modes))
    if settings.role not in ROLES:
        raise UsageError(f"role {settings.role!r} is unknown", f"use --role {'|'.join(ROLES)}")
    for name, value in (("--expect-line-rate", settings.expect_line_rate),
                        ("--expect-gbytes-per-s", settings.expect_gbytes_per_s)):
        if value is not None and (value <= 0 or math.isnan(value)):
            raise UsageError(f"{name} {value} is not positive", f"use e.g. {name} 0.9")
    if settings.role == "initiator" and not settings.peer:
        raise UsageError("--role initiator needs --peer",
                         "give the target's HOST:PORT (or its segment name with --metadata)")
    if metrics_port is not None and settings.role != "target":
        raise UsageError(f"--metrics-port is for --role target, and this run is --role "
                         f"{settings.role}", "drop it, or give it to the target's command")
    model_spec = resolve_model(settings.model) if settings.model else None
    sweep = build_sweep(settings, model=model_spec)
    engines = validate_engines(settings.engine)
    token = opts.settings(CommonSettings).token

    if settings.role == "target":
        _serve_target(out, settings, sweep.region_bytes, engines, sweep.transports, token,
                      parse_duration(serve_for, what="--serve-for") if serve_for else None,
                      nics=sweep.nics, gid_index=sweep.gid_index, metrics_port=metrics_port)
        return
    if plot is not None:
        require_matplotlib()

    if sweep.sizing is not None:
        s = sweep.sizing
        out.info(f"Model {s.model}: {s.kv_bytes_per_token:,} KV bytes/token x "
                 f"{s.tokens_per_block} tokens = {format_size(s.block_size_bytes)} per block")
    where = settings.peer or "an embedded target on 127.0.0.1"
    out.info(f"Benchmarking {', '.join(engines)} against {where} "
             f"({len(sweep.configs())} configurations per engine)")
    nic_rates = _nic_rates(opts, out, str(sweep.local)) if settings.peer else {}
    options = RunOptions(engines=engines, peer=settings.peer, metadata=settings.metadata,
                         timeout_s=settings.timeout, expect_line_rate=settings.expect_line_rate,
                         expect_gbytes_per_s=settings.expect_gbytes_per_s, nic_rates=nic_rates,
                         token=token)
    total = len(sweep.configs()) * len(engines)
    with out.progress("bench transfer", total=total) as bar:
        task = bar.task_ids[0]

        def progress(event: ProgressEvent) -> None:
            bar.update(task, description=f"{event.engine} {event.label}")

        def advance(row: ResultRow) -> None:
            bar.advance(task)
            out.debug(f"{row.label()}: {row.throughput_gbytes_per_s:.3f} GB/s")

        report = run_transfer_bench(sweep, options, on_progress=progress, on_row=advance)

    if json_out:
        out.emit_json("bench.transfer", {**report_payload(report), **_verdict(report)})
    elif jsonl:
        sys.stdout.write(to_jsonl(report.rows))
    elif csv_out:
        sys.stdout.write(to_csv(report.rows))
    else:
        _render(out, report)
    for skip in report.skipped:
        what = skip.engine + (f" over {skip.transport}" if skip.transport else "")
        out.warn(f"skipped {what}: {skip.reason}" + (f" ({skip.hint})" if skip.hint else ""))
    invalid = [r.label() for r in report.rows if r.line_rate_valid is False]
    if invalid:
        out.warn(f"baseline below measured: baseline invalid for {len(invalid)} row(s) "
                 f"({', '.join(invalid)}); they went faster than the line rate they were "
                 "measured against, so no line-rate verdict is drawn from it")
    if plot is not None:
        path = plot_rows(report.rows, plot)
        out.info(f"Plot written to {path}")
    raise_shortfalls(report.shortfalls)


def _nic_rates(opts: GlobalOptions, out: Output, location: str) -> dict[str, LineRate]:
    """Cross-host line rates from this host's topology (none when it cannot be read)."""
    from kvctl.topo.sources import TopoSettings, load_topology

    where = location if location.startswith(("cpu:", "cuda:")) else "cpu:0"
    try:
        topology = load_topology(opts.settings(TopoSettings))
        rates = nic_rates_for(where, topology)
    except KvctlError as exc:
        out.warn(f"no NIC line rate: topology unreadable ({exc.cause})")
        return {}
    for medium, rate in rates.items():
        out.debug(f"line rate for cross-host {medium}: {rate.gbytes_per_s:.2f} GB/s "
                  f"({rate.source})")
    return rates


def _serve_target(out: Output, settings: BenchSettings, region_bytes: int,
                  engines: tuple[str, ...], transports: tuple[str, ...], token: str | None,
                  serve_for_s: float | None, *, nics: tuple[str, ...] = (),
                  gid_index: int | None = None, metrics_port: int | None = None) -> None:
    advertise = tuple(a.strip() for a in (settings.advertise or "").split(",") if a.strip())
    spec = TargetSpec(region_bytes=region_bytes, location=settings.remote_location,
                      listen=settings.listen, metadata=settings.metadata,
                      segment=settings.segment, token=token, advertise=advertise,
                      nics=nics, gid_index=gid_index, metrics_port=metrics_port)
    stop = threading.Event()
    with TargetSet(spec, engines, transports) as targets:
        info = targets.info
        if info is None:  # pragma: no cover - start() sets it
            raise UsageError("target did not start", "rerun with -v")
        command = initiator_command(settings, info.peer)
        if out.json_mode:
            out.emit_json("bench.target", {
                "metadata_url": info.metadata_url, "segment": info.segment,
                "address": info.address, "peer": info.peer, "engines": list(info.engines),
                "foreign": [{"engine": t.engine, "transport": t.transport, "used": t.used,
                             "host": t.host, "session": t.session or None,
                             "agent": t.agent or None} for t in info.foreign],
                "skipped": [dataclasses.asdict(s) for s in info.skipped],
                "initiator": command, "metrics": info.metrics})
        if info.address is not None:
            out.info(f"Serving segment {info.segment} ({format_size(region_bytes)}) at "
                     f"{info.address}; metadata {info.metadata_url}")
        for t in info.foreign:
            out.info(f"Serving {t.engine} over {t.transport} ({t.used}, "
                     f"{format_size(t.region_bytes)}) at {t.session or t.host}; "
                     f"metadata {info.metadata_url}")
        for skip in info.skipped:
            what = skip.engine + (f" over {skip.transport}" if skip.transport else "")
            out.info(f"Not serving {what}: {skip.reason}")
        if info.metrics is not None:
            out.info(f"metrics on {info.metrics}")
        out.info(f"On the initiator: {command}")
        try:
            stop.wait(serve_for_s)
        except KeyboardInterrupt:
            out.info("Stopping target.")


def initiator_command(settings: BenchSettings, peer: str) -> str:
    """The initiator command that fits a target started with ``settings``: the same sweep
    shape (block sizes, batch sizes, threads or model pages), so its segment is big enough."""
    words = ["kvctl", "bench", "transfer", "--role", "initiator", "--peer", peer]
    if settings.metadata:
        words += ["--metadata", settings.metadata]
    if settings.model:
        words += ["--model", settings.model, "--page-tokens", str(settings.page_tokens)]
    else:
        words += ["--block-size", settings.block_size]
    words += ["--batch-size", settings.batch_size]
    if settings.threads != 1:
        words += ["--threads", str(settings.threads)]
    if settings.engine != ("kvctl",):
        words += [w for e in settings.engine for w in ("--engine", e)]
    return " ".join(shlex.quote(w) for w in words)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _verdict(report: BenchReport) -> dict[str, Any]:
    """``ok`` and one check per row: failed when it missed an ``--expect-*`` or had failed
    requests (``verdict.ok`` is schema 1's place for ``ok``, kept)."""
    missed: dict[str, list[str]] = {}
    for s in report.shortfalls:
        missed.setdefault(s.label, []).append(s.reason)
    checks = [check_entry(label, "fail" if label in missed else "pass",
                          detail="; ".join(missed.get(label, [])))
              for label in dict.fromkeys(row.label() for row in report.rows)]
    return {"ok": report.ok, "checks": checks}


def _line_cell(row: ResultRow) -> str:
    """``87%``; ``131% !`` when the row beat its line rate (the baseline is invalid)."""
    if row.line_rate_fraction is None:
        return "-"
    return f"{row.line_rate_fraction * 100:.0f}%" + (" !" if row.line_rate_valid is False
                                                     else "")


def _render(out: Output, report: BenchReport) -> None:
    rows = report.rows
    several = len({r.engine for r in rows}) > 1
    batches = sorted({r.batch_size for r in rows})
    verified = any(r.verified is not None for r in rows)
    title = "kvctl bench transfer: GB/s = 10^9 B/s, batch latency ms, request latency us"
    if len(batches) == 1:
        title += f", batch {batches[0]}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
                  pad_edge=False)
    right = {"justify": "right"}
    columns: list[tuple[str, dict[str, Any]]] = []
    if several:
        columns.append(("engine", {}))
    columns += [("op", {}), ("path", {}), ("block", right)]
    if len(batches) > 1:
        columns.append(("batch", right))
    columns += [("GB/s", right), ("Gbit/s", right), ("req/s", right), ("p50", right),
                ("p99", right), ("req p50", right), ("line", right), ("err", right)]
    if verified:
        columns.append(("verify", {}))
    if several:
        columns.append((f"vs {report.engines[0]}", right))
    for name, kw in columns:
        table.add_column(name, **kw)
    for r in rows:
        cells = [r.engine] if several else []
        cells += [r.op, r.transport, format_size(r.block_size_bytes)]
        if len(batches) > 1:
            cells.append(str(r.batch_size))
        cells += [
            _fmt(r.throughput_gbytes_per_s, ".3f"), _fmt(r.throughput_gbits_per_s, ".2f"),
            _fmt(r.requests_per_s, ",.0f"),
            _fmt(r.batch_latency_p50_us / 1000, ".2f"), _fmt(r.batch_latency_p99_us / 1000, ".2f"),
            _fmt(r.request_latency_p50_us, ",.0f"),
            _line_cell(r),
            str(r.errors),
        ]
        if verified:
            cells.append("ok" if r.verified else "-")
        if several:
            cells.append(_fmt(r.ratio_vs_baseline, ".2f"))
        table.add_row(*cells)
    if out.console.is_terminal:
        out.print(table)
    elif not out.json_mode:
        # Piped or captured: a results table is read whole, never squeezed to 80 columns.
        Console(file=sys.stdout, width=160, highlight=False).print(table)
    for engine, transport, path in sorted({(r.engine, r.transport, r.path) for r in rows}):
        out.print(f"[dim]path {engine} {transport}: {path}[/dim]")
    rates = sorted({(r.line_rate_source, r.line_rate_gbytes_per_s) for r in rows
                    if r.line_rate_source is not None and r.line_rate_gbytes_per_s is not None})
    for source, gbps in rates:
        out.print(f"[dim]line rate {source}: {gbps:.2f} GB/s ({gbps * 8:.1f} Gbit/s)[/dim]")
    if any(r.line_rate_valid is False for r in rows):
        out.print("[yellow]! baseline below measured: baseline invalid (the row beat the line "
                  "rate measured with its shape, twice); no line-rate verdict for it[/yellow]")
    if report.sweep.sizing is not None:
        s = report.sweep.sizing
        out.print(f"Model {s.model}: {s.kv_bytes_per_token:,} KV bytes/token, "
                  f"{s.tokens_per_block} tokens per block ({format_size(s.block_size_bytes)})")
