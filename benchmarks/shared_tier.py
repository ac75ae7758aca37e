"""Shared tier: a get from another host against plain ``os.pread`` of the same file, and
put throughput with write-through on and off.

Two namespaced hosts share one directory (the "distributed file system"; here a local
disk, so reads come from the page cache, the best case for the filesystem's bound). Host A
runs ``kvctl store master --shared-tier DIR`` and a node; host B runs the clients.

- **get**: objects of 64 KiB, 1 MiB and 4 MiB are put with write-through, their node is
  killed (so only the shared tier holds them) and host B gets them with a
  ``StoreClient`` (a master round trip, then the client reads and verifies the file),
  interleaved with the same files read by plain ``open`` + ``os.pread`` of the whole file
  + ``close`` (the filesystem's bound, no master, no verification). Also shown: the
  client's file read alone (header check + checksum, no master). Goal: get >= 0.8x pread.
- **batched get** (``--batches 16,64,256``): ``batch_get`` / ``batch_get_into`` of N
  tier-only 64 KiB objects (one master answer, then the files; on the client's threads
  when worth it, and on one thread), per object, against bare loops over the same files:
  ``pread`` with each result dropped (one cache-hot buffer), with the N results kept (on
  one thread and on the client's), and ``preadv`` into the same N buffers; and the
  master's answer alone. Ratios are throughput per object.
- **put**: 1 MiB and 64 KiB puts/s from host B against a master with write-through, with
  write-back (nothing evicted: no tier write) and with no shared tier; the tier must not
  slow puts.

Needs root (namespaces). Prints a markdown table; ``--out`` writes JSON.

- **index** (``--index N``, no root): the master's bytes per object for N objects held
  only in the shared tier (each in its own file, and packed 64 to a file), against N held
  in DRAM, each restored from a journal into a fresh process (RSS after restore minus RSS
  before; what a master restart costs).

    sudo .venv/bin/python benchmarks/shared_tier.py --rounds 3
    sudo .venv/bin/python benchmarks/shared_tier.py --rounds 3 --objects 8 --no-puts
    .venv/bin/python benchmarks/shared_tier.py --index 1000000
    .venv/bin/python benchmarks/shared_tier.py --packing /mnt/dfs/scratch

- **packing** (``--packing DIR``, no root): when packing small objects into one file would
  pay: per object, writing 64 objects as 64 files (temporary name, fsync, rename) against
  one packed file of all 64, and reading each file (open, read, verify, close) against
  reading each from one open packed file, by object size, on DIR's file system.
- **packed tier** (``--packed N``, root): the store itself with packing off and on
  (``--shared-tier-pack-below 256KiB``): host B puts N objects of 16 KiB and of 64 KiB
  with write-through, 32 to a ``batch_put``, as fast as the store takes them; puts/s,
  objects that got their copy (a node queues at most 32 copy writes: past that a copy is
  skipped, made at eviction instead), copies landed per second, files written (one fsync
  each); then 256 more are put 32 at a time (each group's copies waited for), the node is
  killed and host B gets those back with ``batch_get`` of 64 keys (per object, from the
  tier only).

    sudo .venv/bin/python benchmarks/shared_tier.py --packed 2048 --put-rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.hosts import read_json_doc, stop  # noqa: E402
from tests.fixtures.nshosts import Host, HostNet  # noqa: E402

PORT = 50071
SIZES = (64 << 10, 1 << 20, 4 << 20)
#: object size of the batched gets, and batch sizes measured by default
BATCH_SIZE = 64 << 10
BATCHES = (16, 64, 256)
GOAL = 0.8

#: host B: time gets of shared-only objects against plain preads of their files: one key per
#: get, then batches of 64 KiB objects (one master round trip for N keys, then the files).
GETS = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.sharedtier.fileformat import file_name
master, root, rounds, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sizes = [int(s) for s in sys.argv[5].split(",")]
batches, brounds = [int(s) for s in sys.argv[6].split(",") if s], int(sys.argv[7])
BATCH_SIZE = 64 << 10


def files(c, keys):
    infos = [c.stat(k) for k in keys]
    assert all("shared" in i.tier for i in infos), [i.tier for i in infos]
    paths = [os.path.join(root, file_name(k, i.version)) for k, i in zip(keys, infos)]
    return infos, paths


def bare(path, size):  # the file system's bound: open, one pread of the whole file, close
    fd = os.open(path, os.O_RDONLY); raw = os.pread(fd, size + 4200, 0); os.close(fd)
    return raw


def bare_all(paths, size):  # ... of N files, keeping the N results (as a batch_get does)
    return [bare(path, size) for path in paths]


out = {"single": {}, "batch": {}, "load": os.getloadavg()}
with StoreClient(master, lease=False) as c:
    threads = getattr(c.shared, "threads", 1)
    for size in sizes:
        keys = [f"g{size}-{i}" for i in range(count)]
        infos, paths = files(c, keys)
        slots = [p.GetSlot(key=k, size=i.size, checksum=i.checksum, version=i.version,
                           locations=[], shared=path) for k, i, path in zip(keys, infos, paths)]
        get, pread, fileonly, into, preadv = [], [], [], [], []
        buf = bytearray(size + 4200); view = memoryview(buf)
        for _ in range(rounds):
            for k, path, slot in zip(keys, paths, slots):
                t = time.perf_counter(); data = c.get(k); get.append(time.perf_counter() - t)
                assert len(data) == size
                t = time.perf_counter(); raw = bare(path, size)
                pread.append(time.perf_counter() - t)
                assert len(raw) > size
                t = time.perf_counter(); got = c.shared.read(k, slot, None)
                fileonly.append(time.perf_counter() - t)
                assert got == data
                t = time.perf_counter(); n = c.get_into(k, view)
                into.append(time.perf_counter() - t)
                assert n == size
                t = time.perf_counter()
                fd = os.open(path, os.O_RDONLY); n = os.preadv(fd, [view], 0); os.close(fd)
                preadv.append(time.perf_counter() - t)
                assert n > size
        out["single"][size] = {"get_s": get, "pread_s": pread, "file_read_s": fileonly,
                               "get_into_s": into, "preadv_s": preadv}
    if batches:
        keys = [f"b{i}" for i in range(max(batches))]
        _, paths = files(c, keys)
        arena = bytearray(BATCH_SIZE * len(keys)); whole = memoryview(arena)
        views = [whole[i * BATCH_SIZE:(i + 1) * BATCH_SIZE] for i in range(len(keys))]
        pool = ThreadPoolExecutor(threads)
        for n in batches:
            seen = {m: [] for m in ("batch_get_s", "batch_get_1thread_s", "pread_loop_s",
                                    "pread_kept_s", "pread_threads_s", "batch_get_into_s",
                                    "preadv_loop_s", "master_s")}
            ask = p.Get(keys=[c.namespace + k for k in keys[:n]], lease=False)
            for _ in range(brounds):  # per object, interleaved
                t = time.perf_counter(); got = c.batch_get(keys[:n])
                seen["batch_get_s"].append((time.perf_counter() - t) / n)
                assert all(isinstance(g, bytes) and len(g) == BATCH_SIZE for g in got)
                del got
                t = time.perf_counter()
                for path in paths[:n]:
                    bare(path, BATCH_SIZE)
                seen["pread_loop_s"].append((time.perf_counter() - t) / n)
                t = time.perf_counter(); got = bare_all(paths[:n], BATCH_SIZE)
                seen["pread_kept_s"].append((time.perf_counter() - t) / n)
                del got
                cut = [n * j // threads for j in range(threads + 1)]
                t = time.perf_counter()
                got = [f.result() for f in [pool.submit(bare_all, paths[cut[j]:cut[j + 1]],
                                                        BATCH_SIZE) for j in range(threads)]]
                seen["pread_threads_s"].append((time.perf_counter() - t) / n)
                del got
                c.shared.threads = 1
                t = time.perf_counter(); got = c.batch_get(keys[:n])
                seen["batch_get_1thread_s"].append((time.perf_counter() - t) / n)
                c.shared.threads = threads
                t = time.perf_counter(); got = c.batch_get_into(keys[:n], views[:n])
                seen["batch_get_into_s"].append((time.perf_counter() - t) / n)
                assert got == [BATCH_SIZE] * n, got
                t = time.perf_counter()
                for path, v in zip(paths[:n], views[:n]):
                    fd = os.open(path, os.O_RDONLY); os.preadv(fd, [v], 0); os.close(fd)
                seen["preadv_loop_s"].append((time.perf_counter() - t) / n)
                t = time.perf_counter(); c._call(ask)  # the master's share alone
                seen["master_s"].append((time.perf_counter() - t) / n)
            out["batch"][n] = seen
        pool.shutdown()
    out["threads"] = threads
    out["load_after"] = os.getloadavg()
print(json.dumps(out))
"""

