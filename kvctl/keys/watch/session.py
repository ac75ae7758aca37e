"""One watch: subscribe, check, record, count, until a bound or a stop.

:class:`WatchSession` ties a :class:`~kvctl.keys.watch.source.Subscriber`, a
:class:`~kvctl.keys.watch.checker.Checker` and an optional
:class:`~kvctl.keys.watch.record.Recorder`: every message is recorded as received, checked
in sequence order, and a gap is filled from the replay endpoint before the message after it.
:meth:`WatchSession.summary` is the ``keys.watch`` document (a verdict: ``ok`` is false
when an instance's hashes mismatch the profile, two instances diverge, or an endpoint never
answered).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvctl.keys.profiles import KeyConfig
from kvctl.keys.watch.checker import Checker, Finding
from kvctl.keys.watch.record import Recorder
from kvctl.keys.watch.source import Endpoint, Received, Subscriber
from kvctl.keys.watch.wire import BadFrame, split_message
from kvctl.verdict import check_entry

#: Seconds a replay endpoint that failed a replay (timed out, garbage, a flood) is left
#: alone: its gaps meanwhile are counted lost, not waited for.
REPLAY_BACKOFF_S = 30.0


@dataclasses.dataclass(frozen=True)
class WatchOptions:
    """Bounds and windows of a watch.

    Attributes:
        duration_s: stop after this many seconds (``None``: until stopped).
        max_events: stop after this many KV events in all (``None``: no bound).
        window_s: the window of the windowed pool figures, seconds.
        max_blocks: per instance, chain links and held blocks remembered.
        replay_timeout_s: how long one replay may take.
    """

    duration_s: float | None = None
    max_events: int | None = None
    window_s: float = 60.0
    max_blocks: int = 1_000_000
    replay_timeout_s: float = 5.0


class WatchSession:
    """Watch ``endpoints`` under ``config``; ``close()`` is safe twice.

    Args:
        on_finding: called with each finding as it is made.
        record: write every message received to this file (:mod:`.record`).
        context: a ``zmq.Context`` to share (tests).
    """

    def __init__(self, endpoints: list[Endpoint], config: KeyConfig, options: WatchOptions,
                 *, on_finding: Callable[[Finding], None] | None = None,
                 record: Path | None = None, context: Any = None) -> None:
        self.options = options
        self.config = config
        self.checker = Checker(config, window_s=options.window_s,
                               max_blocks=options.max_blocks, on_finding=on_finding)
        for e in endpoints:
            self.checker.add_instance(e.name, e.url)
        self.recorder = (Recorder(record, profile=config.profile, block_size=config.block_size)
                         if record is not None else None)
        try:
            self.subscriber = Subscriber(endpoints, context=context,
                                         replay_timeout_s=options.replay_timeout_s)
        except BaseException:
            self.close()
            raise
        self.started = time.monotonic()
        self.events_at_start = 0
        #: per instance, when its replay endpoint may be asked again (after a failed replay)
        self._replay_quiet: dict[str, float] = {}

    # ---------------------------------------------------------------- running

    @property
    def events(self) -> int:
        """KV events checked so far, every instance."""
        return sum(i.stats.events for i in self.checker.instances.values())

    def done(self) -> bool:
        """A bound (``duration_s``, ``max_events``) is reached."""
        o = self.options
        if o.duration_s is not None and time.monotonic() - self.started >= o.duration_s:
            return True
        return o.max_events is not None and self.events >= o.max_events

    def step(self, timeout_s: float) -> int:
        """Handle what arrives within ``timeout_s``; the number of messages handled."""
        received = self.subscriber.poll(timeout_s)
        for name, state in self.subscriber.changes:
            self.checker.set_state(name, state)
            if state.startswith("dead"):
                inst = self.checker.instances[name]
                self.checker.report(Finding("dead-endpoint", "warning", name,
                                            f"{name} ({inst.endpoint}): {state}",
                                            ts=time.time()))
        self.subscriber.changes.clear()
        handled = 0
        for r in received:
            # a bound is checked at every message: one poll drains up to 10,000 per
            # instance, which at a few thousand a second overshot --duration by seconds
            # and --events by thousands
            if self.done():
                break
            self.handle(r)
            handled += 1
        return handled

    def handle(self, r: Received) -> None:
        """Record and check one received message (gaps filled first)."""
        checker, recorder = self.checker, self.recorder
        msg = split_message(r.frames)
        if isinstance(msg, BadFrame):
            if recorder is not None:
                recorder.malformed(r.name, r.recv_ts, r.frames)
            checker.bad_message(r.name, msg.problem)
            return
        if checker.instances[r.name].state != "live":
            checker.set_state(r.name, "live")
        verdict, first = checker.check_seq(r.name, msg.seq)
        if verdict == "gap":
            self._fill(r.name, first, msg.seq)  # recorded before the message after the gap
        if recorder is not None:
            recorder.message(r.name, r.recv_ts, msg.seq, msg.topic, msg.payload)
        checker.feed(r.name, msg.seq, msg.payload)

    def _fill(self, name: str, first: int, upto: int) -> None:
        now_m = time.monotonic()
        budget = self.options.replay_timeout_s
        if self.options.duration_s is not None:  # a replay never outlasts --duration
            budget = min(budget, self.started + self.options.duration_s - now_m)
        quiet = self._replay_quiet.get(name, 0.0)
        if quiet > now_m:
            got: list[tuple[int, bytes]] = []
            problem: str | None = (f"its replay endpoint failed {REPLAY_BACKOFF_S:g} s ago "
                                   "and is not asked again before")
        elif budget <= 0:
            got, problem = [], "no time left to ask the replay endpoint"
        else:
            got, problem = self.subscriber.replay(name, first, upto, timeout_s=budget)
            if problem is not None and self.subscriber.endpoints[name].replay is not None:
                # a replay endpoint that does not answer would stall the watch at every
                # gap: give it a rest
                self._replay_quiet[name] = time.monotonic() + REPLAY_BACKOFF_S
        filled = 0
        now = time.time()
        for seq, payload in got:
            if not first <= seq < upto:
                continue
            if self.recorder is not None:
                self.recorder.message(name, now, seq, b"", payload, replayed=True)
            self.checker.feed(name, seq, payload, replayed=True)
            filled += 1
        self.checker.note_gap(name, first, upto, filled=filled,
                              problem=None if filled == upto - first else problem)

    def run(self, stop: threading.Event, *, tick_s: float = 1.0,
            on_tick: Callable[[], None] | None = None) -> None:
        """Watch until a bound or ``stop``; ``on_tick()`` about every ``tick_s``."""
        next_tick = time.monotonic() + tick_s
        while not stop.is_set() and not self.done():
            self.step(min(0.1, max(0.0, next_tick - time.monotonic())))
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_s
                if on_tick is not None:
                    on_tick()

    def close(self) -> None:
        """Close sockets and the record file."""
        sub = getattr(self, "subscriber", None)
        if sub is not None:
            sub.close()
        if self.recorder is not None:
            self.recorder.close()

    def __enter__(self) -> WatchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- reporting

    def summary(self, *, final: bool = False) -> dict[str, Any]:
        """The ``keys.watch`` document: per instance, totals, checks, findings by kind."""
        c = self.checker
        rows = [self.instance_row(name) for name in c.instances]
        checks = list(self._checks(rows, final=final))
        totals: dict[str, int | float | None] = {k: sum(int(r[k]) for r in rows) for k in (
            "blocks_seen", "verified", "mismatched", "divergent", "unverifiable_blocks",
            "computed_tokens", "duplicate_tokens", "blocks_held")}
        computed, duplicated = totals["computed_tokens"], totals["duplicate_tokens"]
        totals["duplicate_share"] = (duplicated / computed
                                     if computed and duplicated is not None else None)
        return {
            "ok": not any(ch["status"] == "fail" for ch in checks), "checks": checks,
            "final": final, "profile": self.config.profile,
            "block_size": self.config.block_size,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "window_s": self.options.window_s, "instances": rows, "totals": totals,
            "findings": dict(c.findings_total),
            "divergent_pairs": [{"instances": list(p), "blocks": n}
                                for p, n in c.divergent_pairs.items()],
        }

    def instance_row(self, name: str) -> dict[str, Any]:
        """One instance's figures as JSON values."""
        inst = self.checker.instances[name]
        s = inst.stats
        w = self.checker.window(name)
        return {
            "name": name, "endpoint": inst.endpoint, "state": inst.state,
            "next_seq": inst.next_seq, **dataclasses.asdict(s),
            "unverifiable_blocks": sum(s.unverifiable.values()),
            "blocks_held": len(inst.held),
            "duplicate_share": (s.duplicate_tokens / s.computed_tokens
                                if s.computed_tokens else None),
            "window": {"computed_tokens": w.computed_tokens,
                       "duplicate_tokens": w.duplicate_tokens,
                       "duplicate_share": w.duplicate_share},
        }

    def _checks(self, rows: Iterable[dict[str, Any]], *, final: bool
                ) -> Iterable[dict[str, Any]]:
        c = self.checker
        first = {f.instance: f for f in reversed(c.findings) if f.kind == "mismatch"}
        for r in rows:
            name = r["name"]
            if r["mismatched"]:
                f = first.get(name)
                yield check_entry(f"fidelity: {name}", "fail",
                                  detail=f"{r['mismatched']} block(s) mismatch "
                                  f"{self.config.profile}"
                                  + (f": {f.message}" if f is not None else ""))
            elif r["verified"]:
                yield check_entry(f"fidelity: {name}", "pass",
                                  detail=f"{r['verified']} block(s) recomputed and equal"
                                  + (f"; {r['unverifiable_blocks']} not verifiable"
                                     if r["unverifiable_blocks"] else ""))
            else:
                why = ", ".join(f"{n}: {k}" for k, n in r["unverifiable"].items())
                yield check_entry(f"fidelity: {name}", "skip",
                                  detail="no block verified yet" + (f" ({why})" if why else ""))
            if r["batches"] == 0 and final and r["state"] != "live":
                yield check_entry(f"reachable: {name}", "fail",
                                  detail=f"nothing received from {r['endpoint']}: {r['state']}")
        names = list(c.instances)
        pairs = c.divergent_pairs
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                n = pairs.get((a, b), 0) + pairs.get((b, a), 0)
                if n:
                    yield check_entry(f"agreement: {a} / {b}", "fail",
                                      detail=f"{n} block(s) with the same content hashed "
                                      "differently")
                else:
                    yield check_entry(f"agreement: {a} / {b}", "pass",
                                      detail="no block hashed differently")


