"""``kvctl plan``: planners (``plan readback``: when reading KV back beats recomputing it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options, renamed_flag
from kvctl.config import redacted
from kvctl.output import Output
from kvctl.plan.readback import PlanSettings, ReadbackPlan, Winner, plan_readback
from kvctl.probe.nvml import PynvmlBackend

app = typer.Typer(help="Planners: back-of-the-envelope answers.\n\n"
                  "Example: kvctl plan readback --model llama-3-70b --prefill-tps 5000 "
                  "--read-gbytes-per-s 20", no_args_is_help=True)


@app.command("readback")
def readback(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(
        help="Built-in model name (case-insensitive, e.g. llama-3-70b) or a config.json.",
        show_default=False)] = None,
    params: Annotated[int | None, typer.Option(
        help="Parameters used per token (overrides the model's; MoE: activated).",
        show_default=False)] = None,
    prefill_tps: Annotated[float | None, typer.Option(
        help="Prefill throughput, tokens/s.", show_default=False)] = None,
    gpu_tflops: Annotated[float | None, typer.Option(
        help="GPU peak TFLOP/s (instead of --prefill-tps): prefill ~= 2 x params FLOPs/token.",
        show_default=False)] = None,
    gpu: Annotated[str | None, typer.Option(
        help="GPU model whose published dense BF16 peak to use (e.g. 'H100 SXM', L40S). "
             "Without any prefill rate: the GPU NVML reports.", show_default=False)] = None,
    gpus: Annotated[int | None, typer.Option(
        help="GPUs one prefill runs on (tensor parallelism) for a TFLOP/s rate. (default: 1)")
    ] = None,
    nvml: Annotated[bool | None, typer.Option(
        "--nvml/--no-nvml", help="Ask NVML for this host's GPU (model and memory); "
        "--no-nvml when planning for another host. (default: --nvml)", show_default=False)
    ] = None,
    efficiency: Annotated[float | None, typer.Option(
        help="Fraction of peak TFLOP/s prefill reaches. (default: 0.5)")] = None,
    read_gbytes_per_s: Annotated[float | None, typer.Option(
        "--read-gbytes-per-s", help="Read-back bandwidth, GB/s (gigabytes: 10^9 bytes per "
        "second).", show_default=False)] = None,
    read_gbps: Annotated[float | None, typer.Option(
        "--read-gbps", hidden=True,
        help="Deprecated name of --read-gbytes-per-s (GB/s).")] = None,
    bench_file: Annotated[Path | None, typer.Option(
        help="Take the bandwidth from a 'kvctl bench transfer --json' result (fastest read "
             "row).", show_default=False)] = None,
    bench_size: Annotated[str | None, typer.Option(
        help="Use the bench rows of this transfer size (e.g. 64KiB).",
        show_default=False)] = None,
    latency_us: Annotated[float | None, typer.Option(
        help="Fixed cost of one read-back (lookup, setup), microseconds. (default: 0)")] = None,
    prefix_tokens: Annotated[str | None, typer.Option(
        help="Prefix lengths to compare, tokens, comma-separated. "
             "(default: 256,1024,4096,16384,65536)")] = None,
    sessions: Annotated[int | None, typer.Option(
        help="Capacity view: sessions to keep (with --context-tokens).",
        show_default=False)] = None,
    context_tokens: Annotated[int | None, typer.Option(
        help="Capacity view: tokens per session.", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Compare recomputing a prefix with reading its KV back, and size the KV on SSD.

    Always: the KV bytes per token and per prefix length, tokens per GiB and TB, and with
    --sessions and --context-tokens, the bytes those contexts' KV take.

    With a prefill rate (--prefill-tps, --gpu-tflops, --gpu, or the GPU NVML reports) and a
    read rate (--read-gbytes-per-s or --bench-file): per prefix length the recompute time,
    read-back time, speedup and which side is faster, then the break-even prefix length
    and bandwidth. A missing rate is named, with how to give it.

    Example: kvctl plan readback --model llama-3-70b --prefill-tps 5000 --read-gbytes-per-s 20
    """
    opts = global_options(ctx)
    read_gbytes_per_s = renamed_flag(opts, "--read-gbps", read_gbps, "--read-gbytes-per-s",
                                     read_gbytes_per_s)
    settings = opts.settings(
        PlanSettings, model=model, params=params, prefill_tps=prefill_tps,
        gpu_tflops=gpu_tflops, gpu=gpu, gpus=gpus, nvml=nvml, efficiency=efficiency,
        read_gbytes_per_s=read_gbytes_per_s, bench_file=bench_file, bench_size=bench_size,
        latency_us=latency_us, prefix_tokens=prefix_tokens, sessions=sessions,
        context_tokens=context_tokens,
    )
    out = opts.output(json_mode=json_out)
    backend = PynvmlBackend() if settings.nvml else None
    try:
        plan = plan_readback(settings, nvml=backend)
    finally:
        if backend is not None:
            backend.close()
    if json_out:
        out.emit_json("plan.readback", {"settings": redacted(settings), **vars(plan)})
        return
    _render(out, plan)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f}"


