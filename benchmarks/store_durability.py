"""What waiting for durability costs a put: latency and throughput of kvctl store puts.

Not a test: run it by hand (figures depend on the machine and its load)::

    .venv/bin/python benchmarks/store_durability.py --state none,journal,etcd

A master (``kvctl store master --state ...``) and one node (``kvctl store node``) run as
processes of their own; the client runs here. Per state backend, per path:

- ``shm/reserved``: a same-host client placing puts in its reservation (the default);
- ``shm/master``: the same client with ``reserve_bytes=0`` (allocation by the master);
- ``tcp/reserved`` and ``tcp/master``: the client forced onto tcp.

Figures: single put of ``--size`` bytes over distinct keys, p50 and p99 (ms), and batch put
throughput (``--batch`` keys of ``--batch-size`` bytes per call, puts/s). The journal lives
in ``--dir`` (a real disk, so its fsync counts). ``etcd`` starts a private etcd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.store.client import StoreClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "store", *args, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    text = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line:
            raise RuntimeError(f"kvctl store {' '.join(args)} exited")
        text += line
        try:
            return proc, json.loads(text)
        except ValueError:
            continue
    raise RuntimeError(f"kvctl store {' '.join(args)}: no card")


def _etcd(base: Path) -> tuple[subprocess.Popen[bytes], str]:
    client, peer = _free_port(), _free_port()
    peer_url = f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        ["etcd", "--name", "bench", "--data-dir", str(base / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"bench={peer_url}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", client), timeout=0.2).close()
            time.sleep(0.5)
            return proc, f"etcd://127.0.0.1:{client}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("etcd did not start")


def _measure(address: str, transport: str, reserve: bool, args: argparse.Namespace,
             tag: str) -> dict[str, float]:
    kwargs = {} if reserve else {"reserve_bytes": 0}
    value = os.urandom(args.size)
    with StoreClient(address, transport=transport, **kwargs) as client:  # type: ignore[arg-type]
        for i in range(50):  # warm: connections, reservation, mappings
            client.put(f"{tag}/warm/{i}", value)
        lat = []
        for i in range(args.puts):
            t = time.perf_counter()
            client.put(f"{tag}/p/{i}", value)
            lat.append((time.perf_counter() - t) * 1e3)
        lat.sort()
        chunk = os.urandom(args.batch_size)
        rounds = max(1, args.batch_puts // args.batch)
        t = time.perf_counter()
        for r in range(rounds):
            errs = client.batch_put([(f"{tag}/b/{r}/{j}", chunk) for j in range(args.batch)])
            assert not any(errs), errs
        took = time.perf_counter() - t
    return {"p50_ms": statistics.median(lat), "p99_ms": lat[int(len(lat) * 0.99) - 1],
            "batch_puts_per_s": rounds * args.batch / took}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", default="none,journal", help="none, journal, etcd (comma list)")
    ap.add_argument("--paths", default="shm/reserved,shm/master,tcp/reserved,tcp/master")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--puts", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--batch-puts", type=int, default=8000)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                    help="where the journal and etcd data live")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    base = Path(tempfile.mkdtemp(prefix="kvctl-durability-", dir=args.dir))
    env = {**os.environ, "KVCTL_STORE_NODE_TIMEOUT": "10"}
    try:
        for state in args.state.split(","):
            etcd = None
            spec = state
            if state == "journal":
                spec = str(base / f"journal-{time.monotonic_ns()}")
            elif state == "etcd":
                etcd, spec = _etcd(base)
            procs = []
            try:
                master, card = _start(["master", "--listen", "127.0.0.1:0", "--state", spec],
                                      env)
                procs.append(master)
                node, _ = _start(["node", "--master", str(card["master"]), "--capacity",
                                  "1GiB"], env)
                procs.append(node)
                time.sleep(0.5)
                for path in args.paths.split(","):
                    transport, _, how = path.partition("/")
                    row = _measure(str(card["master"]), transport, how == "reserved", args,
                                   f"{state}-{path}")
                    results[f"{state} {path}"] = row
                    print(f"{state:8} {path:13} put {args.size} B p50 {row['p50_ms']:.3f} ms "
                          f"p99 {row['p99_ms']:.3f} ms; batch {args.batch} x "
                          f"{args.batch_size} B: {row['batch_puts_per_s']:,.0f} puts/s",
                          flush=True)
            finally:
                for proc in reversed(procs):
                    proc.terminate()
                    proc.wait(10)
                if etcd is not None:
                    etcd.terminate()
                    etcd.wait(10)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
