"""Put load on an elected store master, through a takeover, then check every acknowledged
object (run on a namespaced host by ``tests/multihost/test_store_ha.py``).

``python -m tests.multihost._ha_load MASTERS --threads 4 --before 2 --after 20``: each
thread puts new keys (deterministic bytes per key) on its own client; after ``--before``
seconds it prints ``KILL`` (the test then kills the leader) and keeps putting until every
thread has had 10 puts acknowledged after the kill, or ``--after`` seconds. Then every
acknowledged key is read back and compared, and one JSON document is printed: counts,
the takeover time (from ``KILL`` to the first put acknowledged after it) and the longest
time any thread went without an acknowledged put.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time

from kvctl.errors import KvctlError
from kvctl.store.client import StoreClient


def value_of(key: str) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (1 + (seed[0] * 37) % 300))[: 2048 + seed[1] * 8]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("masters")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--before", type=float, default=2.0)
    parser.add_argument("--after", type=float, default=20.0)
    args = parser.parse_args(argv)

    acked: list[list[str]] = [[] for _ in range(args.threads)]
    failed = [0] * args.threads
    after_kill = [0] * args.threads
    first_ok_after: list[float | None] = [None] * args.threads
    longest_gap = [0.0] * args.threads
    killed: list[float] = []
    stop = threading.Event()

    def work(n: int) -> None:
        with StoreClient(args.masters, timeout_s=3) as client:
            last_ok = time.monotonic()
            i = 0
            while not stop.is_set():
                key = f"t{n}-{i}"
                i += 1
                try:
                    client.put(key, value_of(key))
                except KvctlError:
                    failed[n] += 1
                    time.sleep(0.05)
                    continue
                now = time.monotonic()
                longest_gap[n] = max(longest_gap[n], now - last_ok)
                last_ok = now
                acked[n].append(key)
                if killed:
                    after_kill[n] += 1
                    if first_ok_after[n] is None:
                        first_ok_after[n] = now

    threads = [threading.Thread(target=work, args=(n,), daemon=True)
               for n in range(args.threads)]
    for t in threads:
        t.start()
    time.sleep(args.before)
    print("KILL", flush=True)
    sys.stdin.readline()  # the test answers once the leader is dead
    killed.append(time.monotonic())
    deadline = time.monotonic() + args.after
    while time.monotonic() < deadline and min(after_kill) < 10:
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)

    keys = [k for per in acked for k in per]
    lost = wrong = 0
    with StoreClient(args.masters, timeout_s=10) as client:
        for start in range(0, len(keys), 256):
            batch = keys[start:start + 256]
            for key, got in zip(batch, client.batch_get(batch), strict=True):
                if isinstance(got, Exception):
                    lost += 1
                elif bytes(got) != value_of(key):
                    wrong += 1
    firsts = [t for t in first_ok_after if t is not None]
    print(json.dumps({
        "acked": len(keys), "acked_after_kill": sum(after_kill), "failed": sum(failed),
        "lost": lost, "wrong": wrong,
        "takeover_s": (min(firsts) - killed[0]) if firsts else None,
        "all_threads_back_s": (max(firsts) - killed[0])
        if len(firsts) == args.threads else None,
        "longest_gap_s": max(longest_gap)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
