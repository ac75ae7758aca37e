"""kvctl's transfer engine side by side with Mooncake (and NIXL), plus the raw baselines.

One run, one markdown table (the README's): for each op and block size, GB/s through each
engine over loopback TCP (batch 128, target in a separate process), each engine's ratio to
kvctl, and the raw ceilings measured in the same run (a 4-stream raw TCP loopback stream and
memcpy). Engines that are not installed are listed under the table with the install hint.

    .venv/bin/python benchmarks/bench_transfer_compare.py                # markdown on stdout
    .venv/bin/python benchmarks/bench_transfer_compare.py --out table.md --duration 1
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from pathlib import Path

import psutil

from kvctl.bench.report import BenchReport
from kvctl.bench.session import RunOptions, run_transfer_bench, validate_engines
from kvctl.bench.spec import BenchSettings, build_sweep
from kvctl.units import format_size


def _table(report: BenchReport) -> str:
    engines = [e for e in report.engines if any(r.engine == e for r in report.rows)]
    base = engines[0]
    head = ["op", "block"] + [f"{e} GB/s" for e in engines]
    head += [f"{e} / {base}" for e in engines[1:]]
    head += ["raw TCP loopback GB/s (same shape)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    index = {(r.engine, r.op, r.block_size_bytes): r for r in report.rows}
    for op in (o.value for o in report.sweep.ops):
        for size in report.sweep.block_sizes_bytes:
            cells = [op, format_size(size)]
            got = {e: index.get((e, op, size)) for e in engines}
            cells += [f"{got[e].throughput_gbytes_per_s:.3f}" if got[e] else "-" for e in engines]
            for e in engines[1:]:
                row = got[e]
                cells.append(f"{row.ratio_vs_baseline:.2f}x"
                             if row is not None and row.ratio_vs_baseline else "-")
            line = got[base].line_rate_gbytes_per_s if got[base] else None
            cells.append(f"{line:.2f}" if line else "-")
            lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        f"Batch {report.sweep.batch_sizes[0]}, one initiator thread, "
        f"{report.sweep.duration_s or 0:g} s per configuration, TCP over 127.0.0.1, "
        "target in a separate process; GB/s = 10^9 bytes/s. "
        "Raw TCP loopback: measured in the same run with each row's block and batch size "
        f"(kvctl.bench.linerate). Host: {platform.machine()}, "
        f"{psutil.cpu_count(logical=True)} CPUs, Python {platform.python_version()}.",
    ]
    for skip in report.skipped:
        what = skip.engine + (f" over {skip.transport}" if skip.transport else "")
        notes.append(f"Skipped {what}: {skip.reason}" + (f" ({skip.hint})." if skip.hint else "."))
    return "\n".join(lines + notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", default=None,
                        help="engines, first is the baseline (default: kvctl mooncake nixl)")
    parser.add_argument("--block-size", default="4KiB,64KiB,1MiB,4MiB")
    parser.add_argument("--batch-size", default="128")
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per config")
    parser.add_argument("--op", default="both")
    parser.add_argument("--out", type=Path, default=None, help="write markdown here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    engines = validate_engines(args.engine or ["kvctl", "mooncake", "nixl"])
    sweep = build_sweep(BenchSettings(op=args.op, transport="tcp", block_size=args.block_size,
                                      batch_size=args.batch_size, duration=args.duration))
    report = run_transfer_bench(sweep, RunOptions(engines=engines),
                                on_progress=lambda e: print(f"  {e.engine} {e.label}",
                                                            file=sys.stderr))
    text = _table(report)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
