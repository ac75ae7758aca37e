"""``kvctl sim``: simulators (``sim pool``: what a shared KV pool saves; ``sim trace``: the
same on a recorded trace)."""

from __future__ import annotations

import decimal
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options, renamed_flag
from kvctl.config import CommonSettings, redacted
from kvctl.errors import UsageError
from kvctl.output import Output
from kvctl.sim.plot import check_trace_plot_path, plot_recompute, plot_trace
from kvctl.sim.replay import CellResult
from kvctl.sim.run import PoolReport, simulate_pool
from kvctl.sim.settings import SimSettings
from kvctl.sim.store_pool import StorePoolRun, StoreRunSummary
from kvctl.sim.trace import (
    UNLIMITED,
    TraceReplay,
    TraceRouting,
    Unlimited,
    grid,
    replay_trace,
)
from kvctl.sim.trace_cost import TraceCost, apply_cost, cost_model
from kvctl.store.embedded import resolve_master
from kvctl.store.settings import StoreSettings
from kvctl.wording import plural

app = typer.Typer(help="Simulators: what a shared KV pool saves.\n\n"
                  "'sim pool' replays a synthetic chat workload, 'sim trace' a recorded "
                  "trace.\n\n"
                  "Example: kvctl sim pool --plot pool.png", no_args_is_help=True)

_W = "Workload"
_C = "Cluster"
_T = "Time view"
_S = "Live store"


