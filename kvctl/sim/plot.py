"""Plot recompute fraction against local cache capacity (needs the optional ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.sim.replay import CellResult, Floor


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


def plot_recompute(
    cells: Sequence[CellResult], floor: Floor, path: Path, *, title: str = ""
) -> Path:
    """Write a PNG: one line per routing x pool, recompute % against local blocks.

    Raises:
        UnavailableError: matplotlib is not installed.
        UsageError: the file cannot be written.
    """
    fig = _figure()
    lines: dict[str, list[tuple[int, float]]] = {}
    for cell in cells:
        lines.setdefault(cell.label, []).append((cell.local_blocks, 100 * cell.recompute_fraction))
    ax = fig.subplots()
    for label, points in lines.items():
        points.sort()
        pooled = "pool" in label
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label,
                marker="s" if pooled else "o", linestyle="--" if pooled else "-")
    ax.axhline(100 * floor.fraction, color="grey", linestyle="--",
               label=f"floor {100 * floor.fraction:.1f}%")
    ax.set_xlabel("local prefix cache per instance (blocks)")
    ax.set_ylabel("prefill tokens recomputed (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(
            f"cannot write plot {path}: {exc.strerror or exc}", "give a writable --plot path"
        ) from exc
    return path