#: host B: puts/s of one client, per size.
PUTS = r"""
import json, os, sys, time
from kvctl.store.client import StoreClient
master, count = sys.argv[1], int(sys.argv[2])
out = {}
with StoreClient(master) as c:
    for size, n in ((1 << 20, count), (64 << 10, 4 * count)):
        values = [os.urandom(size) for _ in range(16)]
        for i in range(8):
            c.put(f"warm-{i}", values[i % 16])
        t = time.perf_counter()
        for i in range(n):
            c.put(f"p{size}-{i}", values[i % 16])
        out[size] = n / (time.perf_counter() - t)
print(json.dumps(out))
"""

#: host B: put the get objects, 16 (at most 32 MiB) at a time, each group waiting for its
#: write-through copies (a burst past the node's queue of copies would skip some: they
#: would be written at eviction instead). argv: master, then (prefix, size, count) triples.
FILL = r"""
import os, sys, time
from kvctl.store.client import StoreClient
master, groups = sys.argv[1], sys.argv[2:]
with StoreClient(master) as c:
    for g in range(0, len(groups), 3):
        prefix, size, count = groups[g], int(groups[g + 1]), int(groups[g + 2])
        step = max(1, min(16, (32 << 20) // size))
        for start in range(0, count, step):
            keys = [f"{prefix}{i}" for i in range(start, min(count, start + step))]
            for k in keys:
                c.put(k, os.urandom(size))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                    "shared" in c.stat(k).tier for k in keys):
                time.sleep(0.02)
"""


