"""Prometheus metrics for kvctl's servers (``--metrics-port``), on the standard client.

Each server owns a :class:`ServerMetrics` with its own registry (no process-global state;
servers in one process may share one, each under its own namespace): operations by name and
outcome, latency histograms, long polls apart from them, payload bytes moved, and gauges read
at scrape time (capacity, usage, entries). :meth:`ServerMetrics.serve` exposes them over
HTTP. Every metric is documented, with its unit and labels, in ``docs/metrics.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.net.bind import LOOPBACK, announce_bind, is_loopback

_log = logging.getLogger("kvctl.metrics")

#: Outcome of an operation that succeeded (no lookup involved).
OK = "ok"
#: Outcome of a lookup (a get) that found what it asked for.
HIT = "hit"
#: Outcome of a lookup that found nothing: the key was never there, or was removed.
MISS = "miss"
#: Outcome of a lookup of a key the store dropped to make room (a miss with a known cause).
EVICTED = "evicted"

#: Latency buckets in seconds: 50 us .. 10 s, fine where KV operations live.
LATENCY_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                     0.25, 0.5, 1.0, 2.5, 10.0)


def _client() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # metric families for collectors
    except ImportError as exc:
        raise UnavailableError(
            "metrics need the prometheus-client package, which is not installed",
            "pip install prometheus-client (or reinstall kvctl, which depends on it)",
        ) from exc
    return prometheus_client


class ServerMetrics:
    """The metrics of one server.

    Args:
        namespace: metric name prefix, e.g. ``kvctl_store`` or ``kvctl_metadata``.
        share: export through this one's registry and endpoint (two servers in one
            process, e.g. the master and node of ``kvctl store serve``); its own
            :meth:`serve` and :meth:`close` are then not used.
    """

    def __init__(self, namespace: str, *, share: ServerMetrics | None = None) -> None:
        prom = _client()
        self.namespace = namespace
        self.registry: Any = (share.registry if share is not None
                              else prom.CollectorRegistry(auto_describe=True))
        self._prom = prom
        self.operations = prom.Counter(
            "operations", "Operations served, by operation and outcome (ok; hit, miss or "
            "evicted for lookups; else an error code).",
            ["op", "outcome"], namespace=namespace, registry=self.registry)
        self.latency = prom.Histogram(
            "operation_latency_seconds", "Time to serve one operation, in seconds (long "
            "polls are in long_poll_seconds instead).",
            ["op"], namespace=namespace, registry=self.registry, buckets=LATENCY_BUCKETS_S)
        self.polls = prom.Histogram(
            "long_poll_seconds", "Time a long poll (a request that waits for work, such as "
            "a storage node's heartbeat) was held, in seconds.",
            ["op"], namespace=namespace, registry=self.registry, buckets=LATENCY_BUCKETS_S)
        self.bytes = prom.Counter(
            "bytes", "Payload bytes (object or value bytes, not protocol messages) moved, "
            "by operation and direction (in: to the server, out: from it).",
            ["op", "direction"], namespace=namespace, registry=self.registry)
        #: labelled children by (metric, label values): ``labels()`` costs a lock and a
        #: few microseconds, paid once per series instead of on every request
        self._children: dict[tuple[Any, ...], Any] = {}
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def record(self, op: str, seconds: float, outcome: str = OK, *, bytes_in: int = 0,
               bytes_out: int = 0) -> None:
        """Count one operation that took ``seconds`` and ended with ``outcome``, having
        moved ``bytes_in``/``bytes_out`` payload bytes."""
        self.child(self.operations, op, outcome).inc()
        self.child(self.latency, op).observe(seconds)
        self.count_bytes(op, bytes_in=bytes_in, bytes_out=bytes_out)

    def record_poll(self, op: str, seconds: float, outcome: str = OK) -> None:
        """Count one long poll held ``seconds``: its wait is the client's choice, not
        service time, so it stays out of ``operation_latency_seconds``."""
        self.child(self.operations, op, outcome).inc()
        self.child(self.polls, op).observe(seconds)

    def count_bytes(self, op: str, *, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """Add payload bytes moved by ``op`` (without counting an operation)."""
        if bytes_in:
            self.child(self.bytes, op, "in").inc(bytes_in)
        if bytes_out:
            self.child(self.bytes, op, "out").inc(bytes_out)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per series."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    @contextmanager
    def timed(self, op: str) -> Iterator[dict[str, Any]]:
        """Time a block; set ``outcome``/``bytes_in``/``bytes_out`` in the yielded dict.
        An exception escaping the block counts as outcome ``exception``."""
        info: dict[str, Any] = {"outcome": "ok", "bytes_in": 0, "bytes_out": 0}
        start = time.perf_counter()
        try:
            yield info
        except BaseException:
            info["outcome"] = "exception"
            raise
        finally:
            self.record(op, time.perf_counter() - start, str(info["outcome"]),
                        bytes_in=int(info["bytes_in"]), bytes_out=int(info["bytes_out"]))

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value ``read()`` gives at scrape time (capacity, usage, ...)."""
        if name in self._gauges:
            raise UsageError(f"gauge {name} is defined twice", "give each gauge its own name")
        g = self._prom.Gauge(name, documentation, namespace=self.namespace,
                             registry=self.registry)
        g.set_function(read)
        self._gauges[name] = g

    def counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Any:
        """A named counter (evictions, tier moves, ...); created once, returned after."""
        if name not in self._counters:
            self._counters[name] = self._prom.Counter(
                name, documentation, list(labels), namespace=self.namespace,
                registry=self.registry)
        return self._counters[name]

    def add_collector(self, collect: Callable[[], Iterable[Any]]) -> None:
        """Metric families computed at scrape time by ``collect()`` (e.g. from a status
        snapshot, so counters kept elsewhere are exported without double bookkeeping)."""

        class _Collector:
            def collect(self) -> Iterable[Any]:
                return collect()

            def describe(self) -> list[Any]:
                return []

        self.registry.register(_Collector())

    def names(self) -> frozenset[str]:
        """Every sample name this registry exports (``_total``, ``_bucket``... included),
        labelled series with no sample yet too: what a dashboard's queries may name."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                    "summary": ("_count", "_sum")}
        found: set[str] = set()
        for family in self.registry.collect():
            found.update(family.name + s for s in suffixes.get(family.type, ("",)))
            found.update(sample.name for sample in family.samples
                         if not sample.name.endswith("_created"))
        return frozenset(found)

    @property
    def families(self) -> Any:
        """``prometheus_client.core``'s metric family classes, for :meth:`add_collector`."""
        return self._prom.core

    def render(self) -> str:
        """The text exposition format, as a scrape would return it."""
        return bytes(self._prom.generate_latest(self.registry)).decode()

    def serve_for(self, listen_host: str, port: int, *, token: str | None) -> tuple[str, int]:
        """Serve ``/metrics`` beside a listener on ``listen_host``: there when no token is
        configured, else on loopback only (the endpoint asks no one for the token, and its
        samples name keys, nodes and tenants). Returns ``(host, port)``."""
        host = listen_host
        if token is not None and not is_loopback(listen_host):
            host = LOOPBACK
            _log.warning("metrics on %s only: with a token the unauthenticated /metrics "
                         "endpoint stays on loopback (scrape it from this host)", host)
        return host, self.serve(host, port)

    def serve(self, host: str, port: int) -> int:
        """Expose ``/metrics`` on ``host:port`` (0: any free port); returns the port.

        Raises:
            UsageError: the address cannot be bound.
        """
        try:
            server, thread = self._prom.start_http_server(port, addr=host,
                                                           registry=self.registry)
        except OSError as exc:
            raise UsageError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
                             "choose another --metrics-port (0 picks a free one)") from exc
        self._server, self._thread = server, thread
        bound = int(server.server_address[1])
        announce_bind("metrics endpoint", host, bound)
        return bound

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` the endpoint is bound to, while it is served."""
        server = self._server
        return None if server is None else (str(server.server_address[0]),
                                            int(server.server_address[1]))

    def close(self) -> None:
        """Stop the metrics endpoint. Safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)