def finding_json(f: Finding) -> dict[str, Any]:
    """A finding as the ``keys.watch-finding`` document's body."""
    return {"finding": f.kind, "severity": f.severity, "instance": f.instance,
            "message": f.message, "seq": f.seq,
            "causes": [dataclasses.asdict(c) for c in f.causes], "details": f.details,
            "ts": f.ts}


def serve_metrics(session: WatchSession, host: str, port: int) -> Any:
    """Expose the watch's counters on ``/metrics`` (``kvctl_keys_watch_*``); returns the
    :class:`~kvctl.metrics.ServerMetrics` (close it after)."""
    from kvctl.metrics import ServerMetrics

    metrics = ServerMetrics("kvctl_keys_watch")
    families = metrics.families

    def collect() -> Iterable[Any]:
        c = session.checker
        spec = (("blocks_seen", "BlockStored blocks seen", "blocks_seen"),
                ("blocks_verified", "Blocks whose hash kvctl recomputed and found equal",
                 "verified"),
                ("blocks_mismatched", "Blocks whose hash differs from the configured "
                 "profile's", "mismatched"),
                ("blocks_divergent", "Blocks whose content another instance hashed "
                 "differently", "divergent"),
                ("blocks_duplicated", "Blocks an instance computed while another instance "
                 "held the same content", "duplicate_blocks"),
                ("blocks_computed", "Blocks an instance stored while not holding them",
                 "computed_blocks"))
        for name, doc, field in spec:
            fam = families.CounterMetricFamily(f"kvctl_keys_watch_{name}", doc,
                                               labels=["instance"])
            for inst in c.instances.values():
                fam.add_metric([inst.name], getattr(inst.stats, field))
            yield fam
        held = families.GaugeMetricFamily("kvctl_keys_watch_blocks_held",
                                          "Blocks an instance holds now (stored, not removed)",
                                          labels=["instance"])
        for inst in c.instances.values():
            held.add_metric([inst.name], len(inst.held))
        yield held

    metrics.add_collector(collect)
    metrics.serve(host, port)
    return metrics