@app.command("pool")
def pool(
    ctx: typer.Context,
    sessions: Annotated[int | None, typer.Option(help="Chat sessions. (default: 300)",
                                                 rich_help_panel=_W)] = None,
    system_prompts: Annotated[int | None, typer.Option(
        help="Distinct system prompts. (default: 3)", rich_help_panel=_W)] = None,
    system_prompt_tokens: Annotated[int | None, typer.Option(
        help="Tokens per system prompt. (default: 512)", rich_help_panel=_W)] = None,
    min_turns: Annotated[int | None, typer.Option(
        help="Fewest turns per session. (default: 2)", rich_help_panel=_W)] = None,
    max_turns: Annotated[int | None, typer.Option(
        help="Most turns per session. (default: 6)", rich_help_panel=_W)] = None,
    user_tokens: Annotated[int | None, typer.Option(
        help="Tokens per user message. (default: 128)", rich_help_panel=_W)] = None,
    answer_tokens: Annotated[int | None, typer.Option(
        help="Tokens per answer. (default: 256)", rich_help_panel=_W)] = None,
    answer_kv: Annotated[str | None, typer.Option(
        help="The answer's KV: 'recomputed' (decode KV never cached, next turn prefills it) "
             "or 'cached'. (default: recomputed)", rich_help_panel=_W)] = None,
    seed: Annotated[int | None, typer.Option(
        help="RNG seed (tokens, sessions, arrivals, routing). (default: 0)",
        rich_help_panel=_W)] = None,
    instances: Annotated[int | None, typer.Option(
        help="Inference instances. (default: 4)", rich_help_panel=_C)] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Tokens per KV block. (default: 16)", rich_help_panel=_C)] = None,
    local_blocks: Annotated[str | None, typer.Option(
        help="Local prefix-cache capacities per instance to compare, blocks, comma-separated. "
             "(default: 8000,2000)", rich_help_panel=_C)] = None,
    pool_blocks: Annotated[int | None, typer.Option(
        help="Shared pool capacity, blocks; not used with --store. (default: 400000)",
        rich_help_panel=_C)] = None,
    store: Annotated[str | None, typer.Option(
        "--store", show_default=False, rich_help_panel=_S,
        help="Replay the pool against a running kvctl store: master HOST:PORT ('' = the "
             "local embedded store). Its capacity and LRU decide what the pool keeps.")] = None,
    keep: Annotated[bool, typer.Option(
        "--keep", rich_help_panel=_S,
        help="With --store: leave the run's keys (kvctl-sim/<run-id>/...) in the store.")
    ] = False,
    model: Annotated[str | None, typer.Option(
        help="Model name (e.g. llama-3-70b) or config.json, for KV bytes per token.",
        rich_help_panel=_T)] = None,
    prefill_tps: Annotated[float | None, typer.Option(
        help="Prefill throughput per instance, tokens/s.", rich_help_panel=_T)] = None,
    pool_gbytes_per_s: Annotated[float | None, typer.Option(
        "--pool-gbytes-per-s", help="Pool read-back bandwidth, GB/s (gigabytes: 10^9 bytes "
        "per second).", rich_help_panel=_T)] = None,
    pool_gbps: Annotated[float | None, typer.Option(
        "--pool-gbps", hidden=True,
        help="Deprecated name of --pool-gbytes-per-s (GB/s).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write a PNG of recompute % against local capacity (needs matplotlib, the "
             "plot extra).",
        show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay a multi-turn chat workload with and without a shared KV pool.

    N instances each keep a local LRU prefix cache; turns go to a random instance, or
    cache-aware (a session always to the same one); a shared pool keeps what they compute.

    Reports the share of prefill tokens recomputed per routing x pool x local capacity,
    and the floor no cache can beat. Defaults are the reference workload.

    With --store ADDR the pool cells run against a live kvctl store instead of in memory:
    each block is a 16-byte object under kvctl-sim/<run-id>/, removed afterwards.

    Example: kvctl sim pool --local-blocks 500,1000,2000,4000,8000 --plot pool.png

    Example: kvctl sim pool --sessions 50 --store 127.0.0.1:50051
    """
    opts = global_options(ctx)
    settings = opts.settings(
        SimSettings, sessions=sessions, system_prompts=system_prompts,
        system_prompt_tokens=system_prompt_tokens, min_turns=min_turns, max_turns=max_turns,
        user_tokens=user_tokens, answer_tokens=answer_tokens, answer_kv=answer_kv, seed=seed,
        instances=instances, block_size=block_size, local_blocks=local_blocks,
        pool_blocks=pool_blocks, model=model, prefill_tps=prefill_tps,
        pool_gbytes_per_s=renamed_flag(opts, "--pool-gbps", pool_gbps, "--pool-gbytes-per-s",
                                       pool_gbytes_per_s),
    )
    if keep and store is None:
        raise UsageError("--keep needs --store", "add --store HOST:PORT, or drop --keep")
    out = opts.output(json_mode=json_out)
    total = 4 * len(settings.local_blocks)
    summary: StoreRunSummary | None = None
    with out.progress("replaying", total=total) as bar:
        task = bar.task_ids[0]

        def advance(_cell: CellResult) -> None:
            bar.advance(task)

        if store is None:
            report = simulate_pool(settings, on_cell=advance)
        else:
            address = resolve_master(opts.settings(StoreSettings, master=store or None))
            token = opts.settings(CommonSettings).token
            with StorePoolRun(address, token=token, keep=keep) as run:
                report = simulate_pool(settings, pool_factory=run.factory, on_cell=advance)
            summary = run.close()
    if plot is not None:
        plot_recompute(report.cells, report.floor, plot,
                       title=f"{settings.sessions} sessions, {settings.instances} instances")
        out.info(f"wrote {plot}")
    if json_out:
        payload = {"settings": redacted(settings), **vars(report), "store": summary}
        if plot is not None:
            payload["plot"] = str(plot)
        out.emit_json("sim.pool", payload)
        return
    _render(out, report, summary)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _store_note(s: StoreRunSummary) -> str:
    cleanup = (f"kept {s.keys_left:,} keys under {s.prefix}" if s.kept else
               "cleanup failed: remove them with 'kvctl store ls' and 'kvctl store rm'"
               if s.keys_left is None else f"removed {s.keys_removed:,}, {s.keys_left} left")
    misses = (f"; {s.read_misses:,} blocks vanished between exists and read (counted as hits)"
              if s.read_misses else "")
    return (f"Store {s.store}: {s.cells} pool cells under {s.prefix}, {s.keys_written:,} "
            f"{s.value_bytes}-byte block objects ({cleanup}); {s.exists_calls:,} exists, "
            f"{s.get_calls:,} get, {s.put_calls:,} put round trips, {s.store_seconds:.1f} s in "
            f"store calls{misses}.")


def _render(out: Output, report: PoolReport, store: StoreRunSummary | None = None) -> None:
    w = report.workload
    spec = w.spec
    pool = f"pool {w.pool_blocks:,} blocks ({w.pool_backend})"
    if store is not None:
        pool = (f"pool: the kvctl store at {store.store} (its capacity, about "
                f"{store.capacity_blocks:,} blocks, and its LRU decide)")
    out.print(
        f"Workload: {spec.sessions} sessions, {w.turns} turns, {w.prefill_tokens:,} prefill "
        f"tokens; {w.instances} instances, {spec.block_size}-token blocks, {pool}, "
        f"answer KV {w.answer_kv}, seed {spec.seed}"
    )
    capacities = list(dict.fromkeys(c.local_blocks for c in report.cells))
    rows: dict[str, dict[int, CellResult]] = {}
    for cell in report.cells:
        rows.setdefault(cell.label, {})[cell.local_blocks] = cell
    title = "Prefill tokens recomputed (lower is better), by local cache per instance (blocks)"
    table = Table(title=title)
    if len(capacities) <= 3:  # the published layout: one row per routing x pool
        table.add_column("routing", no_wrap=True)
        for capacity in capacities:
            table.add_column(f"{capacity:,}", justify="right", no_wrap=True, min_width=6)
        for label, by_capacity in rows.items():
            table.add_row(label, *(_pct(by_capacity[c].recompute_fraction) for c in capacities))
    else:  # many capacities: one row per capacity, so the table stays narrow
        table.add_column("local blocks", justify="right", no_wrap=True)
        for label in rows:
            table.add_column(label, justify="right")
        for capacity in capacities:
            table.add_row(f"{capacity:,}", *(_pct(by_capacity[capacity].recompute_fraction)
                                             for by_capacity in rows.values()))
    out.print(table)
    out.print(report.floor_explanation)
    if store is not None:
        out.print(_store_note(store))
    view = report.time_view
    if view is None:
        return
    times = Table(
        title=(
            f"Prefill seconds, summed over the workload ({view.model}, "
            f"{view.kv_bytes_per_token / 1024:g} KiB/token, {view.prefill_tokens_per_s:g} "
            f"tokens/s, pool reads at {view.pool_read_gbytes_per_s:g} GB/s)"
        )
    )
    times.add_column("routing", no_wrap=True)
    for name in ("local", "compute", "pool read", "total", "saved", "pool saves"):
        times.add_column(name, justify="right")
    for row in view.rows:
        label = f"{row.routing.value}{' + shared pool' if row.pool_blocks else ''}"
        pool_saved = "-" if row.saved_vs_no_pool_s is None else f"{row.saved_vs_no_pool_s:.1f}"
        times.add_row(label, f"{row.local_blocks:,}", f"{row.recompute_s:.1f}",
                      f"{row.pool_read_s:.1f}", f"{row.prefill_s:.1f}",
                      f"{row.saved_vs_no_cache_s:.1f}", pool_saved)
    out.print(times)
    out.print(
        "compute: recomputed tokens; pool read: pool hits at the read bandwidth, serially (no "
        "overlap with compute); local hits are free. saved: against recomputing every prompt; "
        "pool saves: against the same routing and local cache without the pool. See 'kvctl "
        "plan readback' for when a read-back beats recompute."
    )


_TR = "Trace"
_TC = "Cluster"
_TV = "Cost view"
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


#: Largest token count a flag takes: far past any cache, small enough to stay exact.
_MAX_TOKENS = 10**30


def _tokens(text: str, flag: str) -> int:
    """``3000000``, ``3M``, ``500k``, ``1.5M``, ``1e6`` (decimal units: tokens, not bytes),
    exactly: ``3000000000000000001`` is that many, not the nearest float."""
    raw = text.strip()
    unit = raw[-1:].lower() if raw[-1:].isalpha() and raw[-1:].lower() in "kmg" else ""
    number = raw[:-1] if unit else raw
    try:
        value = decimal.Decimal(number)
        if value.is_finite() and value.adjusted() <= 30:  # else refused below, not overflowed
            with decimal.localcontext(prec=80):  # exact: no rounding to 28 digits
                value *= _TOKEN_UNITS[unit]
    except decimal.InvalidOperation:  # not a number, or a signalling NaN
        raise UsageError(f"{flag} {text!r} is not a token count",
                         f"give whole tokens, e.g. {flag} 3000000 or 3M (decimal: 10^6)"
                         ) from None
    if not value.is_finite() or value != value.to_integral_value() or value < 0:
        raise UsageError(f"{flag} {text!r} is not a whole number of tokens 0 or more",
                         f"give e.g. {flag} 3000000")
    if value > _MAX_TOKENS:
        raise UsageError(f"{flag} {text!r} is more than {_MAX_TOKENS:,} tokens",
                         f"give e.g. {flag} 1G (10^9 tokens)")
    return int(value)


def _token_list(text: str, flag: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise UsageError(f"{flag} {text!r} has an empty entry", "remove the stray comma")
    return [_tokens(p, flag) for p in parts]


def _pool(text: str | None) -> int | Unlimited | None:
    if text is None:
        return None
    if text.strip().lower() == UNLIMITED:
        return UNLIMITED
    return _tokens(text, "--pool-tokens")


def _routings(text: str) -> list[TraceRouting]:
    known = [r.value for r in TraceRouting if r is not TraceRouting.SINGLE]
    out: list[TraceRouting] = []
    for part in (p.strip() for p in text.split(",")):
        if part not in known:
            raise UsageError(f"--routing {part!r} is not known",
                             f"give one or more of {', '.join(known)}, comma-separated")
        out.append(TraceRouting(part))
    return out


@app.command("trace")
def trace(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(
        help="The trace: Mooncake JSONL (one request a line), or a 'verify-keys watch "
        "--record' file with --format kv-events; .gz too.", show_default=False)],
    trace_fmt: Annotated[str, typer.Option(
        "--format", help="Trace format: mooncake (Mooncake JSONL) or kv-events (a "
        "'verify-keys watch --record' file); an unknown name lists the known ones.",
        rich_help_panel=_TR)] = "mooncake",
    block_tokens: Annotated[int | None, typer.Option(
        help="Tokens per block id. (default: the format's: 512 for Mooncake, the records' "
        "block_size for kv-events)",
        rich_help_panel=_TR, show_default=False)] = None,
    capacity_tokens: Annotated[str, typer.Option(
        help="Local LRU prefix cache per instance, tokens, comma-separated to compare "
             "(3M = 3,000,000; 0 = none).", rich_help_panel=_TC)] = "3000000",
    instances: Annotated[int, typer.Option(
        help="Instances; above 1 adds a cluster per routing (and pool) to the single-"
             "instance rows.", rich_help_panel=_TC)] = 1,
    routing: Annotated[str, typer.Option(
        help="With --instances K: random, round-robin, prefix-aware, comma-separated.",
        rich_help_panel=_TC)] = "random",
    pool_tokens: Annotated[str | None, typer.Option(
        help="Shared pool behind the instances, tokens, or 'unlimited': adds local + pool "
             "rows.", rich_help_panel=_TC, show_default=False)] = None,
    seed: Annotated[int, typer.Option(help="Seed of random routing.",
                                      rich_help_panel=_TC)] = 0,
    model: Annotated[str | None, typer.Option(
        help="Model name (e.g. llama-3-70b) or config.json: adds GPU-seconds saved and "
             "read-back GB/s.", rich_help_panel=_TV, show_default=False)] = None,
    prefill_tps: Annotated[float | None, typer.Option(
        help="Prefill throughput per instance, tokens/s.", rich_help_panel=_TV,
        show_default=False)] = None,
    gpu: Annotated[str | None, typer.Option(
        help="GPU whose peak rates prefill (as plan readback: e.g. 'H100 SXM').",
        rich_help_panel=_TV, show_default=False)] = None,
    gpu_tflops: Annotated[float | None, typer.Option(
        help="GPU peak dense TFLOP/s instead of --gpu's table entry (as plan readback).",
        rich_help_panel=_TV, show_default=False)] = None,
    gpus: Annotated[int, typer.Option(help="GPUs one prefill runs on (with --gpu).",
                                      rich_help_panel=_TV)] = 1,
    efficiency: Annotated[float, typer.Option(help="Fraction of the GPU's peak prefill "
                                              "reaches (with --gpu).",
                                              rich_help_panel=_TV)] = 0.5,
    nic_gbytes_per_s: Annotated[float | None, typer.Option(
        "--nic-gbytes-per-s", help="Each instance's NIC read rate, GB/s (10^9 bytes/s).",
        rich_help_panel=_TV, show_default=False)] = None,
    bench_file: Annotated[Path | None, typer.Option(
        help="Take the NIC's rate from a 'kvctl bench transfer --json' result.",
        rich_help_panel=_TV, show_default=False)] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write a PNG: hit ratio against capacity with the ideal, and over time (needs "
             "matplotlib, the plot extra).", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay a recorded trace against LRU prefix caches: is a shared pool worth it on it?

    Reports the trace (requests, arrival rate, mean lengths, the ideal prefix hit ratio of
    one unbounded cache, how often block ids recur), then the prefix hit ratio of one
    instance per --capacity-tokens and, with --instances K, of K instances routed by
    --routing, local-only and with a shared --pool-tokens pool. Requests replay in arrival
    order with the rules of 'sim pool' (docs/traffic.md).

    Example: kvctl sim trace conversation_trace.jsonl --capacity-tokens 1M,10M,100M --plot hit.png

    Example: kvctl sim trace t.jsonl --instances 8 --pool-tokens 24M --routing random,prefix-aware

    Example: kvctl sim trace trace.jsonl --model llama-3-70b --gpu 'H100 SXM' --nic-gbytes-per-s 50
    """
    opts = global_options(ctx)
    capacities = _token_list(capacity_tokens, "--capacity-tokens")
    if instances <= 0:
        raise UsageError(f"--instances {instances} is not positive", "give --instances 1 or more")
    routings = _routings(routing)
    configs = grid(capacities, instances=instances, routings=routings,
                   pool_tokens=_pool(pool_tokens))
    # Everything a flag can get wrong is refused before the replay, which can take a minute.
    costs = None
    if model is not None:
        costs = cost_model(model=model, prefill_tps=prefill_tps, gpu=gpu, gpu_tflops=gpu_tflops,
                           gpus=gpus, efficiency=efficiency, nic_gbytes_per_s=nic_gbytes_per_s,
                           bench_file=bench_file)
    elif any(v is not None for v in (prefill_tps, gpu, gpu_tflops, nic_gbytes_per_s,
                                     bench_file)):
        raise UsageError("the cost view needs --model", "add --model NAME (e.g. llama-3-70b)")
    if plot is not None:
        check_trace_plot_path(plot)
    out = opts.output(json_mode=json_out)
    with out.progress("replaying requests") as bar:
        task = bar.task_ids[0]

        def advance(done: int) -> None:
            bar.update(task, completed=done)

        replay = replay_trace(file, configs, format_name=trace_fmt, block_tokens=block_tokens,
                              seed=seed, on_progress=advance)
    cost = None if costs is None else apply_cost(replay, costs)
    if plot is not None:
        plot_trace(replay, plot, title=file.name)
        out.info(f"wrote {plot}")
    if json_out:
        s = replay.summary
        payload = {
            "settings": {"file": str(file), "format": trace_fmt, "block_tokens": s.block_tokens,
                         "capacity_tokens": capacities, "instances": instances,
                         "routing": routings, "pool_tokens": _pool(pool_tokens),
                         "seed": seed},
            "requests": s.requests, "input_tokens_mean": s.input_tokens_mean,
            "output_tokens_mean": s.output_tokens_mean, "ideal_hit_ratio": s.ideal_hit_ratio,
            "trace": s, "results": replay.results, "ideal_timeline": replay.ideal_timeline,
            "cost": cost, "plot": None if plot is None else str(plot),
        }
        out.emit_json("sim.trace", payload)
        return
    _render_trace(out, replay, cost)


def _share(value: float) -> str:
    return f"{100 * value:.1f}%"


def _render_trace(out: Output, replay: TraceReplay, cost: TraceCost | None) -> None:
    s = replay.summary
    out.print(
        f"Trace {s.path} ({s.format}, {s.block_tokens} tokens per id): "
        f"{plural(s.requests, 'request')} over {s.duration_s:,.0f} s "
        f"({s.arrival_rate_per_s:.2f}/s); mean input "
        f"{s.input_tokens_mean:,.0f} tokens, mean output {s.output_tokens_mean:,.0f}; "
        f"ideal prefix hit ratio {_share(s.ideal_hit_ratio)} (one unbounded cache)"
    )
    reuse = Table(title=f"Block ids by uses ({s.distinct_ids:,} distinct ids, "
                        f"{s.block_uses:,} uses)")
    for name in ("used", "ids", "share of ids", "share of uses"):
        reuse.add_column(name, justify="right", overflow="fold")
    for b in s.reuse:
        if b.ids:
            reuse.add_row("once" if b.max_uses == 1 else f"{b.label} times", f"{b.ids:,}",
                          _share(b.id_share), _share(b.use_share))
    out.print(reuse)
    table = Table(title="Prefix hit ratio (higher is better); tokens summed over the trace")
    for name in ("instances x local tokens", "routing", "pool tokens", "hit ratio",
                 "recompute", "read back", "per instance"):
        # fold, never ellipsize: on a narrow terminal a count wraps but stays whole
        table.add_column(name, justify="left" if name == "routing" else "right",
                         overflow="fold")
    for r in replay.results:
        pool = "-" if r.pool_tokens is None else (
            r.pool_tokens if isinstance(r.pool_tokens, str) else f"{r.pool_tokens:,}")
        ratios = [i.hit_ratio for i in r.per_instance]
        per = ("-" if r.instances == 1 else " ".join(f"{100 * x:.0f}" for x in ratios)
               if r.instances <= 8 else f"{100 * min(ratios):.0f}-{100 * max(ratios):.0f}")
        table.add_row(f"{r.instances} x {r.capacity_tokens:,}", r.routing.value, pool,
                      _share(r.hit_ratio), f"{r.recompute_tokens:,}", f"{r.pool_hit_tokens:,}",
                      per)
    out.print(table)
    out.print("hit ratio: prefix hit tokens / input tokens; recompute: input tokens not hit; "
              "read back: pool hits (they cross the NIC); per instance: hit % of each.")
    for r in replay.results:
        idle = [i.index for i in r.per_instance if not i.requests]
        if idle and r.instances > 1:
            why = ("prefix-aware routing follows a prefix every request shares; see "
                   "docs/traffic.md" if r.routing is TraceRouting.PREFIX_AWARE else
                   f"{plural(sum(i.requests for i in r.per_instance), 'request')}, routed "
                   f"{r.routing.value}")
            out.print(f"Note: {r.label} sent no request to {len(idle)} of {r.instances} "
                      f"instances ({why}).")
    if cost is None:
        return
    view = Table(title=(f"Cost view ({cost.model}, {cost.kv_bytes_per_token / 1024:g} KiB/"
                        f"token; prefill: {cost.prefill_source}; NIC: {cost.nic_source})"))
    for name in ("configuration", "GPU-s no cache", "GPU-s saved", "pool GB/s",
                 "busiest NIC"):
        view.add_column(name, justify="left" if name == "configuration" else "right",
                        overflow="fold")
    for row in cost.rows:
        view.add_row(row.label, _opt(row.gpu_seconds_no_cache), _opt(row.gpu_seconds_saved),
                     "-" if row.pool_readback_gbytes_per_s is None
                     else f"{row.pool_readback_gbytes_per_s:.3g}",
                     "-" if row.busiest_nic_share is None else _share(row.busiest_nic_share))
    out.print(view)
    if cost.duration_s <= 0 and any(r.pool_readback_gbytes_per_s is None for r in cost.rows):
        out.print("Note: the trace lasts 0 s (every timestamp equal), so its pool reads have "
                  "no rate: pool GB/s and busiest NIC are '-'.")
    out.print(f"GPU-s: prefill seconds over the trace ({cost.duration_s:,.0f} s long), summed "
              "over instances; pool GB/s: mean read-back rate of the pool hits at the trace's "
              "arrival rate (GB/s = 10^9 bytes/s); busiest NIC: the highest instance's mean "
              "read-back rate against --nic-gbytes-per-s (bursts need more).")


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"
