"""Side-by-side latency and throughput: kvctl store vs Mooncake Store vs Redis, on loopback.

Not a test: run it by hand (the numbers depend on the machine and its load)::

    .venv/bin/python benchmarks/store.py                 # all systems, 4 KiB..4 MiB, 3 rounds
    .venv/bin/python benchmarks/store.py --quick --rounds 2 --json out.json

Systems (every server in its own process, every client in its own worker process):

- ``kvctl/tcp``: ``kvctl store serve`` (master + node in one process), client forced onto
  tcp: a get takes the bytes attached to the master's answer (one round trip).
- ``kvctl/tcp-split``: ``kvctl store master`` and ``kvctl store node`` as two processes, as
  when nodes sit on other hosts: a get is the master's answer plus a node read over tcp.
- ``kvctl/shm``: ``kvctl store serve``, client on the same-host shared-memory path (auto
  transport).
- ``mooncake``: ``mooncake_master`` + a ``mooncake_client`` storage process, the worker a
  client contributing no memory (TCP protocol).
- ``mooncake/local``: one ``MooncakeDistributedStore`` in the worker contributing the memory
  (Mooncake's single-process path, the reference for the shm target), its own master.
- ``redis``: ``redis-server`` (apt) with redis-py; batch = MSET/MGET.

Per size: single put/get latency p50/p99 (ms) over distinct keys, and batch put/get
throughput (GB/s, decimal) for ``--batch`` keys per call using each system's zero-copy batch
API (kvctl ``batch_put``/``batch_get_into`` on registered buffers, Mooncake
``batch_put_from``/``batch_get_into``). Every key set is written once before timing so page
faults of fresh memory are not measured.

The machine this runs on is shared and noisy, so the systems are measured in interleaved
rounds (per size, every system once per round, the order rotated) and each ratio is paired:
kvctl's figure of a round against Mooncake's figure of the same round. The report gives
the median of the per-round ratios with their range, and the median figures.
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
    def get(self, key: str) -> bytes:
        raise NotImplementedError
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


def measure(system: System, size: int, batch: int, iters: int, reps: int, tag: str = ""
            ) -> dict[str, Any]:
    values = [os.urandom(size) for _ in range(4)]
    keys = [f"bench/{tag}/{size}/{i}" for i in range(iters)]
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
    bkeys = [[f"bench/{tag}/b{size}/{r}/{i}" for i in range(batch)] for r in range(reps)]
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


def stopper(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    """A cleanup that stops ``proc`` and reaps it."""
    def stop() -> None:
        proc.terminate()
        proc.wait()
    return stop


def start_kvctl_process(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``kvctl store ARGS --json`` in the background; the process and its master address."""
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "store", *args, "--json"],
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
    raise RuntimeError(f"kvctl store {args[0]} did not start")


def start_kvctl(capacity: str) -> tuple[subprocess.Popen[bytes], str]:
    """``kvctl store serve``: master and node in one process (gets take attached bytes)."""
    return start_kvctl_process(["serve", "--listen", "127.0.0.1:0", "--capacity", capacity])


def start_kvctl_split(capacity: str) -> tuple[list[subprocess.Popen[bytes]], str]:
    """``kvctl store master`` and ``kvctl store node`` as two processes, as on many hosts."""
    master, address = start_kvctl_process(["master", "--listen", "127.0.0.1:0"])
    try:
        node, _ = start_kvctl_process(["node", "--master", address, "--capacity", capacity])
    except BaseException:
        master.terminate()
        master.wait()
        raise
    return [node, master], address


SYSTEMS = ("kvctl/tcp", "kvctl/tcp-split", "kvctl/shm", "mooncake", "mooncake/local", "redis")


def make_system(name: str, address: str, batch: int, max_size: int) -> System:
    """The client of ``name`` talking to the server at ``address``."""
    if name.startswith("kvctl/"):
        system: System = KvctlSystem("auto" if name == "kvctl/shm" else "tcp", address,
                                     batch, max_size)
        system.name = name
        return system
    if name == "mooncake":  # a client contributing no memory; storage is another process
        return MooncakeSystem(name, address, 0, batch, max_size)
    if name == "mooncake/local":  # this process contributes the memory
        return MooncakeSystem(name, address, 1 << 30, batch, max_size)
    if name == "redis":
        return RedisSystem(int(address.rpartition(":")[2]))
    raise ValueError(f"unknown system {name!r}")


