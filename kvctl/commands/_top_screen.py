"""The terminal side of ``kvctl store top``: a :class:`~kvctl.top.view.TopView` as Rich
renderables, and the live loop (refresh every interval; ``q`` or Ctrl-C quits)."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvctl.output import safe_cell
from kvctl.top.view import TopView
from kvctl.units import format_size

#: Seconds between looks at the keyboard and the stop flag while waiting for a refresh.
KEY_POLL_S = 0.1


def _use(used: int, capacity: int) -> str:
    if capacity <= 0:
        return "-"
    return f"{format_size(used)} / {format_size(capacity)} ({used / capacity:.0%})"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}/s"


def _latency(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


#: Nodes listed in the live view (the most troubled and fullest first); the rest counted.
LIVE_NODES = 16


def _nodes(view: TopView, limit: int | None) -> Table:
    rows = sorted(view.nodes, key=lambda n: (n.state.lower() in ("alive", "ok"),
                                             -(n.dram_used_bytes / (n.dram_capacity_bytes or 1)),
                                             n.name))
    shown = rows if limit is None else rows[:limit]
    more = len(rows) - len(shown)
    table = Table(title=f"nodes ({len(view.nodes)})", title_justify="left",
                  caption=f"{more} more: kvctl store status lists them all" if more else None,
                  caption_justify="left")
    for col in ("node", "state", "DRAM", "SSD", "objects", "endpoint"):
        table.add_column(col)
    for n in shown:
        healthy = n.state.lower() in ("alive", "ok")
        table.add_row(safe_cell(n.name), safe_cell(n.state, style="" if healthy else "bold red"),
                      _use(n.dram_used_bytes, n.dram_capacity_bytes),
                      _use(n.ssd_used_bytes, n.ssd_capacity_bytes),
                      "-" if n.objects is None else f"{n.objects:,}", safe_cell(n.endpoint))
    return table


def render(view: TopView, *, problem: str | None = None, max_nodes: int | None = None
           ) -> Group:
    """One frame: header and problems, tiers, lookups, operations, recent errors, then the
    nodes (at most ``max_nodes``, troubled and fullest first). ``problem``: why this frame
    is stale (the last read failed)."""
    parts: list[Any] = []
    over = (f"rates over {view.interval_s:.1f} s" if view.interval_s > 0
            else "first reading: rates after the next one")
    parts.append(Text.assemble(
        (f"kvctl store top: {view.backend} master {view.master}", "bold"),
        f"  {view.health}  {view.objects:,} objects  {over}  (q quits)"))
    for line in ([problem] if problem else []) + list(view.problems):
        parts.append(Text(f"! {line}", style="bold red"))
    tiers = Table(title="tiers", title_justify="left", expand=False)
    for col in ("tier", "used / capacity", "objects"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for t in view.tiers:
        tiers.add_row(t.tier, _use(t.used_bytes, t.capacity_bytes),
                      "-" if t.objects is None else f"{t.objects:,}")
    parts.append(tiers)
    lk = view.lookups
    if lk is not None:
        ratio = "-" if lk.hit_ratio is None else f"{lk.hit_ratio:.1%}"
        evicted = "" if lk.evicted_per_s is None else f" (evicted {_rate(lk.evicted_per_s)})"
        parts.append(Text(f"lookups: hit {_rate(lk.hits_per_s)}  miss "
                          f"{_rate(lk.misses_per_s)}{evicted}  hit ratio {ratio}  "
                          f"evictions {_rate(lk.evictions_per_s)}"))
    if view.ops:
        ops = Table(title="operations", title_justify="left")
        for col in ("op", "ops/s", "p99", "errors/s"):
            ops.add_column(col, justify="left" if col == "op" else "right")
        for o in view.ops:
            ops.add_row(o.op, f"{o.ops_per_s:,.1f}", _latency(o.p99_s),
                        Text(f"{o.errors_per_s:,.1f}", style="red" if o.errors_per_s else ""))
        parts.append(ops)
    if view.errors:
        errors = Table(title="recent errors", title_justify="left")
        for col in ("op", "error", "last interval", "total", "last seen"):
            errors.add_column(col, justify="left" if col in ("op", "error") else "right")
        for e in view.errors:
            errors.add_row(e.op, Text(e.outcome, style="red"), str(e.recent), f"{e.total:,}",
                           "before" if e.age_s is None else f"{e.age_s:.0f} s ago")
        parts.append(errors)
    parts.append(_nodes(view, max_nodes))
    parts += [Text(note, style="dim") for note in view.notes]
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """Read single keys from a terminal stdin (cbreak: no Enter needed, Ctrl-C still
    signals); yields ``read(timeout_s) -> key or ""``. Without a terminal: never a key."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        def wait(timeout_s: float) -> str:
            time.sleep(timeout_s)
            return ""

        yield wait
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout_s: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return os.read(fd, 32).decode("utf-8", "replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def watch(first: Group, frame: Callable[[], Group], *, interval_s: float, console: Console,
          stop: threading.Event) -> None:
    """Show ``first`` full screen, then ``frame()`` every ``interval_s``, until ``q`` is
    pressed or ``stop`` is set (Ctrl-C, SIGTERM); the terminal is restored either way."""
    from rich.live import Live

    with _keys() as key, Live(first, console=console, screen=True, auto_refresh=False,
                              transient=True) as live:
        while not stop.is_set():
            due = time.monotonic() + interval_s
            while not stop.is_set() and (left := due - time.monotonic()) > 0:
                if "q" in key(min(KEY_POLL_S, left)).lower():
                    return
            if not stop.is_set():
                live.update(frame(), refresh=True)
