"""What bad-file reports cost (kvctl/store/sharedtier/reports.py), in one process.

1. The get's error path: a get of an object only the shared tier holds, whose file is
   gone, with the client's report (one SharedBad sent after the get) and without it (the
   master's check is switched off, so every get misses the file again).
2. A flood: one client's gets of a good tier object, p50/p99, alone and while another
   process sends the master reports of a good file (and unknown keys) as fast as it can,
   against the same flood of lease releases (any message with no reply costs its decode).

    .venv/bin/python benchmarks/shared_tier_reports.py [--gets 2000] [--flood-s 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.store.sharedtier.config import SharedTierConfig
from kvctl.store.sharedtier.fileformat import file_name

MiB = 1 << 20

#: Send no-reply messages of MAX_BATCH keys for a while (Release, or SharedBad naming a
#: good file 64 times and unknown keys after): how many were sent.
FLOOD = """
import sys, time
from kvctl.store import protocol as p
from kvctl.store.rpc import MasterConnection
address, kind, good, version, seconds = sys.argv[1:6]
conn = MasterConnection(address)
names = [good] * 64 + [f"nope-{i}" for i in range(p.MAX_BATCH - 64)]
versions = [int(version)] * p.MAX_BATCH
msg = (p.Release(keys=names, versions=versions) if kind == "release" else
       p.SharedBad(keys=names, versions=versions))
sent, end = 0, time.monotonic() + float(seconds)
while time.monotonic() < end:
    conn.send(msg)
    sent += 1
conn.close()
print(sent)
"""


def _tier_only(client: StoreClient, node: StorageNode, keys: list[str]) -> None:
    for key in keys:
        client.put(key, os.urandom(64 << 10))
    for i in range(40):  # through 8 MiB of DRAM: the keys are evicted into the tier
        client.put(f"fill-{i}", os.urandom(MiB))
    deadline = time.monotonic() + 30
    while any(client.stat(k).tier != "shared" for k in keys):
        if time.monotonic() > deadline:
            raise SystemExit("write-back did not finish")
        time.sleep(0.05)


def _timed(fn: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gets", type=int, default=2000)
    ap.add_argument("--flood-s", type=float, default=3.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvctl-reports-", dir="/var/tmp"))
    core = MasterCore(MasterConfig(), shared_tier=SharedTierConfig(root))
    server = MasterServer(core)
    node = StorageNode(server.address, capacity_bytes=8 * MiB, heartbeat_s=0.05)
    try:
        with StoreClient(server.address) as client:
            keys = [f"k{i}" for i in range(8)]
            _tier_only(client, node, keys)
            (root / file_name("k0", client.stat("k0").version)).unlink()
            core.report_shared = lambda keys, versions: None  # type: ignore[method-assign]

            def miss() -> None:
                try:
                    client.get("k0")
                except ObjectNotFoundError:
                    pass
                else:
                    raise SystemExit("the gone file was served")

            sent = client._report_shared_bad

            def unsent() -> None:
                client._shared_bad.clear()

            reporting: list[float] = []
            silent: list[float] = []
            for _ in range(args.gets // 100):  # interleaved rounds: the same machine state
                reporting.extend(_timed(miss, 100))
                client._report_shared_bad = unsent  # type: ignore[method-assign]
                silent.extend(_timed(miss, 100))
                client._report_shared_bad = sent  # type: ignore[method-assign]
            med_r, med_s = statistics.median(reporting), statistics.median(silent)
            print(f"miss get, p50: {med_s * 1e6:.0f} us without the report, "
                  f"{med_r * 1e6:.0f} us with it ({(med_r - med_s) * 1e6:+.0f} us)")
            del core.report_shared  # the real one again

            good = "k1"
            version = client.stat(good).version
            alone = _timed(lambda: client.get(good), args.gets)
            rows = [("alone", alone, 0)]
            for kind in ("release", "shared_bad"):
                proc = subprocess.Popen([sys.executable, "-c", FLOOD, server.address, kind,
                                         good, str(version), str(args.flood_s)],
                                        stdout=subprocess.PIPE)
                time.sleep(0.3)  # connected and sending
                flooded: list[float] = []
                while proc.poll() is None:
                    flooded.extend(_timed(lambda: client.get(good), 20))
                out, _ = proc.communicate()
                rows.append((kind, flooded, int(out or 0)))
            st = client.status().shared
            assert st is not None

            def q(xs: list[float], f: float) -> float:
                return sorted(xs)[int(f * (len(xs) - 1))] * 1e6

            for kind, times, msgs in rows:
                what = "alone" if not msgs else (
                    f"under {msgs / args.flood_s:.0f}/s {kind} messages x {p.MAX_BATCH} keys "
                    "from another process")
                print(f"good get: p50 {q(times, 0.5):.0f} us, p99 {q(times, 0.99):.0f} us "
                      f"{what}")
            print(f"the master: {st.reports} reports looked at, {st.reports_dropped} "
                  f"dropped, {st.bad_files} bad; the good file is still "
                  f"{client.stat(good).tier}")
    finally:
        node.close()
        server.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