def _master(host: Host, tier: Path | None = None, policy: str = "write-back",
            pack_below: str = "0") -> Any:
    env = {"KVCTL_STORE_SHARED_TIER": str(tier), "KVCTL_STORE_SHARED_TIER_POLICY": policy,
           "KVCTL_STORE_SHARED_TIER_PACK_BELOW": pack_below} if tier is not None else {}
    proc = host.popen(["kvctl", "-q", "store", "master", "--listen",
                       f"{host.address}:{PORT}", "--json"], env=env)
    read_json_doc(proc)
    return proc


def _node(host: Host, capacity: str) -> Any:
    return host.popen(["kvctl", "-q", "store", "node", "--master", f"{host.address}:{PORT}",
                       "--capacity", capacity, "--node-id", "bench-node"])


def _wait_alive(b: Host, master: str, alive: bool) -> None:
    script = ("import sys, time\nfrom kvctl.store.client import StoreClient\n"
              "c = StoreClient(sys.argv[1]); want = sys.argv[2] == '1'\n"
              "end = time.monotonic() + 30\n"
              "while time.monotonic() < end:\n"
              "    if any(n.alive for n in c.status().nodes) == want: sys.exit(0)\n"
              "    time.sleep(0.1)\nsys.exit(1)\n")
    done = b.run(["python3", "-c", script, master, "1" if alive else "0"], timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"node alive={alive} not reached: {done.stderr}")


