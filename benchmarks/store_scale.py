"""The store's cost against object count, side by side with Mooncake Store, in one run.

Not a test: run it by hand, alone on the machine (it fills up to millions of objects)::

    .venv/bin/python benchmarks/store_scale.py --counts 10000,100000,1000000 \\
        --core-only 1000000,10000000 --etcd etcd://127.0.0.1:2379 \\
        --json scale.json --plot docs/store-scale.png
    .venv/bin/python benchmarks/store_scale.py --counts "" --systems "" --states "" \\
        --core-only 10000000                  # the master alone

End to end, per object count N and system (every server in its own process, the client
in this one, TCP data path for both):

- ``kvctl``: ``kvctl store master`` (state ``none``) + one ``kvctl store node``;
- ``mooncake``: ``mooncake_master`` + one ``mooncake_client`` storage process, the client
  contributing no memory.

N objects of 1-4 KiB are put in batches of 512 (plus 100 keys under ``hot/``) while a
probe process calls ``exists`` every 5 ms: the longest call it saw is the longest pause
any client saw during the fill. Then: the master's RSS growth per object, single
put/get/exists p50 and p99 (1,000 each), a 100-key prefix ``list`` and ``status`` p50
(kvctl only: Mooncake has neither), and objects lost (must be 0). For kvctl the fill is
repeated with journal state and with etcd state (``--etcd``, counts up to
``--etcd-max``): puts/s, then the master is SIGKILLed and restarted on its port and the
time until every object is back and its node alive is the restart time; 1,000 objects are
read back and compared byte for byte. Mooncake's master keeps no state without HA, so it
has no restart figure.

``--core-only N`` fills a ``MasterCore`` in this process (no network, no bytes) with
journal state: bytes per object, the longest garbage collection during the fill and one
full collection after it, status and list latency, a snapshot, a restart (restore) time.
That is how 10^7 is measured: end to end, 10^7 objects of 1-4 KiB need 25 GB of node
memory, more than this machine has.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH = 512
HOT = 100
POOL = random.Random(20).randbytes(8192)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def key_of(i: int) -> str:
    return f"scale/{i:08d}"


def value_of(i: int) -> bytes:
    """1-4 KiB, deterministic (so a read after a restart can be checked)."""
    size = 1024 + (i * 2654435761) % 3072
    off = (i * 40503) % 4096
    return POOL[off:off + size]


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


# ---------------------------------------------------------------- systems


class Kvctl:
    name = "kvctl"

    def __init__(self, state: str = "none", env: dict[str, str] | None = None,
                 capacity: int = 1 << 30) -> None:
        self.state = state
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.capacity = capacity
        self.master = self._start_master()
        self.node = self._spawn(["node", "--master", self.address, "--node-id", "n0",
                                 "--capacity", str(capacity)])
        from kvctl.store.client import StoreClient

        self.client = StoreClient(self.address, transport="tcp", timeout_s=60)
        self.wait_alive()

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "kvctl", "store", *args, "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env)
        text = ""
        deadline = time.monotonic() + 600
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"kvctl store {args[0]} exited with {proc.returncode}")
            text += line
            with contextlib.suppress(ValueError):
                json.loads(text)
                return proc
        proc.kill()
        raise RuntimeError(f"kvctl store {args[0]} did not start")

    def _start_master(self) -> subprocess.Popen[bytes]:
        return self._spawn(["master", "--listen", self.address, "--state", self.state])

    def wait_alive(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                nodes = self.client.status().nodes
                if nodes and all(n.alive for n in nodes):
                    return
            time.sleep(0.05)
        raise RuntimeError("the node did not come alive")

    @property
    def master_pid(self) -> int:
        return self.master.pid

    def batch_put(self, items: list[tuple[str, bytes]]) -> None:
        result = self.client.batch_put(items)
        bad = [r for r in result if r is not None]
        if bad:
            raise RuntimeError(f"kvctl batch_put: {bad[0]}")

    def put(self, key: str, value: bytes) -> None:
        self.client.put(key, value)

    def get(self, key: str) -> bytes:
        return self.client.get(key)

    def exists(self, key: str) -> bool:
        return self.client.exists(key)

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return self.client.batch_exists(keys)

    def list_hot(self) -> int:
        return len(self.client.list("hot/", limit=HOT)[0])

    def status(self) -> int:
        return self.client.status().objects

    def restart(self) -> float:
        """SIGKILL the master, start it again on its port; seconds until every object is
        back and the node alive again."""
        self.master.send_signal(signal.SIGKILL)
        self.master.wait()
        started = time.monotonic()
        self.master = self._start_master()
        self.wait_alive()
        return time.monotonic() - started

    def close(self) -> None:
        self.client.close()
        for proc in (self.node, self.master):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


class Mooncake:
    name = "mooncake"

    def __init__(self, capacity: int) -> None:
        from kvctl.store.mooncake import MooncakeMaster, MooncakeStore

        self.server = MooncakeMaster(storage_bytes=capacity, eviction_high_watermark=0.99)
        self.address = self.server.address
        self.store = MooncakeStore(self.address, local_buffer_bytes=256 << 20)
        self.buf = mmap.mmap(-1, BATCH * 4096)
        self.base = self.store.register_buffer(self.buf)

    @property
    def master_pid(self) -> int:
        return int(self.server._proc.pid)

    def batch_put(self, items: list[tuple[str, bytes]]) -> None:
        """Mooncake's zero-copy batch put from a registered buffer (its fastest path)."""
        addresses, sizes = [], []
        for slot, (_, value) in enumerate(items):
            self.buf[slot * 4096:slot * 4096 + len(value)] = value
            addresses.append(self.base + slot * 4096)
            sizes.append(len(value))
        rc = self.store.batch_put_from([k for k, _ in items], addresses, sizes)
        if any(r != 0 for r in rc):
            raise RuntimeError(f"mooncake batch_put_from: {[r for r in rc if r][:3]}")

    def put(self, key: str, value: bytes) -> None:
        self.store.put(key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return self.store.batch_exists(keys)

    def close(self) -> None:
        self.store.close()
        self.buf.close()
        self.server.close()


# ---------------------------------------------------------------- probe


def _probe_main(system: str, address: str, key: str, stop: Any, out: Any) -> None:
    """Call exists on ``key`` every 5 ms until ``stop``; report the longest call."""
    if system == "kvctl":
        from kvctl.store.client import StoreClient

        client: Any = StoreClient(address, transport="tcp", timeout_s=120)
        call: Callable[[], object] = lambda: client.exists(key)  # noqa: E731
    else:
        from kvctl.store.mooncake import MooncakeStore

        client = MooncakeStore(address, local_buffer_bytes=16 << 20)
        call = lambda: client.exists(key)  # noqa: E731
    times: list[float] = []
    while not stop.is_set():
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
        time.sleep(0.005)
    client.close()
    out.put({"max_ms": max(times) * 1000, "p99_ms": pct(times, 0.99) * 1000,
             "calls": len(times)})


@contextlib.contextmanager
def probing(system: str, address: str, key: str) -> Iterator[dict[str, float]]:
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_probe_main, args=(system, address, key, stop, out), daemon=True)
    proc.start()
    result: dict[str, float] = {}
    try:
        time.sleep(1.0)  # its connection is up
        yield result
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            result.update(out.get(timeout=60))
        proc.join(30)