def worker_main(name: str, address: str, batch: int, max_size: int) -> int:
    """Serve measurement commands (JSON lines on stdin) with one system's client; results
    go to stdout as ``RESULT {json}`` lines (libraries may print other lines)."""
    system = make_system(name, address, batch, max_size)
    print("READY", flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            result = measure(system, cmd["size"], batch, cmd["iters"], cmd["reps"], cmd["tag"])
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        system.close()
    return 0


class Worker:
    """One system's client in its own process (Mooncake allows one store per process; own
    processes also keep each client's threads and memory from disturbing the others')."""

    def __init__(self, name: str, address: str, batch: int, max_size: int) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", name, "--address", address,
             "--batch", str(batch), "--max-size", str(max_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"benchmark worker {self.name} exited "
                           f"(status {self.proc.wait()})")

    def measure(self, size: int, iters: int, reps: int, tag: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"size": size, "iters": iters, "reps": reps,
                                          "tag": tag}) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._expect("RESULT ")))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4KiB,64KiB,1MiB,4MiB")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds per size (ratios are paired per round)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--max-size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    if args.worker:
        return worker_main(args.worker, args.address, args.batch, args.max_size)
    sizes = parse_size_list(args.sizes)
    wanted = [w for w in args.systems.split(",") if w]
    unknown = [w for w in wanted if w not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "redis" in wanted and not shutil.which("redis-server"):
        print("redis-server not found: skipping redis", file=sys.stderr)
        wanted.remove("redis")

    def iters_for(size: int) -> int:
        base = 200 if size <= 64 << 10 else 40 if size <= 1 << 20 else 20
        return max(10, base // 4) if args.quick else base

    reps = 3 if args.quick else 5
    rounds: dict[str, dict[int, list[dict[str, float]]]] = {w: {s: [] for s in sizes}
                                                             for w in wanted}
    cleanups: list[Callable[[], None]] = []
    try:
        addresses: dict[str, str] = {}
        if "kvctl/tcp" in wanted or "kvctl/shm" in wanted:
            kproc, kaddress = start_kvctl("1GiB")
            cleanups.append(stopper(kproc))
            addresses.update({"kvctl/tcp": kaddress, "kvctl/shm": kaddress})
        if "kvctl/tcp-split" in wanted:
            sprocs, saddress = start_kvctl_split("1GiB")
            cleanups.extend(stopper(q) for q in sprocs)
            addresses["kvctl/tcp-split"] = saddress
        if "mooncake" in wanted or "mooncake/local" in wanted:
            from kvctl.store.mooncake import MooncakeMaster
        if "mooncake" in wanted:
            mc = MooncakeMaster(storage_bytes=1 << 30)  # + a storage process of 1 GiB
            cleanups.append(mc.close)
            addresses["mooncake"] = mc.address
        if "mooncake/local" in wanted:
            mc_local = MooncakeMaster()
            cleanups.append(mc_local.close)
            addresses["mooncake/local"] = mc_local.address
        if "redis" in wanted:
            rproc, raddress = start_redis()
            cleanups.append(stopper(rproc))
            addresses["redis"] = raddress
        workers = [Worker(w, addresses[w], args.batch, max(sizes)) for w in wanted]
        cleanups.extend(w.close for w in workers)
        for size in sizes:
            for r in range(args.rounds):
                # Interleaved, the order rotated each round: every system sees the same
                # load on a shared machine, and no system always runs first.
                order = workers[r % len(workers):] + workers[:r % len(workers)]
                for worker in order:
                    row = worker.measure(size, iters_for(size), reps, f"r{r}")
                    rounds[worker.name][size].append(row)
                    print(f"{worker.name:15s} {size:>8d} B round {r}  " + "  ".join(
                        f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    finally:
        for fn in reversed(cleanups):
            fn()
    medians = {name: {size: {k: statistics.median(row[k] for row in per[size])
                             for k in per[size][0]} for size in sizes if per[size]}
               for name, per in rounds.items()}
    ratios = paired_ratios(rounds, sizes)
    report(medians, ratios, sizes)
    if args.json:
        args.json.write_text(json.dumps({
            "rounds": {s: {str(k): v for k, v in r.items()} for s, r in rounds.items()},
            "medians": {s: {str(k): v for k, v in r.items()} for s, r in medians.items()},
            "ratios": ratios}, indent=2))
    return 0


#: (ratio name, metric, True when a lower metric is better)
RATIOS = (("get_p50", "get_p50_ms", True), ("put_p50", "put_p50_ms", True),
          ("batch_get", "batch_get_gbps", False), ("batch_put", "batch_put_gbps", False))


def paired_ratios(rounds: dict[str, dict[int, list[dict[str, float]]]], sizes: list[int]
                  ) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per kvctl path and size: [median, min, max] over rounds of kvctl/baseline, each round's
    figures against the baseline's figures of the same round."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    pairs = [(k, "mooncake", name, metric) for k in ("kvctl/tcp", "kvctl/tcp-split",
                                                     "kvctl/shm")
             for name, metric, _ in RATIOS]
    pairs.append(("kvctl/shm", "mooncake/local", "batch_get_vs_local", "batch_get_gbps"))
    for kvctl, base, name, metric in pairs:
        if kvctl not in rounds or base not in rounds:
            continue
        for size in sizes:
            values = [k[metric] / b[metric] for k, b in zip(rounds[kvctl][size],
                                                            rounds[base][size], strict=False)
                      if b[metric] > 0]
            if values:
                out.setdefault(kvctl, {}).setdefault(str(size), {})[name] = [
                    statistics.median(values), min(values), max(values)]
    return out


def report(medians: dict[str, dict[int, dict[str, float]]],
           ratios: dict[str, dict[str, dict[str, list[float]]]], sizes: list[int]) -> None:
    cols = ["get_p50_ms", "get_p99_ms", "put_p50_ms", "put_p99_ms", "batch_get_gbps",
            "batch_put_gbps"]
    print("\nmedians over rounds")
    print(f"{'system':15s} {'size':>8s} " + " ".join(f"{c:>15s}" for c in cols))
    for name, per in medians.items():
        for size in sizes:
            row = per.get(size)
            if row:
                print(f"{name:15s} {size:>8d} " + " ".join(f"{row[c]:15.3f}" for c in cols))
    if not ratios:
        return
    print("\nratios vs Mooncake, paired per round: median (min-max)  [targets: p50 <= 0.8x, "
          "batch >= 1.5x; shm batch get >= mooncake/local]")
    for name, by_size in ratios.items():
        for size in sizes:
            got = by_size.get(str(size))
            if not got:
                continue
            line = f"{name:15s} {size:>8d} "
            for key, (med, lo, hi) in got.items():
                line += f" {key} {med:.2f}x ({lo:.2f}-{hi:.2f})"
            print(line)


if __name__ == "__main__":
    sys.exit(main())