def _run_json(host: Host, script: str, *args: str) -> Any:
    done = host.run(["python3", "-c", script, *args], timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout)


def bench_gets(net: HostNet, dfs: Path, rounds: int, count: int, batches: list[int],
               batch_rounds: int) -> dict[str, Any]:
    a, b = net[0], net[1]
    master = f"{a.address}:{PORT}"
    tier = dfs / "get-tier"
    mproc = _master(a, tier, "write-through")
    node = _node(a, "768MiB")
    try:
        _wait_alive(b, master, True)
        groups = [str(x) for size in SIZES for x in (f"g{size}-", size, count)]
        if batches:
            groups += ["b", str(BATCH_SIZE), str(max(batches))]
        done = b.run(["python3", "-c", FILL, master, *groups], timeout=600)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        node.kill()  # only the shared tier holds them now
        node.wait(timeout=10)
        _wait_alive(b, master, False)
        raw = _run_json(b, GETS, master, str(tier), str(rounds), str(count),
                        ",".join(str(s) for s in SIZES), ",".join(str(n) for n in batches),
                        str(batch_rounds))
    finally:
        stop(node)
        stop(mproc)
    single: dict[int, dict[str, float]] = {}
    for size in SIZES:
        r = raw["single"][str(size)]
        get, pread, fileonly, into, preadv = (statistics.median(r[k]) for k in (
            "get_s", "pread_s", "file_read_s", "get_into_s", "preadv_s"))
        single[size] = {"get_ms": get * 1e3, "pread_ms": pread * 1e3, "file_read_ms":
                        fileonly * 1e3, "get_vs_pread": pread / get,
                        "get_into_ms": into * 1e3, "preadv_ms": preadv * 1e3,
                        "get_into_vs_preadv": preadv / into,
                        "file_read_vs_pread": pread / fileonly,
                        "get_gbytes_per_s": size / get / 1e9,
                        "pread_gbytes_per_s": size / pread / 1e9}
    batch: dict[int, dict[str, float]] = {}
    for n in batches:
        r = {k: statistics.median(v) for k, v in raw["batch"][str(n)].items()}
        batch[n] = {k.removesuffix("_s") + "_us": v * 1e6 for k, v in r.items()}
        batch[n]["batch_get_vs_pread"] = r["pread_loop_s"] / r["batch_get_s"]
        batch[n]["batch_get_vs_pread_kept"] = r["pread_kept_s"] / r["batch_get_s"]
        batch[n]["batch_get_vs_pread_threads"] = r["pread_threads_s"] / r["batch_get_s"]
        batch[n]["batch_get_1thread_vs_pread"] = r["pread_loop_s"] / r["batch_get_1thread_s"]
        batch[n]["batch_get_into_vs_preadv"] = r["preadv_loop_s"] / r["batch_get_into_s"]
    return {"single": single, "batch": batch, "threads": raw["threads"],
            "load": [raw["load"], raw["load_after"]]}


def bench_puts(net: HostNet, dfs: Path, count: int, rounds: int
               ) -> dict[str, dict[int, float]]:
    """Median puts/s per mode and size over ``rounds`` interleaved rounds."""
    a, b = net[0], net[1]
    master = f"{a.address}:{PORT}"
    modes: dict[str, tuple[Path | None, str]] = {
        "write-through": (dfs / "put-wt", "write-through"),
        "write-back (no evictions)": (dfs / "put-wb", "write-back"),
        "no shared tier": (None, "write-back")}
    seen: dict[str, dict[int, list[float]]] = {m: {1 << 20: [], 64 << 10: []} for m in modes}
    for _ in range(rounds):
        for name, (tier, policy) in modes.items():
            mproc = _master(a, tier, policy)
            node = _node(a, "1GiB")
            try:
                _wait_alive(b, master, True)
                for size, rate in _run_json(b, PUTS, master, str(count)).items():
                    seen[name][int(size)].append(rate)
            finally:
                stop(node)
                stop(mproc)
            shutil.rmtree(dfs / "put-wt", ignore_errors=True)
    return {name: {size: statistics.median(v) for size, v in by.items()}
            for name, by in seen.items()}


