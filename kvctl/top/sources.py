"""Where ``kvctl store top`` reads a store: a kvctl master or a ``mooncake_master``.

A source reads the store once (:meth:`Source.read`: a :class:`Reading`) and turns two
readings into a :class:`~kvctl.top.view.TopView` (:meth:`Source.view`); rates are over the
time between them. It remembers when it last saw each error outcome grow, for "recent
errors".
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Protocol

from kvctl.top.scrape import Scrape, fetch, increase, metrics_url, quantile, rate
from kvctl.top.view import ErrorRow, Lookups, NodeRow, OpRow, TierRow, TopView

#: Outcomes of kvctl operations that are not errors (a miss is an answer, not a failure).
SUCCESS = frozenset({"ok", "hit", "miss", "evicted", "pending"})
#: The quantile shown per operation.
QUANTILE = 0.99
#: Error rows shown: the most recent first.
MAX_ERRORS = 8


@dataclasses.dataclass(frozen=True)
class Reading:
    """One look at a store: its status (backend-specific) and its metrics, if read.

    Attributes:
        at: ``time.monotonic()`` when it was taken, seconds.
        status: the master's status (:class:`~kvctl.store.protocol.StoreStatus` or
            :class:`~kvctl.store.mooncake_http.MooncakeMasterStatus`).
        scrape: its metrics endpoint, or ``None`` when there is none.
    """

    at: float
    status: Any
    scrape: Scrape | None


class Source(Protocol):
    """A store ``kvctl store top`` can watch."""

    backend: str
    master: str

    def read(self) -> Reading:
        """Read the store now (raises the backend's errors when it cannot)."""
        ...

    def view(self, prev: Reading, cur: Reading) -> TopView:
        """The view over ``prev`` → ``cur`` (``prev is cur``: a first reading, no rates)."""
        ...

    def close(self) -> None:
        """Close connections (idempotent)."""
        ...


class _Errors:
    """Error outcomes with their counts, and when each last grew while watched."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], float] = {}

    def rows(self, counts: list[tuple[str, str, int, int]]) -> tuple[ErrorRow, ...]:
        """``counts``: (op, outcome, recent, total) → rows, most recently seen first."""
        now = time.monotonic()
        rows = []
        for op, outcome, recent, total in counts:
            if total <= 0:
                continue
            if recent > 0:
                self._seen[(op, outcome)] = now
            seen = self._seen.get((op, outcome))
            rows.append(ErrorRow(op=op, outcome=outcome, recent=recent, total=total,
                                 age_s=None if seen is None else round(now - seen, 1)))
        rows.sort(key=lambda r: (r.age_s is None, r.age_s or 0.0, -r.total))
        return tuple(rows[:MAX_ERRORS])


def _elapsed(prev: Reading, cur: Reading) -> float:
    return max(0.0, cur.at - prev.at)


# ---------------------------------------------------------------- kvctl


class KvctlSource:
    """A kvctl master: status over the store protocol; rates from its metrics endpoint
    (``--metrics-port``), when given.

    Args:
        master: the master's ``HOST:PORT``.
        token: the store's shared token, or ``None``.
        metrics: its metrics ``HOST:PORT`` or URL, or ``None`` (no rates then).
    """

    backend = "kvctl"

    def __init__(self, master: str, *, token: str | None = None,
                 metrics: str | None = None) -> None:
        from kvctl.store.client import StoreClient

        self.master = master
        self.metrics_url = metrics_url(metrics) if metrics else None
        self._client = StoreClient(master, token=token)
        self._errors = _Errors()

    def read(self) -> Reading:
        """Status, then metrics (raises StoreError/ScrapeError when they cannot be read)."""
        status = self._client.status()
        scrape = fetch(self.metrics_url) if self.metrics_url else None
        return Reading(at=time.monotonic(), status=status, scrape=scrape)

    def view(self, prev: Reading, cur: Reading) -> TopView:
        st = cur.status
        nodes = tuple(NodeRow(
            name=n.node_id, state=n.state or ("alive" if n.alive else "dead"),
            dram_used_bytes=n.used_bytes, dram_capacity_bytes=n.capacity_bytes,
            ssd_used_bytes=n.ssd_used_bytes,
            ssd_capacity_bytes=n.ssd_capacity_bytes if n.ssd_policy != "off" else 0,
            objects=n.objects, endpoint=n.endpoint) for n in st.nodes)
        both = st.tiers.get("dram+ssd", 0)
        tiers = [TierRow("dram", st.used_bytes, st.capacity_bytes,
                         st.tiers.get("dram", 0) + both)]
        ssd_capacity = sum(n.ssd_capacity_bytes for n in st.nodes if n.alive and
                           n.ssd_policy != "off")
        if ssd_capacity:
            tiers.append(TierRow("ssd", sum(n.ssd_used_bytes for n in st.nodes if n.alive),
                                 ssd_capacity, st.tiers.get("ssd", 0) + both))
        problems = []
        for n in st.nodes:
            if not n.alive:
                problems.append(f"node {n.node_id} is {n.state or 'dead'}: last heartbeat "
                                f"{n.last_heartbeat_s:.1f} s ago")
            if n.ssd_state == "full":
                problems.append(f"node {n.node_id}: SSD tier full, offload paused "
                                f"({n.ssd_error})")
        if st.lost:
            problems.append(f"{st.lost} objects lost with their last replica")
        if not st.nodes:
            problems.append("no storage node is registered")
        elapsed = _elapsed(prev, cur)
        notes: list[str] = []
        lookups: Lookups | None = None
        ops: tuple[OpRow, ...] = ()
        errors: tuple[ErrorRow, ...] = ()
        if cur.scrape is None:
            notes.append("no metrics endpoint: for rates, latency and errors start the "
                         "master with --metrics-port PORT and pass --metrics HOST:PORT")
        elif not cur.scrape.has("kvctl_store_operations_total"):
            notes.append(f"{self.metrics_url} exports no kvctl_store metrics: is it this "
                         "master's --metrics-port?")
        elif prev.scrape is not None and elapsed > 0:
            evictions = (st.evictions + st.ssd_evictions) - (
                prev.status.evictions + prev.status.ssd_evictions)
            lookups = _kvctl_lookups(prev.scrape, cur.scrape, max(0, evictions) / elapsed)
            ops = _server_ops(prev.scrape, cur.scrape, "kvctl_store")
        if cur.scrape is not None:
            errors = self._errors.rows(_server_errors(prev.scrape or cur.scrape, cur.scrape,
                                                      "kvctl_store"))
        return TopView(backend=self.backend, master=self.master,
                       metrics_url=self.metrics_url,
                       health=f"{'degraded' if problems else 'ok'} (state: {st.state})",
                       interval_s=round(elapsed, 3), objects=st.objects, nodes=nodes,
                       tiers=tuple(tiers), lookups=lookups, ops=ops, errors=errors,
                       problems=tuple(problems), notes=tuple(notes))

    def close(self) -> None:
        self._client.close()


def _kvctl_lookups(prev: Scrape, cur: Scrape, evictions_per_s: float) -> Lookups:
    name = "kvctl_store_get_keys_total"
    hits = rate(prev, cur, name, outcome="hit") or 0.0
    misses = rate(prev, cur, name, outcome="miss") or 0.0
    evicted = rate(prev, cur, name, outcome="evicted") or 0.0
    looked = rate(prev, cur, name) or 0.0
    return Lookups(hits_per_s=hits, misses_per_s=misses + evicted, evicted_per_s=evicted,
                   evictions_per_s=evictions_per_s,
                   hit_ratio=hits / looked if looked > 0 else None)


def _outcomes(scrape: Scrape, ns: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for labels, _ in scrape.series(f"{ns}_operations_total"):
        found.setdefault(labels.get("op", ""), set()).add(labels.get("outcome", ""))
    return found


def _server_ops(prev: Scrape, cur: Scrape, ns: str) -> tuple[OpRow, ...]:
    """Ops/s, error rate and p99 per operation of a kvctl server's common metrics."""
    rows = []
    for op, outcomes in _outcomes(cur, ns).items():
        total = rate(prev, cur, f"{ns}_operations_total", op=op) or 0.0
        failed = sum(rate(prev, cur, f"{ns}_operations_total", op=op, outcome=o) or 0.0
                     for o in outcomes - SUCCESS)
        rows.append(OpRow(op=op, ops_per_s=total, errors_per_s=failed,
                          p99_s=quantile(QUANTILE, prev, cur,
                                         f"{ns}_operation_latency_seconds", op=op)))
    rows.sort(key=lambda r: (-r.ops_per_s, r.op))
    return tuple(rows)


def _server_errors(prev: Scrape, cur: Scrape, ns: str) -> list[tuple[str, str, int, int]]:
    out = []
    for op, outcomes in _outcomes(cur, ns).items():
        for outcome in sorted(outcomes - SUCCESS):
            name = f"{ns}_operations_total"
            out.append((op, outcome, int(increase(prev, cur, name, op=op, outcome=outcome)),
                        int(cur.value(name, op=op, outcome=outcome) or 0)))
    return out


# ---------------------------------------------------------------- Mooncake

_MOONCAKE_OP = re.compile(r"^master_(?P<op>[a-z_]+?)_requests_total$")
#: Mooncake's tiers: (name, capacity metric, used metric).
_MOONCAKE_TIERS = (("memory", "master_total_capacity_bytes", "master_allocated_bytes"),
                   ("file", "master_total_file_capacity_bytes",
                    "master_allocated_file_size_bytes"),
                   ("nof", "master_total_nof_capacity_bytes", "master_nof_allocated_bytes"))


class MooncakeSource:
    """A ``mooncake_master``: its HTTP ``/health``, ``/get_segments_detail`` and
    ``/metrics`` (``--metrics_port``, default 9003 on the master's host).

    Mooncake counts requests and failures per operation but exports no latency
    histogram, so p99 is not shown; its misses include evicted keys.

    Args:
        master: the master's RPC ``HOST:PORT``.
        metrics: its HTTP ``HOST:PORT`` or URL (default: the master's host, port 9003).
    """

    backend = "mooncake"

    def __init__(self, master: str, *, metrics: str | None = None) -> None:
        from kvctl.store.mooncake_http import default_metrics_url, normalize_metrics_url

        self.master = master
        self.base_url = normalize_metrics_url(metrics) if metrics else default_metrics_url(
            master)
        self.metrics_url = f"{self.base_url}/metrics"
        self._errors = _Errors()

    def read(self) -> Reading:
        """Health and segments, then metrics (raises MooncakeMetricsUnavailableError or
        ScrapeError when they cannot be read)."""
        from kvctl.store.mooncake_http import read_master_status

        status = read_master_status(self.master, self.base_url)
        return Reading(at=time.monotonic(), status=status, scrape=fetch(self.metrics_url))

    def view(self, prev: Reading, cur: Reading) -> TopView:
        st = cur.status
        scrape = cur.scrape or Scrape(at=cur.at, samples={})  # read() always scrapes
        nodes = tuple(NodeRow(name=s.name, state=s.status, dram_used_bytes=s.used_bytes,
                              dram_capacity_bytes=s.capacity_bytes,
                              endpoint=f"{s.protocol} {s.endpoint}".strip())
                      for s in st.segments)
        tiers = tuple(TierRow(tier, int(scrape.value(used) or 0), int(capacity))
                      for tier, cap_name, used in _MOONCAKE_TIERS
                      if (capacity := scrape.value(cap_name) or 0) > 0 or tier == "memory")
        problems = []
        if st.health != "ok" or not st.service_ready:
            problems.append(f"master not serving: health {st.health}, role {st.role}, "
                            f"state {st.ha_state}")
        problems += [f"segment {s.name} is {s.status}" for s in st.segments
                     if s.status.upper() != "OK"]
        if not st.segments:
            problems.append("no segment mounted: start a storage process or client with "
                            "global_segment_size > 0")
        elapsed = _elapsed(prev, cur)
        lookups: Lookups | None = None
        ops: tuple[OpRow, ...] = ()
        if prev.scrape is not None and elapsed > 0:
            lookups = _mooncake_lookups(prev.scrape, scrape)
            ops = _mooncake_ops(prev.scrape, scrape)
        errors = self._errors.rows([
            (op, "failure", int(increase(prev.scrape or scrape, scrape,
                                         f"master_{op}_failures_total")),
             int(scrape.value(f"master_{op}_failures_total") or 0))
            for op in _mooncake_op_names(scrape)])
        return TopView(backend=self.backend, master=self.master,
                       metrics_url=self.metrics_url,
                       health=f"{st.health} ({st.role}, {st.ha_state})",
                       interval_s=round(elapsed, 3), objects=st.keys, nodes=nodes,
                       tiers=tiers, lookups=lookups, ops=ops, errors=errors,
                       problems=tuple(problems),
                       notes=("mooncake_master exports no latency histogram: no p99",))

    def close(self) -> None:
        pass


def _mooncake_op_names(scrape: Scrape) -> list[str]:
    names = []
    for name in scrape.samples:
        m = _MOONCAKE_OP.match(name)
        if m is not None and scrape.value(name):
            names.append(m.group("op"))
    return sorted(names)


def _mooncake_ops(prev: Scrape, cur: Scrape) -> tuple[OpRow, ...]:
    rows = [OpRow(op=op, ops_per_s=rate(prev, cur, f"master_{op}_requests_total") or 0.0,
                  errors_per_s=rate(prev, cur, f"master_{op}_failures_total") or 0.0,
                  p99_s=None) for op in _mooncake_op_names(cur)]
    rows.sort(key=lambda r: (-r.ops_per_s, r.op))
    return tuple(rows)


def _mooncake_lookups(prev: Scrape, cur: Scrape) -> Lookups:
    """Gets are ``get_replica_list`` requests (one key each) plus the keys of batched
    ones; a failed lookup is a miss (Mooncake answers "not found" for evicted keys too)."""
    def per_s(name: str) -> float:
        return rate(prev, cur, name) or 0.0

    looked = per_s("master_get_replica_list_requests_total") + per_s(
        "master_batch_get_replica_list_items_total")
    misses = per_s("master_get_replica_list_failures_total") + per_s(
        "master_batch_get_replica_list_failed_items_total")
    hits = max(0.0, looked - misses)
    return Lookups(hits_per_s=hits, misses_per_s=misses, evicted_per_s=None,
                   evictions_per_s=per_s("master_evicted_key_count"),
                   hit_ratio=hits / looked if looked > 0 else None)
