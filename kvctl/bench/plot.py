"""``--plot FILE.png``: throughput and p99 batch latency against block size.

matplotlib is the optional ``plot`` extra and is imported only here, only when asked for.
One line per (engine, op, transport, batch size); x is the block size on a log2 axis. Read
and write of one (engine, transport, batch) share a colour family (read dark and solid,
write light and dashed); the line rate each row was judged against is a dotted reference
line in that family, and a row above its line rate (baseline invalid) is crossed in red.
Latency is in milliseconds, as in the table.
"""

from __future__ import annotations

import importlib
import io
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


#: Colour families, one per (engine, transport, batch): (read, write, line rate) shades.
FAMILIES = (
    ("#1f4e9c", "#6fa8dc", "#0b2a5c"),  # blues
    ("#b45309", "#f6ad55", "#6b2f04"),  # oranges
    ("#2f7d32", "#8bc48a", "#174a19"),  # greens
    ("#6b3fa0", "#b79ad8", "#3b1f5e"),  # purples
    ("#8c2d2d", "#e08a8a", "#4f1414"),  # reds
    ("#555555", "#aaaaaa", "#222222"),  # greys
)
#: Colour of the cross over a row whose baseline is invalid.
INVALID_COLOR = "#e00000"


def series_color(family: int, op: str) -> str:
    """The colour of ``op``'s line in colour family ``family`` (read dark, write light)."""
    read, write, _ = FAMILIES[family % len(FAMILIES)]
    return read if op == "read" else write


def plot_png(rows: Sequence[ResultRow], *, title: str = "kvctl bench transfer") -> bytes:
    """The plot of ``rows`` as PNG bytes (see :func:`plot_rows`).

    Raises:
        UnavailableError: matplotlib is missing.
        UsageError: no rows.
    """
    if not rows:
        raise UsageError("nothing to plot: no configuration ran", "check the skipped engines")
    plt = _pyplot()
    groups = sorted({(r.engine, r.transport, r.batch_size) for r in rows})
    family = {g: i for i, g in enumerate(groups)}
    engines = {g[0] for g in groups}
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.8))
    sizes = sorted({r.block_size_bytes for r in rows})
    invalid_shown = False
    for group in groups:
        engine, transport, batch = group
        mine = [r for r in rows if (r.engine, r.transport, r.batch_size) == group]
        for op in ("read", "write"):
            points = sorted((r for r in mine if r.op == op), key=lambda r: r.block_size_bytes)
            if not points:
                continue
            xs = [r.block_size_bytes for r in points]
            style = {"color": series_color(family[group], op),
                     "marker": "o" if op == "read" else "s",
                     "linestyle": "-" if op == "read" else "--",
                     "label": f"{engine} {op} {transport} x{batch}"}
            ax_tp.plot(xs, [r.throughput_gbytes_per_s for r in points], **style)
            ax_lat.plot(xs, [r.batch_latency_p99_us / 1000 for r in points], **style)
            bad = [r for r in points if r.line_rate_valid is False]
            if bad:
                ax_tp.scatter([r.block_size_bytes for r in bad],
                              [r.throughput_gbytes_per_s for r in bad], marker="x", s=90,
                              linewidths=2.2, color=INVALID_COLOR, zorder=5,
                              label=None if invalid_shown else
                              "above its line rate: baseline invalid")
                invalid_shown = True
        # read and write of a size share a baseline; a re-measured one is the higher, and
        # the one in force at the end
        ceiling: dict[int, float] = {}
        for r in mine:
            if r.line_rate_gbytes_per_s is not None:
                ceiling[r.block_size_bytes] = max(ceiling.get(r.block_size_bytes, 0.0),
                                                  r.line_rate_gbytes_per_s)
        line = sorted(ceiling.items())
        if line:
            ax_tp.plot([x for x, _ in line], [y for _, y in line], linestyle=":",
                       linewidth=1.8, marker="_", markersize=12,
                       color=FAMILIES[family[group] % len(FAMILIES)][2],
                       label=f"line rate {transport} x{batch}"
                       + (f" ({engine})" if len(engines) > 1 else ""))
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=30)
        ax.minorticks_off()
        ax.set_xlabel("block size")
        ax.grid(visible=True, alpha=0.3)
    ax_tp.set_ylabel("throughput (GB/s = 10^9 bytes/s)")
    ax_lat.set_ylabel("p99 batch latency (ms)")
    ax_lat.set_yscale("log")
    ax_tp.legend(fontsize="small")
    ax_lat.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    out = io.BytesIO()
    try:
        fig.savefig(out, format="png", dpi=110)
    finally:
        plt.close(fig)
    return out.getvalue()


def plot_rows(rows: Sequence[ResultRow], path: Path, *, title: str = "kvctl bench transfer"
              ) -> Path:
    """Draw throughput (GB/s, with each row's line rate) and p99 batch latency (ms) against
    block size into the PNG file ``path``.

    Raises:
        UnavailableError: matplotlib is missing.
        UsageError: no rows, or the file cannot be written.
    """
    data = plot_png(rows, title=title)
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise UsageError(f"cannot write plot {path}: {exc.strerror or exc}",
                         "give --plot a writable path ending in .png") from exc
    return path