#: a fresh process: restore the journal in argv[1] and print RSS growth per object.
RESTORE = r"""
import gc, json, sys, psutil
from pathlib import Path
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.sharedtier.config import SharedTierConfig
from kvctl.store.state import JournalState
state, tier, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
proc = psutil.Process(); gc.collect(); base = proc.memory_info().rss
core = MasterCore(MasterConfig(), JournalState(state),
                  shared_tier=SharedTierConfig(Path(tier)) if tier != "-" else None)
gc.collect()
grown = proc.memory_info().rss - base
st = core.status()
print(json.dumps({"objects": st.objects, "bytes_per_object": grown / n,
                  "shared_files": st.shared.files if st.shared else 0}))
core.close()
"""


def bench_index(n: int) -> dict[str, dict[str, float]]:
    """Master bytes per object, shared-tier only vs DRAM, after a restore of ``n``."""
    from kvctl.store.state import JournalState, NodeRecord, ObjectRecord, ReplicaRecord

    out: dict[str, dict[str, float]] = {}
    for tier_only, packed in ((True, False), (True, True), (False, False)):
        with tempfile.TemporaryDirectory(prefix="kvctl-index-", dir="/var/tmp") as work:
            state = JournalState(Path(work) / "state")
            state.put_node(NodeRecord("n0", "e0", "s0", "127.0.0.1:1", "h", n * 4096 + (1 << 30),
                                      0, "off"))
            for i in range(n):
                key = f"scale/{i:010d}/blk"
                replicas = [] if tier_only else [ReplicaRecord("n0", i * 4096, 4096, "e0")]
                # packed: 64 to a pack, ids as a master gives them (from its start time)
                pack = ((1_796_000_000 + i // 64) << 24 | (i % 64) * 8192) if packed else 0
                state.put_object(ObjectRecord(key, 4096, i, i + 1, replicas, [],
                                              shared=1 if tier_only else 0, pack=pack))
                if i % 100_000 == 0:
                    state.sync()
            state.ack()
            state.close()
            done = subprocess.run([sys.executable, "-c", RESTORE, str(Path(work) / "state"),
                                   str(Path(work) / "tier") if tier_only else "-", str(n)],
                                  capture_output=True, text=True, check=False,
                                  cwd=str(REPO))
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-3000:])
            name = "DRAM only" if not tier_only else (
                "shared only, packed 64 to a file" if packed else "shared only")
            out[name] = json.loads(done.stdout)
    return out


def bench_packing(directory: Path, count: int = 64) -> dict[int, dict[str, float]]:
    """Per object, files vs one packed file: write and read, microseconds."""
    import os

    from kvctl.fsafe import write_private_atomically
    from kvctl.store.checksum import checksum
    from kvctl.store.sharedtier.fileformat import file_name, read_bytes, write_object

    out: dict[int, dict[str, float]] = {}
    for size in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20):
        with tempfile.TemporaryDirectory(prefix="kvctl-pack-", dir=directory) as work:
            root = Path(work)
            values = [os.urandom(size) for _ in range(count)]
            sums = [checksum(v) for v in values]
            t = time.perf_counter()
            for i, v in enumerate(values):
                write_object(root / file_name(f"k{i}", 1), f"k{i}", 1, memoryview(v), sums[i],
                             "0" * 16)
            files_w = (time.perf_counter() - t) / count
            t = time.perf_counter()
            write_private_atomically(root / "pack", values, fsync=True)
            pack_w = (time.perf_counter() - t) / count
            t = time.perf_counter()
            for i in range(count):
                read_bytes(root / file_name(f"k{i}", 1), f"k{i}", 1, sums[i], size)
            files_r = (time.perf_counter() - t) / count
            t = time.perf_counter()
            fd = os.open(root / "pack", os.O_RDONLY)
            for i in range(count):
                if checksum(os.pread(fd, size, i * size)) != sums[i]:
                    raise RuntimeError("packed read differs")
            os.close(fd)
            pack_r = (time.perf_counter() - t) / count
        out[size] = {"files_write_us": files_w * 1e6, "pack_write_us": pack_w * 1e6,
                     "files_read_us": files_r * 1e6, "pack_read_us": pack_r * 1e6}
    return out


