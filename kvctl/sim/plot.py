"""Plot recompute fraction against local cache capacity (``sim pool``) and prefix hit ratio
against capacity and time (``sim trace``); needs the optional ``plot`` extra."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.sim.replay import CellResult, Floor
from kvctl.sim.trace import TraceReplay, TraceResult


def _figure() -> Any:
    """A matplotlib Figure (no pyplot: no global backend or figure state is touched)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UnavailableError(
            f"unavailable: plotting needs matplotlib ({exc})",
            "install the plot extra: pip install 'kvctl[plot]' (or pip install matplotlib)",
        ) from exc
    return Figure(figsize=(7, 4.5))


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path``.

    Raises:
        UsageError: the file cannot be written.
    """
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(
            f"cannot write plot {path}: {exc.strerror or exc}", "give a writable --plot path"
        ) from exc
    return path


#: Per routing, a colour family: the dark shade without the pool, the light one with it.
_FAMILIES = {"random": ("#1f4e9c", "#5b9bd5"), "cache-aware": ("#a4470b", "#f0a030")}
_OTHER = ("#444444", "#999999")


def series_style(label: str, index: int) -> dict[str, Any]:
    """How series ``label`` (the ``index``-th drawn) looks, so that series lying on top of
    each other (with a pool every routing reaches the floor) all stay visible: routing picks
    the colour family, the pool a lighter shade, a dashed line (dashes of two routings
    interleave) and a hollow marker, and each later series a smaller marker drawn above the
    earlier ones."""
    pooled = "pool" in label
    dark, light = _FAMILIES.get(label.split(" + ", maxsplit=1)[0], _OTHER)
    color = light if pooled else dark
    return {
        "color": color,
        "marker": "o" if label.startswith("random") else "s",
        "markersize": max(4.0, 12.0 - 2.5 * index),
        "markerfacecolor": "none" if pooled else color,
        "markeredgewidth": 2.0 if pooled else 1.0,
        # dashes of two pooled routings interleave where their lines coincide
        "linestyle": (0 if label.startswith("random") else 4, (4, 4)) if pooled else "-",
        "linewidth": 2.4 if pooled else 1.6,
        "zorder": 3 + index,
    }


def plot_recompute(
    cells: Sequence[CellResult], floor: Floor, path: Path, *, title: str = ""
) -> Path:
    """Write a PNG: one line per routing x pool, recompute % against local blocks.

    Every series stays visible where they coincide (see :func:`series_style`); a series
    equal to another at every point says so in the legend, and the floor is a band
    beneath them all.

    Raises:
        UnavailableError: matplotlib is not installed.
        UsageError: the file cannot be written.
    """
    fig = _figure()
    lines: dict[str, list[tuple[int, float]]] = {}
    for cell in cells:
        lines.setdefault(cell.label, []).append((cell.local_blocks, 100 * cell.recompute_fraction))
    for points in lines.values():
        points.sort()
    ax = fig.subplots()
    floor_pct = 100 * floor.fraction
    ax.axhspan(0, floor_pct, color="#e5e5e5", zorder=0)
    ax.axhline(floor_pct, color="#555555", linestyle=":", linewidth=1.2, zorder=1,
               label=f"floor {floor_pct:.1f}% (no cache gets below)")
    drawn: list[str] = []
    for index, (label, points) in enumerate(lines.items()):
        same = [d for d in drawn if lines[d] == points]
        shown = label + (f" (= {same[0]})" if same else "")
        ax.plot([p[0] for p in points], [p[1] for p in points], label=shown,
                **series_style(label, index))
        drawn.append(label)
    sizes = sorted({p[0] for points in lines.values() for p in points})
    if len(sizes) > 1 and sizes[0] > 0 and sizes[-1] / sizes[0] >= 8:
        ax.set_xscale("log", base=2)  # capacities are usually swept by doubling
        ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
        ax.minorticks_off()
    ax.set_xlabel("local prefix cache per instance (blocks)")
    ax.set_ylabel("prefill tokens recomputed (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path)


def check_trace_plot_path(path: Path) -> None:
    """Refuse a ``--plot`` path the trace plot cannot be written to, before the replay.

    matplotlib picks the image format from the name's suffix, and writes ``NAME.png`` for a
    name without one: so the name must end in a format it knows, and not be a directory.

    Raises:
        UnavailableError: matplotlib is not installed.
        UsageError: a directory, a missing parent directory, or a suffix that names no
            image format matplotlib writes.
    """
    formats = _figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if path.is_dir():
        raise UsageError(f"--plot {path} is a directory", "give a file name, e.g. hit.png")
    if suffix not in formats:
        what = f".{suffix} is not an image format matplotlib writes" if suffix else \
            "the name has no image format suffix"
        raise UsageError(
            f"--plot {path}: {what}",
            f"end the name in .png (or one of: {', '.join('.' + f for f in sorted(formats))})",
        )
    if not path.parent.is_dir():
        raise UsageError(f"cannot write plot {path}: no directory {path.parent}",
                         "give a --plot path in an existing directory")


def plot_trace(replay: TraceReplay, path: Path, *, title: str = "") -> Path:
    """Write a PNG of a trace replay: prefix hit ratio against local capacity per token
    (log x), one line per configuration family (instances, routing, pool), with the ideal
    (one unbounded cache) as a dashed line; below it, hit ratio over time per configuration.

    Raises:
        UnavailableError: matplotlib is not installed.
        UsageError: the file cannot be written, or its name is refused by
            :func:`check_trace_plot_path`.
    """
    fig = _figure()
    fig.set_size_inches(7, 8)
    top, bottom = fig.subplots(2, 1)
    families: dict[str, list[TraceResult]] = {}
    for r in replay.results:
        name = f"{r.instances} instance{'s' if r.instances > 1 else ''}"
        if r.routing.value != "single":
            name += f", {r.routing.value}"
        if r.pool_tokens is not None:
            pool = r.pool_tokens if isinstance(r.pool_tokens, str) else f"{r.pool_tokens:,}"
            name += f" + pool {pool}"
        families.setdefault(name, []).append(r)
    ideal = 100 * replay.summary.ideal_hit_ratio
    positive = any(r.capacity_tokens > 0 for r in replay.results)
    colors = [f"C{i % 10}" for i in range(len(families))]
    for index, (name, results) in enumerate(families.items()):
        points = sorted((r.capacity_tokens, 100 * r.hit_ratio) for r in results
                        if r.capacity_tokens > 0 or not positive)
        top.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                 color=colors[index], markersize=max(3.0, 8.0 - index), label=name,
                 zorder=3 + index)
    top.axhline(ideal, color="#555555", linestyle="--", linewidth=1.2,
                label=f"ideal {ideal:.1f}% (one unbounded cache)")
    if positive:
        top.set_xscale("log")
    top.set_xlabel("local prefix cache per instance (tokens)")
    top.set_ylabel("prefix hit ratio (%)")
    top.set_ylim(0, 100)
    top.grid(alpha=0.3)
    top.legend(fontsize="small")
    if title:
        top.set_title(title)
    bottom.plot([p.start_s for p in replay.ideal_timeline],
                [100 * p.hit_ratio for p in replay.ideal_timeline], color="#555555",
                linestyle="--", linewidth=1.2, label="ideal")
    for index, (name, results) in enumerate(families.items()):
        largest = max(results, key=lambda r: r.capacity_tokens)  # one line per family
        bottom.plot([p.start_s for p in largest.timeline],
                    [100 * p.hit_ratio for p in largest.timeline], color=colors[index],
                    linewidth=1.0, label=f"{name}, {largest.capacity_tokens:,} local")
    bottom.set_title("over time (largest local capacity of each)", fontsize="medium")
    bottom.set_xlabel("time since the first request (s)")
    bottom.set_ylabel("prefix hit ratio (%)")
    bottom.set_ylim(0, 100)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize="x-small")
    fig.tight_layout()
    check_trace_plot_path(path)
    return _save(fig, path)
