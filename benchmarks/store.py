"""Side-by-side latency and throughput: kvctl store vs Mooncake Store vs Redis, on loopback.

Not a test: run it by hand (the numbers depend on the machine and its load)::

    .venv/bin/python benchmarks/store.py                 # all systems, 4 KiB..4 MiB
    .venv/bin/python benchmarks/store.py --quick --json out.json

Systems (every server in its own process, the client in this one):

- ``kvctl/tcp``: ``kvctl store serve`` (master + node), client forced onto the engine's tcp.
- ``kvctl/shm``: same server, client on the same-host shared-memory path (auto transport).
- ``mooncake``: ``mooncake_master`` + a ``mooncake_client`` storage process, this process a
  client contributing no memory (TCP protocol).
- ``mooncake/local``: one ``MooncakeDistributedStore`` in this process contributing the
  memory (Mooncake's single-process path, the reference for the shm target).
- ``redis``: ``redis-server`` (apt) with redis-py; batch = MSET/MGET.

Per size: single put/get latency p50/p99 (ms) over distinct keys, and batch put/get
throughput (GB/s, decimal) for ``--batch`` keys per call using each system's zero-copy batch
API (kvctl ``batch_put``/``batch_get_into`` on registered buffers, Mooncake
``batch_put_from``/``batch_get_into``). Every key set is written once before timing so page
faults of fresh memory are not measured.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.store.client import StoreClient
from kvctl.units import parse_size_list

MOONCAKE_REF = {  # p50 ms (get, put) and batch GB/s (get, put) measured by the issue author
    4096: (0.31, 0.45), 65536: (0.31, 0.49), 1 << 20: (0.97, 1.0), 4 << 20: (3.9, 3.8)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


class System:
    name = ""

    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def batch_put(self, keys: list[str], size: int) -> None: ...
    def batch_get(self, keys: list[str], size: int) -> None: ...
    def remove(self, keys: list[str]) -> None: ...
    def close(self) -> None: ...


class KvctlSystem(System):
    def __init__(self, transport: str, address: str, batch: int, max_size: int) -> None:
        self.name = f"kvctl/{transport}"
        self.client = StoreClient(address, transport=transport, staging_bytes=256 << 20)
        self.buf = mmap.mmap(-1, batch * max_size)
        self.client.register_buffer(self.buf)
        self.view = memoryview(self.buf)

    def put(self, key: str, value: bytes) -> None:
        self.client.put(key, value)

    def get(self, key: str) -> bytes:
        return self.client.get(key)

    def batch_put(self, keys: list[str], size: int) -> None:
        errs = self.client.batch_put([(k, self.view[i * size:(i + 1) * size])
                                      for i, k in enumerate(keys)])
        if any(errs):
            raise RuntimeError(f"kvctl batch_put failed: {next(e for e in errs if e)}")

    def batch_get(self, keys: list[str], size: int) -> None:
        got = self.client.batch_get_into(keys, [self.view[i * size:(i + 1) * size]
                                                for i in range(len(keys))])
        bad = [g for g in got if not isinstance(g, int)]
        if bad:
            raise RuntimeError(f"kvctl batch_get_into failed: {bad[0]}")

    def remove(self, keys: list[str]) -> None:
        self.client.batch_remove(keys)

    def close(self) -> None:
        self.view.release()
        self.client.close()


class MooncakeSystem(System):
    def __init__(self, name: str, address: str, segment: int, batch: int,
                 max_size: int) -> None:
        from kvctl.store.mooncake import MooncakeStore

        self.name = name
        self.store = MooncakeStore(address, global_segment_bytes=segment,
                                   local_buffer_bytes=256 << 20)
        self.buf = mmap.mmap(-1, batch * max_size)
        self.base = self.store.register_buffer(self.buf)

    def put(self, key: str, value: bytes) -> None:
        self.store.put(key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def batch_put(self, keys: list[str], size: int) -> None:
        rc = self.store.batch_put_from(keys, [self.base + i * size for i in range(len(keys))],
                                       [size] * len(keys))
        if any(r != 0 for r in rc):
            raise RuntimeError(f"mooncake batch_put_from: {rc[:4]}")

    def batch_get(self, keys: list[str], size: int) -> None:
        rc = self.store.batch_get_into(keys, [self.base + i * size for i in range(len(keys))],
                                       [size] * len(keys))
        if any(r != size for r in rc):
            raise RuntimeError(f"mooncake batch_get_into: {rc[:4]}")

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.store._store.remove(k, True)

    def close(self) -> None:
        self.store.close()


class RedisSystem(System):
    name = "redis"

    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port)

    def put(self, key: str, value: bytes) -> None:
        self.r.set(key, value)

    def get(self, key: str) -> bytes:
        v = self.r.get(key)
        if v is None:
            raise KeyError(key)
        return v  # type: ignore[return-value]

    def batch_put(self, keys: list[str], size: int) -> None:
        value = b"r" * size
        self.r.mset(dict.fromkeys(keys, value))

    def batch_get(self, keys: list[str], size: int) -> None:
        self.r.mget(keys)

    def remove(self, keys: list[str]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


def measure(system: System, size: int, batch: int, iters: int, reps: int) -> dict[str, Any]:
    values = [os.urandom(size) for _ in range(4)]
    keys = [f"bench/{size}/{i}" for i in range(iters)]
    for k in keys[: min(8, iters)]:  # warm the connection and mappings
        system.put(k + "w", values[0])
        system.get(k + "w")
    put_t, get_t = [], []
    for i, k in enumerate(keys):
        t = time.perf_counter()
        system.put(k, values[i % 4])
        put_t.append(time.perf_counter() - t)
    for k in keys:
        t = time.perf_counter()
        system.get(k)
        get_t.append(time.perf_counter() - t)
    system.remove(keys + [k + "w" for k in keys[: min(8, iters)]])
    bkeys = [[f"bench/b{size}/{r}/{i}" for i in range(batch)] for r in range(reps)]
    system.batch_put(bkeys[0], size)  # warm-up round
    system.batch_get(bkeys[0], size)
    system.remove(bkeys[0])
    bput, bget = [], []
    for r in range(reps):
        t = time.perf_counter()
        system.batch_put(bkeys[r], size)
        bput.append(time.perf_counter() - t)
    for r in range(reps):
        t = time.perf_counter()
        system.batch_get(bkeys[r], size)
        bget.append(time.perf_counter() - t)
    for r in range(reps):
        system.remove(bkeys[r])
    total = batch * size
    return {"put_p50_ms": pct(put_t, 0.5), "put_p99_ms": pct(put_t, 0.99),
            "get_p50_ms": pct(get_t, 0.5), "get_p99_ms": pct(get_t, 0.99),
            "batch_put_gbps": total / statistics.median(bput) / 1e9,
            "batch_get_gbps": total / statistics.median(bget) / 1e9}


def start_kvctl(capacity: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "store", "serve", "--listen",
                             "127.0.0.1:0", "--capacity", capacity, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    text = ""
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        text += proc.stdout.readline().decode()
        try:
            return proc, str(json.loads(text)["master"])
        except ValueError:
            continue
    proc.kill()
    raise RuntimeError("kvctl store serve did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4KiB,64KiB,1MiB,4MiB")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--systems", default="kvctl/tcp,kvctl/shm,mooncake,mooncake/local,redis")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    sizes = parse_size_list(args.sizes)
    wanted = args.systems.split(",")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    results: dict[str, dict[int, dict[str, Any]]] = {}
    cleanups: list[Callable[[], None]] = []

    def iters_for(size: int) -> int:
        base = 200 if size <= 64 << 10 else 40 if size <= 1 << 20 else 20
        return max(10, base // 4) if args.quick else base

    reps = 3 if args.quick else 5
    try:
        systems: list[System] = []
        if any(w.startswith("kvctl") for w in wanted):
            proc, address = start_kvctl("1GiB")
            cleanups.append(lambda: (proc.terminate(), proc.wait()))
            for transport in ("tcp", "shm"):
                if f"kvctl/{transport}" in wanted:
                    systems.append(KvctlSystem("tcp" if transport == "tcp" else "auto",
                                               address, args.batch, max(sizes)))
                    systems[-1].name = f"kvctl/{transport}"
        if "mooncake" in wanted or "mooncake/local" in wanted:
            from kvctl.store.mooncake import MooncakeMaster

            mc = MooncakeMaster(storage_bytes=1 << 30 if "mooncake" in wanted else 0)
            cleanups.append(mc.close)
            if "mooncake" in wanted:
                systems.append(MooncakeSystem("mooncake", mc.address, 0, args.batch,
                                              max(sizes)))
        if "redis" in wanted and shutil.which("redis-server"):
            port = free_port()
            rproc = subprocess.Popen(["redis-server", "--port", str(port), "--bind",
                                      "127.0.0.1", "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cleanups.append(lambda: (rproc.terminate(), rproc.wait()))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            systems.append(RedisSystem(port))
        for system in systems:
            results[system.name] = {}
            for size in sizes:
                results[system.name][size] = measure(system, size, args.batch,
                                                     iters_for(size), reps)
                print(f"{system.name:15s} {size:>8d} B  " + "  ".join(
                    f"{k}={v:.3f}" for k, v in results[system.name][size].items()),
                      flush=True)
            system.close()
        if "mooncake/local" in wanted:
            # Mooncake's single-process path: this process contributes the memory. Its own
            # master, since one process cannot hold two MooncakeDistributedStore instances.
            mc2 = MooncakeMaster()
            cleanups.append(mc2.close)
            local = MooncakeSystem("mooncake/local", mc2.address, 1 << 30, args.batch,
                                   max(sizes))
            results[local.name] = {}
            for size in sizes:
                results[local.name][size] = measure(local, size, args.batch, iters_for(size),
                                                    reps)
                print(f"{local.name:15s} {size:>8d} B  " + "  ".join(
                    f"{k}={v:.3f}" for k, v in results[local.name][size].items()), flush=True)
            local.close()
    finally:
        for fn in reversed(cleanups):
            fn()
    report(results, sizes)
    if args.json:
        args.json.write_text(json.dumps({"results": {s: {str(k): v for k, v in r.items()}
                                                      for s, r in results.items()}}, indent=2))
    return 0


def report(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int]) -> None:
    cols = ["get_p50_ms", "get_p99_ms", "put_p50_ms", "put_p99_ms", "batch_get_gbps",
            "batch_put_gbps"]
    print()
    print(f"{'system':15s} {'size':>8s} " + " ".join(f"{c:>15s}" for c in cols))
    for name, per in results.items():
        for size in sizes:
            row = per.get(size)
            if row:
                print(f"{name:15s} {size:>8d} " + " ".join(f"{row[c]:15.3f}" for c in cols))
    mc = results.get("mooncake")
    local = results.get("mooncake/local")
    if not mc:
        return
    print("\nratios vs Mooncake measured in this run (targets: latency <= 0.8x, batch tput "
          ">= 1.5x; shm batch get >= mooncake/local)")
    for name in ("kvctl/tcp", "kvctl/shm"):
        per = results.get(name)
        if not per:
            continue
        for size in sizes:
            k, m = per[size], mc[size]
            line = (f"{name:10s} {size:>8d}  get p50 {k['get_p50_ms'] / m['get_p50_ms']:.2f}x"
                    f"  put p50 {k['put_p50_ms'] / m['put_p50_ms']:.2f}x"
                    f"  batch get {k['batch_get_gbps'] / m['batch_get_gbps']:.2f}x"
                    f"  batch put {k['batch_put_gbps'] / m['batch_put_gbps']:.2f}x")
            if local and name == "kvctl/shm":
                line += (f"  batch get vs mooncake/local "
                         f"{k['batch_get_gbps'] / local[size]['batch_get_gbps']:.2f}x")
            ref = MOONCAKE_REF.get(size)
            if ref:
                line += (f"  | vs issue's Mooncake p50: get {k['get_p50_ms'] / ref[0]:.2f}x"
                         f" put {k['put_p50_ms'] / ref[1]:.2f}x")
            print(line)


if __name__ == "__main__":
    sys.exit(main())