#: host B: put argv[3] objects of argv[2] bytes, 32 to a batch_put, as fast as the store
#: takes them, then wait until their write-through copies stop landing (copies past a
#: node's queue are skipped: written at eviction instead); ``fill``: 256 objects put 32 at
#: a time, each group's copies waited for; ``get``: batched gets of those from the tier.
PACKED = r"""
import json, os, sys, time
from kvctl.store.client import StoreClient
master, size, n, phase = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
keys = [f"pk{size}-{i}" for i in range(n)]
out = {}
with StoreClient(master, lease=False) as c:
    if phase == "put":
        values = [os.urandom(size) for _ in range(64)]
        t = time.perf_counter()
        for start in range(0, n, 32):  # as fast as the store takes them
            group = keys[start:start + 32]
            errs = c.batch_put([(k, values[(start + i) % 64]) for i, k in enumerate(group)])
            if any(errs):
                raise SystemExit(f"put failed: {[e for e in errs if e][0]}")
        out["puts_per_s"] = n / (time.perf_counter() - t)
        copied, last, changed = 0, t, time.monotonic()
        while time.monotonic() - changed < 2.0:  # until no copy landed for 2 s
            now = sum("shared" in c.stat(k).tier for k in keys)
            if now != copied:
                copied, last, changed = now, time.perf_counter(), time.monotonic()
            if copied == n:
                break
            time.sleep(0.05)
        out["copied"] = copied
        out["copied_per_s"] = copied / (last - t)
        out["put_s"] = last - t
        st = c.status().shared
        out["files"] = st.files
        out["writes"] = st.writes
    elif phase == "fill":  # 256 objects for the gets, 32 at a time, each copy waited for
        keys = [f"get{size}-{i}" for i in range(256)]
        for start in range(0, 256, 32):
            group = keys[start:start + 32]
            c.batch_put([(k, os.urandom(size)) for k in group])
            deadline = time.monotonic() + 60
            while not all("shared" in c.stat(k).tier for k in group):
                if time.monotonic() > deadline:
                    raise SystemExit("copies did not land")
                time.sleep(0.01)
    else:
        per = []
        keys = [f"get{size}-{i}" for i in range(256)]
        for r in range(40):
            start = (r * 64) % 256
            t = time.perf_counter()
            got = c.batch_get(keys[start:start + 64])
            per.append((time.perf_counter() - t) / 64)
            assert all(isinstance(g, bytes) and len(g) == size for g in got)
        per.sort()
        out["batch_get_us"] = per[len(per) // 2] * 1e6
        out["reads"] = c.shared.reads
print(json.dumps(out))
"""


def bench_packed(net: HostNet, dfs: Path, n: int, rounds: int
                 ) -> dict[str, dict[int, dict[str, float]]]:
    """The store's write-through copies and tier-only batched gets, packing off and on:
    the median of ``rounds`` interleaved rounds."""
    seen: dict[str, dict[int, list[dict[str, float]]]] = {}
    for _ in range(rounds):
        for name, rows in _bench_packed_once(net, dfs, n).items():
            for size, row in rows.items():
                seen.setdefault(name, {}).setdefault(size, []).append(row)
    return {name: {size: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                   for size, rows in by.items()} for name, by in seen.items()}