# ---------------------------------------------------------------- one run


def fill(system: Any, n: int) -> float:
    """Put ``n`` objects and the ``hot/`` keys; puts per second."""
    started = time.monotonic()
    for i in range(0, n, BATCH):
        system.batch_put([(key_of(j), value_of(j)) for j in range(i, min(n, i + BATCH))])
    system.batch_put([(f"hot/{j:04d}", value_of(j)) for j in range(HOT)])
    return (n + HOT) / (time.monotonic() - started)


def timed(fn: Callable[[], object], count: int) -> tuple[float, float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return pct(times, 0.5) * 1000, pct(times, 0.99) * 1000


def lost(system: Any, n: int) -> int:
    missing = 0
    for i in range(0, n, 4096):
        keys = [key_of(j) for j in range(i, min(n, i + 4096))]
        missing += sum(1 for ok in system.batch_exists(keys) if not ok)
    return missing


def wrong_bytes(system: Any, n: int, samples: int = 1000) -> int:
    rng = random.Random(n)
    return sum(1 for i in (rng.randrange(n) for _ in range(samples))
               if system.get(key_of(i)) != value_of(i))


def measure(system: Any, n: int) -> dict[str, Any]:
    rng = random.Random(7)
    before = rss(system.master_pid)
    with probing(system.name, system.address, "hot/none") as probe:
        rate = fill(system, n)
    after = rss(system.master_pid)
    row: dict[str, Any] = {"n": n, "puts_per_s": rate,
                           "bytes_per_object": (after - before) / (n + HOT),
                           "fill_max_ms": probe.get("max_ms"), "fill_p99_ms": probe.get("p99_ms")}
    fresh = iter(range(n + 10, n + 10_000_000))
    row["put_p50_ms"], row["put_p99_ms"] = timed(
        lambda: system.put(key_of(next(fresh)), value_of(7)), 1000)
    row["get_p50_ms"], row["get_p99_ms"] = timed(
        lambda: system.get(key_of(rng.randrange(n))), 1000)
    row["exists_p50_ms"], row["exists_p99_ms"] = timed(
        lambda: system.exists(key_of(rng.randrange(n))), 1000)
    if isinstance(system, Kvctl):
        row["list_p50_ms"], _ = timed(system.list_hot, 50)
        row["status_p50_ms"], _ = timed(system.status, 50)
        assert system.list_hot() == HOT
    row["lost"] = lost(system, n)
    row["wrong"] = wrong_bytes(system, n)
    return row


def measure_state(state: str, n: int, env: dict[str, str]) -> dict[str, Any]:
    capacity = max(64 << 20, int(n * 4096 * 1.15))
    system = Kvctl(state, env, capacity)
    try:
        rate = fill(system, n)
        # Acknowledged: the master answered a later request on the fill's connection (it
        # takes that thread's requests in order, after the reports are durable).
        system.status()
        restart_s = system.restart()
        return {"n": n, "state": "etcd" if "://" in state else "journal", "puts_per_s": rate,
                "restart_s": restart_s, "lost": lost(system, n),
                "wrong": wrong_bytes(system, n), "load_average": os.getloadavg()[0]}
    finally:
        system.close()


def forget_etcd_state(url: str, cluster_id: str) -> int:
    """Delete a run's keys from etcd (the next run starts on an etcd as empty as this
    one did); etcd's database size before, bytes."""
    from kvctl.metadata import key_prefix, open_metadata
    from kvctl.metadata.etcd import EtcdMetadata, prefix_range_end

    with open_metadata(url, timeout_s=120) as meta:
        assert isinstance(meta, EtcdMetadata)
        host, port = meta.endpoints()[0]
        request = urllib.request.Request(f"http://{host}:{port}/v3/maintenance/status",
                                         data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=30) as reply:
            db_bytes = int(json.loads(reply.read()).get("dbSize", 0))
        prefix = key_prefix(cluster_id)
        meta.write_batch([], delete_ranges=[(prefix, prefix_range_end(prefix.encode()).decode())])
    return db_bytes


# ---------------------------------------------------------------- core only


def core_only(n: int) -> dict[str, Any]:
    from kvctl.store import protocol as p
    from kvctl.store.master import MasterConfig, MasterCore
    from kvctl.store.state import JournalState

    pauses: list[float] = []
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif info["generation"] in started:
            pauses.append(time.perf_counter() - started.pop(info["generation"]))

    directory = Path(tempfile.mkdtemp(prefix="kvctl-scale-"))
    proc = psutil.Process()
    try:
        gc.collect()
        base = proc.memory_info().rss
        gc.callbacks.append(on_gc)
        master = MasterCore(MasterConfig(node_timeout_s=3.0),
                            state=JournalState(directory / "state"))
        master.register_node(p.RegisterNode(node_id="n0", epoch="e", segment="s",
                                          endpoint="127.0.0.1:1", host_id="h",
                                          capacity_bytes=n * 4096 + (1 << 30)))
        t0 = time.monotonic()
        for i in range(0, n, 1000):
            keys = [key_of(j) for j in range(i, min(n, i + 1000))]
            slots = master.put(p.Put(items=[p.PutItem(k, len(value_of(j)), j)
                                          for j, k in enumerate(keys, start=i)]))
            master.commit(p.Commit(keys=keys, versions=[s.version for s in slots
                                                        if isinstance(s, p.PutSlot)]))
            master.state.sync()
            if i % 100_000 == 0:
                master.heartbeat(p.Heartbeat(node_id="n0", epoch="e"))
                master.tick(budget_s=0.05)
        fill_s = time.monotonic() - t0
        gc.callbacks.remove(on_gc)
        row: dict[str, Any] = {"n": n, "puts_per_s": n / fill_s,
                               "gc_max_ms": max(pauses, default=0.0) * 1000,
                               "gc_collections": len(pauses)}
        t0 = time.perf_counter()
        gc.collect()
        row["full_gc_ms"] = (time.perf_counter() - t0) * 1000
        row["bytes_per_object"] = (proc.memory_info().rss - base) / n
        row["status_p50_ms"], _ = timed(master.status, 50)
        row["list_p50_ms"], _ = timed(lambda: master.list_objects("scale/0000", 100), 50)
        t0 = time.monotonic()
        snap = master.state.start_snapshot([n.record() for n in master._nodes.values()])
        assert snap is not None
        from kvctl.store.master.core import SnapshotJob

        job = SnapshotJob(master, snap)
        while not job.step(master.config.slice_objects):
            job.after(finished=False)
        job.after(finished=True)
        row["snapshot_s"] = time.monotonic() - t0
        master.close()
        gc.collect()
        t0 = time.monotonic()
        restored = MasterCore(MasterConfig(node_timeout_s=3.0),
                              state=JournalState(directory / "state"))
        row["restore_s"] = time.monotonic() - t0
        row["lost"] = n - restored.status().objects
        restored.close()
        return row
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.3f}" if isinstance(v, float) and abs(v) < 100 else f"{v:,.0f}"


