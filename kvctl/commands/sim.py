"""``kvctl sim``: simulators (``sim pool``: what a shared KV pool saves)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options, renamed_flag
from kvctl.config import CommonSettings, redacted
from kvctl.errors import UsageError
from kvctl.output import Output
from kvctl.sim.plot import plot_recompute
from kvctl.sim.replay import CellResult
from kvctl.sim.run import PoolReport, simulate_pool
from kvctl.sim.settings import SimSettings
from kvctl.sim.store_pool import StorePoolRun, StoreRunSummary
from kvctl.store.embedded import resolve_master
from kvctl.store.settings import StoreSettings

app = typer.Typer(help="Simulators: what a shared KV pool saves.\n\n"
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
