"""What counting costs the store master per request, and what one ``store top`` reading
costs, on this machine.

Counting: the per-request code before this change (three ``labels()`` lookups per request)
against :func:`kvctl.store.metrics.count_request` for a 1-key and a 64-key get, best of
``--rounds`` rounds of ``--calls`` calls each (minima: the machine may be shared). A top
reading: a master status over the store protocol plus a scrape and parse of its metrics
endpoint, against an embedded store holding 200 objects.

    .venv/bin/python benchmarks/metrics_overhead.py [--rounds 7] [--calls 5000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from kvctl.metrics import ServerMetrics
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore, metrics_url
from kvctl.store.metrics import count_request
from kvctl.store.settings import StoreSettings
from kvctl.top.sources import KvctlSource


def _best_us(fn: Callable[[], object], rounds: int, calls: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _get(n: int) -> tuple[p.Get, p.GetReply]:
    keys = [f"k{i}" for i in range(n)]
    return p.Get(keys=keys), p.GetReply(slots=[
        p.GetSlot(key=k, size=4096, checksum=1, version=1, locations=[]) for k in keys])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    metrics = ServerMetrics("kvctl_store")

    def before() -> None:  # the old record(): labels() on every call
        metrics.operations.labels("get", "ok").inc()
        metrics.latency.labels("get").observe(1e-4)
        metrics.bytes.labels("get", "in").inc(40)

    one, one_reply = _get(1)
    many, many_reply = _get(64)
    rows = [("before: record() of any request", before),
            ("count_request, get of 1 key", lambda: count_request(metrics, one, one_reply, 1e-4)),
            ("count_request, get of 64 keys",
             lambda: count_request(metrics, many, many_reply, 1e-4))]
    for name, fn in rows:
        print(f"{name}: {_best_us(fn, args.rounds, args.calls):.1f} us")
    settings = StoreSettings(listen="127.0.0.1:0", capacity=64 << 20, metrics_port=0)
    with EmbeddedStore(settings) as store:
        with StoreClient(store.address) as client:
            for i in range(200):
                client.put(f"o{i}", b"x" * 4096)
        source = KvctlSource(store.address, metrics=metrics_url(store.server))
        try:
            best = min(_best_us(source.read, 1, 10) for _ in range(5))
        finally:
            source.close()
    print(f"store top reading (status + scrape + parse): {best / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