def report(rows: list[dict[str, Any]], states: list[dict[str, Any]]) -> None:
    cols = ["bytes_per_object", "puts_per_s", "fill_max_ms", "put_p50_ms", "put_p99_ms",
            "get_p50_ms", "get_p99_ms", "exists_p50_ms", "exists_p99_ms", "list_p50_ms",
            "status_p50_ms", "lost", "wrong"]
    by = {(r["system"], r["n"]): r for r in rows}
    for n in sorted({r["n"] for r in rows}):
        print(f"\n== {n:,} objects")
        print(f"{'':18}{'kvctl':>12}{'mooncake':>12}{'kvctl/mc':>10}")
        k, m = by.get(("kvctl", n), {}), by.get(("mooncake", n), {})
        for c in cols:
            kv, mv = k.get(c), m.get(c)
            print(f"{c:18}{_fmt(kv):>12}{_fmt(mv):>12}{ratio(kv, mv):>10}")
    for s in states:
        print(f"state {s['state']:8} {s['n']:>9,}: {s['puts_per_s']:,.0f} puts/s, restart "
              f"{s['restart_s']:.1f} s, lost {s['lost']}, wrong {s['wrong']} (load average "
              f"{s['load_average']:.1f})")


def plot(rows: list[dict[str, Any]], states: list[dict[str, Any]], core: list[dict[str, Any]],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("bytes_per_object", "master bytes / object"),
              ("fill_max_ms", "longest client call during fill (ms)"),
              ("get_p50_ms", "get p50 (ms)")]
    for ax, (col, title) in zip(axes, panels, strict=True):
        for system, style in (("kvctl", "o-"), ("mooncake", "s--")):
            pts = sorted((r["n"], r[col]) for r in rows if r["system"] == system
                         and r.get(col) is not None)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=system)
        if col == "bytes_per_object" and core:
            pts = sorted((r["n"], r[col]) for r in core)
            ax.plot(*zip(*pts, strict=True), "^:", label="kvctl master core only")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("objects")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--counts", default="10000,100000,1000000")
    ap.add_argument("--systems", default="kvctl,mooncake")
    ap.add_argument("--states", default="journal,etcd", help="kvctl state backends to restart")
    ap.add_argument("--etcd", default="", help="etcd URL for --states etcd (skipped if unset)")
    ap.add_argument("--etcd-max", type=int, default=1_000_000)
    ap.add_argument("--core-only", default="", help="object counts for the in-process master")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",") if c]
    rows: list[dict[str, Any]] = []
    states: list[dict[str, Any]] = []
    core: list[dict[str, Any]] = []
    for n in [int(c) for c in args.core_only.split(",") if c]:
        row = core_only(n)
        print(json.dumps(row), flush=True)
        core.append(row)
    for n in counts:
        capacity = max(64 << 20, int(n * 4096 * 1.15))
        for name in args.systems.split(","):
            if not name:
                continue
            system = Kvctl(capacity=capacity) if name == "kvctl" else Mooncake(capacity)
            try:
                row = {"system": name, **measure(system, n)}
            finally:
                system.close()
            print(json.dumps(row), flush=True)
            rows.append(row)
        tmp = Path(tempfile.mkdtemp(prefix="kvctl-scale-state-"))
        try:
            for state in args.states.split(","):
                if state == "journal":
                    spec, env = str(tmp / f"journal-{n}"), {}
                elif state == "etcd" and args.etcd and n <= args.etcd_max:
                    spec, env = args.etcd, {"KVCTL_CLUSTER_ID": f"scale-{n}-{os.getpid()}"}
                else:
                    continue
                try:
                    srow = measure_state(spec, n, env)
                finally:
                    db_bytes = (forget_etcd_state(spec, env["KVCTL_CLUSTER_ID"])
                                if state == "etcd" else None)
                if db_bytes is not None:
                    srow["etcd_db_bytes"] = db_bytes
                print(json.dumps(srow), flush=True)
                states.append(srow)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    report(rows, states)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "states": states, "core": core},
                                        indent=1))
    if args.plot and (rows or core):
        plot(rows, states, core, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
