"""The terminal side of ``kvctl verify-keys watch``: the ``keys.watch`` document as Rich
renderables (per instance: fidelity, blocks held, what a pool would save; agreement across
instances; recent findings), and the live loop in the style of ``store top`` (full screen,
refreshed every interval, ``q`` or Ctrl-C quits)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvctl.commands._top_screen import KEY_POLL_S, _keys
from kvctl.keys.watch.checker import Finding
from kvctl.keys.watch.session import WatchSession

#: Findings shown at the bottom of the live view.
RECENT = 8


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def render(doc: Mapping[str, Any], recent: list[Finding] | None = None, *,
           live: bool = False) -> Group:
    """One frame (or the final report) of a ``keys.watch`` document."""
    parts: list[Any] = []
    verdict = Text("ok", style="green") if doc["ok"] else Text("PROBLEMS", style="bold red")
    parts.append(Text.assemble(
        ("kvctl verify-keys watch", "bold"),
        f"  {doc['profile']}, block {doc['block_size']}  ", verdict,
        f"  {doc['elapsed_s']:.0f} s, window {doc['window_s']:g} s"
        + ("  (q quits)" if live else "")))
    table = Table(title="instances", title_justify="left")
    for col in ("instance", "state", "seq", "blocks", "verified", "mismatched",
                "not verifiable", "divergent", "held", "computed tok", "held elsewhere",
                "window"):
        table.add_column(col, justify="left" if col in ("instance", "state") else "right")
    for r in doc["instances"]:
        state = r["state"]
        table.add_row(
            r["name"], Text(state, style="" if state == "live" else "yellow"),
            "-" if r["next_seq"] is None else str(r["next_seq"] - 1),
            f"{r['blocks_seen']:,}", f"{r['verified']:,}",
            Text(f"{r['mismatched']:,}", style="bold red" if r["mismatched"] else ""),
            f"{r['unverifiable_blocks']:,}",
            Text(f"{r['divergent']:,}", style="bold red" if r["divergent"] else ""),
            f"{r['blocks_held']:,}", f"{r['computed_tokens']:,}",
            f"{r['duplicate_tokens']:,} ({_share(r['duplicate_share'])})",
            _share(r["window"]["duplicate_share"]))
    parts.append(table)
    t = doc["totals"]
    parts.append(Text(f"a shared pool would have served {t['duplicate_tokens']:,} of "
                      f"{t['computed_tokens']:,} prefill tokens ({_share(t['duplicate_share'])})"
                      " that an instance computed while another held them"))
    for r in doc["instances"]:
        for reason, n in r["unverifiable"].items():
            parts.append(Text(f"{r['name']}: {n:,} block(s) not verifiable: {reason}",
                              style="dim"))
    failing = [c for c in doc["checks"] if c["status"] == "fail"]
    for c in failing:
        parts.append(Text(f"! {c['name']}: {c.get('detail', '')}", style="bold red"))
    if recent:
        box = Table(title="recent findings", title_justify="left")
        for col in ("time", "instance", "finding", "message"):
            box.add_column(col)
        for f in recent:
            box.add_row(time.strftime("%H:%M:%S", time.localtime(f.ts)), f.instance,
                        Text(f.kind, style="red" if f.severity == "error" else "yellow"),
                        f.message)
        parts.append(box)
    return Group(*parts)


def watch_live(session: WatchSession, recent: collections.deque[Finding], *,
               interval_s: float, console: Console, stop: threading.Event) -> None:
    """Run ``session`` full screen, redrawn every ``interval_s``, until a bound, ``q`` or
    ``stop``; the terminal is restored either way."""
    from rich.live import Live

    with _keys() as key, Live(render(session.summary(), list(recent), live=True),
                              console=console, screen=True, auto_refresh=False,
                              transient=True) as live:
        due = time.monotonic() + interval_s
        while not stop.is_set() and not session.done():
            session.step(KEY_POLL_S)
            if "q" in key(0).lower():
                return
            if time.monotonic() >= due:
                due = time.monotonic() + interval_s
                live.update(render(session.summary(), list(recent), live=True), refresh=True)