def _render(out: Output, plan: ReadbackPlan) -> None:
    params = "" if plan.active_params is None else f", {plan.active_params / 1e9:.1f}B params"
    size = plan.sizing
    out.print(
        f"Model {plan.model}: {plan.kv_bytes_per_token:,} bytes "
        f"({plan.kv_bytes_per_token / 1024:g} KiB) of KV per token{params}"
    )
    gpu_mem = ""
    if size.gpu_memory_bytes is not None and size.tokens_per_gpu_memory is not None:
        gpu_mem = (f"; GPU 0's {size.gpu_memory_bytes / 2**30:,.1f} GiB would hold at most "
                   f"{size.tokens_per_gpu_memory:,} tokens (before weights)")
    out.print(f"KV sizing: {size.tokens_per_gib:,} tokens per GiB (2^30 B), "
              f"{size.tokens_per_tb:,} tokens per TB (10^12 B){gpu_mem}")
    if plan.prefill_tokens_per_s is None:
        out.print(f"Prefill: unknown ({plan.prefill_source})")
    else:
        out.print(f"Prefill: {plan.prefill_tokens_per_s:,.0f} tokens/s "
                  f"(from {plan.prefill_source})")
    if plan.read_gbytes_per_s is None:
        out.print("Read back: unknown (no --read-gbytes-per-s or --bench-file)")
    else:
        out.print(
            f"Read back: {plan.read_gbytes_per_s:g} GB/s (from {plan.read_source}), fixed cost "
            f"{plan.latency_us:g} us per read-back"
        )
    table = Table(title="Recompute or read back?" if plan.break_even else "KV per prefix")
    for name in ("prefix tokens", "KV MiB", "recompute ms", "read back ms", "speedup",
                 "faster"):
        table.add_column(name, justify="right" if name != "faster" else "left")
    for case in plan.cases:
        faster = {
            Winner.READ_BACK: "[green]read back[/green]",
            Winner.RECOMPUTE: "[yellow]recompute[/yellow]",
            Winner.TIE: "tie",
            None: "-",
        }[case.winner]
        speedup = "-" if case.speedup is None else f"{case.speedup:.2f}x"
        table.add_row(f"{case.prefix_tokens:,}", f"{case.kv_bytes / 2**20:,.1f}",
                      _ms(case.recompute_s), _ms(case.readback_s), speedup, faster)
    out.print(table)
    if plan.break_even is not None:
        out.print(f"Break-even: {plan.break_even.summary}.")
    elif plan.break_even_gbytes_per_s is not None:
        out.print(f"Break-even: reading back wins for long prefixes above "
                  f"{plan.break_even_gbytes_per_s:.3g} GB/s (KV bytes per token x prefill rate).")
    if plan.capacity is not None:
        cap = plan.capacity
        out.print(
            f"SSD capacity: {cap.sessions:,} sessions x {cap.context_tokens:,} tokens = "
            f"{cap.tokens:,} tokens -> {cap.kv_bytes:,} bytes = {cap.gb:,.1f} GB (decimal, "
            f"10^9 B) = {cap.gib:,.1f} GiB (binary, 2^30 B)"
        )
    if plan.gpu is not None:
        out.print(f"GPU peak {plan.gpu.tflops:g} TFLOP/s ({plan.gpu.name}): {plan.gpu.source}")
    for assumption in plan.assumptions:
        out.print(f"Assumes {assumption}.")
    for missing in plan.missing:
        out.print(f"To compare, give {missing}.")