def _bench_packed_once(net: HostNet, dfs: Path, n: int
                       ) -> dict[str, dict[int, dict[str, float]]]:
    a, b = net[0], net[1]
    master = f"{a.address}:{PORT}"
    out: dict[str, dict[int, dict[str, float]]] = {}
    for name, below in (("a file per object", "0"), ("packed (< 256 KiB)", "256KiB")):
        out[name] = {}
        for size in (16 << 10, 64 << 10):
            tier = dfs / f"packed-{below}-{size}"
            mproc = _master(a, tier, "write-through", below)
            node = _node(a, f"{max(64, 2 * n * size >> 20)}MiB")
            try:
                _wait_alive(b, master, True)
                row = _run_json(b, PACKED, master, str(size), str(n), "put")
                row["fsyncs_per_s"] = row["writes"] / row["put_s"]
                _run_json(b, PACKED, master, str(size), "256", "fill")
                node.kill()
                node.wait(timeout=10)
                a.sh("rm -f /dev/shm/kvctl-node-*")  # a killed node leaves its segment
                _wait_alive(b, master, False)
                row.update(_run_json(b, PACKED, master, str(size), str(n), "get"))
            finally:
                stop(node)
                stop(mproc)
                shutil.rmtree(tier, ignore_errors=True)
            out[name][size] = row
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="gets per object and method")
    ap.add_argument("--objects", type=int, default=32, help="objects per size")
    ap.add_argument("--puts", type=int, default=200, help="1 MiB puts per mode (64 KiB: 4x)")
    ap.add_argument("--put-rounds", type=int, default=3,
                    help="interleaved rounds of the put modes (median shown)")
    ap.add_argument("--batches", default=",".join(str(n) for n in BATCHES),
                    help="keys per batched get of 64 KiB objects, comma-separated ('' none)")
    ap.add_argument("--batch-rounds", type=int, default=20,
                    help="batched gets per batch size and method (median shown)")
    ap.add_argument("--no-puts", action="store_true", help="measure gets only")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--index", type=int, metavar="N",
                    help="measure only the master's bytes per object for N objects")
    ap.add_argument("--packing", type=Path, metavar="DIR",
                    help="measure only files against one packed file, in DIR")
    ap.add_argument("--packed", type=int, metavar="N",
                    help="measure only the store's tier with packing off and on, N objects")
    args = ap.parse_args()
    if args.packed:
        with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(
                prefix="kvctl-dfs-", dir="/var/tmp") as dfs, HostNet(
                2, Path(work), shared=Path(dfs)) as net:
            packed = bench_packed(net, Path(dfs), args.packed, args.put_rounds)
        print(f"| write-through, {args.packed} objects, median of {args.put_rounds} rounds "
              "| object | puts/s | got a copy | "
              "copies/s | files (fsyncs) | fsyncs/s | batch_get of 64 from the tier, "
              "per object |")
        print("|---|---|---|---|---|---|---|---|")
        for name, rows in packed.items():
            for size, r in rows.items():
                print(f"| {name} | {_size(size)} | {r['puts_per_s']:,.0f} | "
                      f"{r['copied']:,} | {r['copied_per_s']:,.0f} | {r['writes']:,} | "
                      f"{r['fsyncs_per_s']:,.0f} | {r['batch_get_us']:.1f} us |")
        if args.out:
            args.out.write_text(json.dumps({"packed": packed}, indent=2))
        return 0
    if args.packing:
        packing = bench_packing(args.packing)
        print("| object | write: files | packed | files / packed | read: files | packed |"
              " files / packed |")
        print("|---|---|---|---|---|---|---|")
        for size, r in packing.items():
            print(f"| {_size(size)} | {r['files_write_us']:.0f} us | {r['pack_write_us']:.0f}"
                  f" us | {r['files_write_us'] / r['pack_write_us']:.1f}x | "
                  f"{r['files_read_us']:.0f} us | {r['pack_read_us']:.0f} us | "
                  f"{r['files_read_us'] / r['pack_read_us']:.1f}x |")
        if args.out:
            args.out.write_text(json.dumps({"packing": packing}, indent=2))
        return 0
    if args.index:
        index = bench_index(args.index)
        print("| master, after restoring N objects | bytes per object |")
        print("|---|---|")
        for name, row in index.items():
            print(f"| {args.index:,} {name} | {row['bytes_per_object']:.0f} |")
        if args.out:
            args.out.write_text(json.dumps({"index": index}, indent=2))
        return 0
    batches = [int(n) for n in args.batches.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(
            prefix="kvctl-dfs-", dir="/var/tmp") as dfs, HostNet(
            2, Path(work), shared=Path(dfs)) as net:
        started = time.monotonic()
        gets = bench_gets(net, Path(dfs), args.rounds, args.objects, batches,
                          args.batch_rounds)
        puts = {} if args.no_puts else bench_puts(net, Path(dfs), args.puts, args.put_rounds)
    (before, _, _), (after, _, _) = gets["load"]
    print(f"load average (1 min) on host B: {before:.2f} before the gets, {after:.2f} after;"
          f" client read threads: {gets['threads']}\n")
    print("| get from another host | pread p50 | get p50 | get / pread | file read alone |"
          " preadv into a buffer | get_into | get_into / preadv | goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, g in gets["single"].items():
        verdict = "met" if min(g["get_vs_pread"], g["get_into_vs_preadv"]) >= GOAL \
            else "missed"
        print(f"| {_size(size)} | {g['pread_ms']:.3f} ms | {g['get_ms']:.3f} ms | "
              f"{g['get_vs_pread']:.2f}x | {g['file_read_ms']:.3f} ms "
              f"({g['file_read_vs_pread']:.2f}x) | {g['preadv_ms']:.3f} ms | "
              f"{g['get_into_ms']:.3f} ms | {g['get_into_vs_preadv']:.2f}x | "
              f"{verdict} (>= {GOAL}x) |")
    if gets["batch"]:
        t = gets["threads"]
        print()
        print(f"Batched gets of N x {_size(BATCH_SIZE)}, per object (p50 of rounds); ratios are"
              " the bare read's time over the get's (throughput per object)")
        print()
        print(f"| N | pread loop | kept | kept, {t} threads | batch_get | / pread loop | "
              f"/ kept | / kept, {t} threads | batch_get, 1 thread | / kept | goal |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for n, r in gets["batch"].items():
            verdict = "met" if r["batch_get_vs_pread"] >= GOAL else "missed"
            print(f"| {n} | {r['pread_loop_us']:.1f} us | {r['pread_kept_us']:.1f} us | "
                  f"{r['pread_threads_us']:.1f} us | {r['batch_get_us']:.1f} us | "
                  f"{r['batch_get_vs_pread']:.2f}x | {r['batch_get_vs_pread_kept']:.2f}x | "
                  f"{r['batch_get_vs_pread_threads']:.2f}x | "
                  f"{r['batch_get_1thread_us']:.1f} us | "
                  f"{r['pread_kept_us'] / r['batch_get_1thread_us']:.2f}x | "
                  f"{verdict} (>= {GOAL}x) |")
        print()
        print("| N | preadv loop into the same buffers | batch_get_into | / preadv loop | goal |"
              " master's answer alone |")
        print("|---|---|---|---|---|---|")
        for n, r in gets["batch"].items():
            verdict = "met" if r["batch_get_into_vs_preadv"] >= GOAL else "missed"
            print(f"| {n} | {r['preadv_loop_us']:.1f} us | {r['batch_get_into_us']:.1f} us | "
                  f"{r['batch_get_into_vs_preadv']:.2f}x | {verdict} (>= {GOAL}x) | "
                  f"{r['master_us']:.1f} us |")
    if puts:
        print()
        print("| puts/s from another host (median of rounds) | 1 MiB | 64 KiB |")
        print("|---|---|---|")
        for name, by_size in puts.items():
            print(f"| {name} | {by_size[1 << 20]:,.0f} | {by_size[64 << 10]:,.0f} |")
    print(f"\n({time.monotonic() - started:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"gets": gets, "puts": puts}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
