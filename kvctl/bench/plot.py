"""``--plot FILE.png``: throughput and p99 batch latency against block size.

matplotlib is the optional ``plot`` extra and is imported only here, only when asked for.
One line per (engine, op, transport, batch size); x is the block size on a log2 axis.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvctl.bench.result import ResultRow
from kvctl.errors import UnavailableError, UsageError
from kvctl.units import format_size

PLOT_HINT = "pip install 'kvctl[plot]' (or pip install matplotlib)"


def require_matplotlib() -> None:
    """Fail early, before a long run, when matplotlib is missing.

    Raises:
        UnavailableError: matplotlib is not installed (the hint says how to install it).
    """
    _matplotlib()


def _matplotlib() -> Any:
    try:
        return importlib.import_module("matplotlib")
    except ImportError as exc:
        raise UnavailableError(f"--plot needs matplotlib, which is not installed ({exc})",
                               PLOT_HINT) from exc


def _pyplot() -> Any:
    matplotlib = _matplotlib()
    matplotlib.use("Agg")  # files only: never open a window
    return importlib.import_module("matplotlib.pyplot")


def plot_rows(rows: Sequence[ResultRow], path: Path, *, title: str = "kvctl bench transfer"
              ) -> Path:
    """Draw throughput (GB/s) and p99 batch latency (us) against block size into ``path``.

    Raises:
        UnavailableError: matplotlib is missing.
        UsageError: no rows, or the file cannot be written.
    """
    if not rows:
        raise UsageError("nothing to plot: no configuration ran", "check the skipped engines")
    plt = _pyplot()
    series: dict[tuple[str, str, str, int], list[ResultRow]] = {}
    for row in rows:
        series.setdefault((row.engine, row.op, row.transport, row.batch_size), []).append(row)
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r.block_size_bytes for r in rows})
    for (engine, op, transport, batch), points in sorted(series.items()):
        points.sort(key=lambda r: r.block_size_bytes)
        xs = [r.block_size_bytes for r in points]
        label = f"{engine} {op} {transport} x{batch}"
        ax_tp.plot(xs, [r.throughput_gbytes_per_s for r in points], marker="o", label=label)
        ax_lat.plot(xs, [r.batch_latency_p99_us for r in points], marker="o", label=label)
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=30)
        ax.set_xlabel("block size")
        ax.grid(visible=True, alpha=0.3)
    ax_tp.set_ylabel("throughput (GB/s, decimal)")
    ax_lat.set_ylabel("p99 batch latency (us)")
    ax_lat.set_yscale("log")
    ax_tp.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write plot {path}: {exc.strerror or exc}",
                         "give --plot a writable path ending in .png") from exc
    finally:
        plt.close(fig)
    return path
