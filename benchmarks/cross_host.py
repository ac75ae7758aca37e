"""Cross-host transfer: kvctl's engine vs Mooncake's vs NIXL's between two namespaced hosts.

Two hosts (network namespaces, each with its own /dev/shm, /tmp and hostname) joined by a
veth pair through a bridge, the link unshaped. Host A runs one ``kvctl bench transfer --role
target`` serving all three engines; host B runs the initiator with the same sweep (READ and
WRITE, 64 KiB / 1 MiB / 4 MiB, batch 128, verified). In the same run, the link's raw bound:
one plain Python socket stream from B to A (and A to B), 1 MiB sends, as long as a point.

Needs root (namespaces). Prints a markdown table (the README's) and writes JSON with --out.

    sudo .venv/bin/python benchmarks/cross_host.py                    # markdown on stdout
    sudo .venv/bin/python benchmarks/cross_host.py --duration 2 --rounds 3 --out x.json

Goals (issue 14): kvctl >= 1.5x Mooncake's TCP at 64 KiB and >= 1.2x at 1-4 MiB, and
>= 0.6 of the raw stream at 1 MiB. With ``--rounds N`` each figure is the median of N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.hosts import read_json_doc, stop  # noqa: E402
from tests.fixtures.nshosts import HostNet  # noqa: E402

SIZES = "64KiB,1MiB,4MiB"
GOALS = {65536: 1.5, 1 << 20: 1.2, 4 << 20: 1.2}
RAW_GOAL = 0.6

SINK = ("import socket\ns = socket.create_server(('0.0.0.0', 7600)); print('ready', flush=True)\n"
        "c, _ = s.accept(); buf = bytearray(1 << 20); v = memoryview(buf)\n"
        "while c.recv_into(v): pass\n")
SEND = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], 7600))\n"
        "b = b'x' * (1 << 20); end = time.monotonic() + float(sys.argv[2]); n = 0\n"
        "t = time.monotonic()\nwhile time.monotonic() < end: s.sendall(b); n += len(b)\n"
        "s.close(); print(n / (time.monotonic() - t) / 1e9)")


def raw_stream(net: HostNet, src: int, dst: int, seconds: float) -> float:
    """GB/s of one Python socket stream from host ``src`` to host ``dst``."""
    sink = net[dst].popen(["python3", "-c", SINK])
    assert sink.stdout is not None
    sink.stdout.readline()
    done = net[src].run(["python3", "-c", SEND, net[dst].address, str(seconds)],
                        timeout=seconds + 60)
    stop(sink)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return float(done.stdout)


def bench_round(net: HostNet, duration: float, engines: list[str]) -> dict[str, Any]:
    flags = ["--block-size", SIZES, "--batch-size", "128"]
    target = net[0].popen(["kvctl", "bench", "transfer", "--role", "target", "--listen",
                           "0.0.0.0:7400", "--json", *flags,
                           *[w for e in engines for w in ("--engine", e)]])
    try:
        info = read_json_doc(target, timeout_s=60)
        done = net[1].run(["kvctl", "bench", "transfer", "--role", "initiator", "--peer",
                           info["peer"], *flags, "-t", "tcp", "--verify", "--duration",
                           f"{duration}s", "--json",
                           *[w for e in engines for w in ("--engine", e)]], timeout=900)
    finally:
        stop(target)
    if done.returncode != 0:
        raise RuntimeError(f"initiator exit {done.returncode}: {done.stderr[-3000:]}")
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per point")
    parser.add_argument("--rounds", type=int, default=1, help="rounds; medians are shown")
    parser.add_argument("--engines", default="kvctl,mooncake,nixl")
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    figures: dict[tuple[str, str, int], list[float]] = {}
    raw: dict[str, list[float]] = {"B->A": [], "A->B": []}
    skipped: list[Any] = []
    with tempfile.TemporaryDirectory() as work, HostNet(2, Path(work)) as net:
        for _ in range(args.rounds):
            raw["B->A"].append(raw_stream(net, 1, 0, max(2.0, args.duration * 2)))
            doc = bench_round(net, args.duration, engines)
            skipped = doc["skipped"]
            for row in doc["rows"]:
                if row["errors"] or not row["verified"]:
                    raise RuntimeError(f"row failed: {row}")
                key = (row["engine"], row["op"], row["block_size_bytes"])
                figures.setdefault(key, []).append(row["throughput_gbytes_per_s"])
            raw["A->B"].append(raw_stream(net, 0, 1, max(2.0, args.duration * 2)))
            time.sleep(0.5)
    med = {k: statistics.median(v) for k, v in figures.items()}
    raw_med = {k: statistics.median(v) for k, v in raw.items()}
    present = [e for e in engines if any(k[0] == e for k in med)]
    head = ["op", "block", *(f"{e} GB/s" for e in present),
            *(f"kvctl / {e}" for e in present if e != "kvctl"), "kvctl / raw stream", "goal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = True
    for op in ("read", "write"):
        for size in (65536, 1 << 20, 4 << 20):
            kv = med.get(("kvctl", op, size))
            cells = [op, f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"]
            cells += [f"{med[(e, op, size)]:.3f}" if (e, op, size) in med else "-"
                      for e in present]
            for e in present:
                if e == "kvctl":
                    continue
                other = med.get((e, op, size))
                cells.append(f"{kv / other:.2f}x" if kv and other else "-")
            bound = raw_med["B->A"] if op == "write" else raw_med["A->B"]
            cells.append(f"{kv / bound:.2f}" if kv else "-")
            moon = med.get(("mooncake", op, size))
            ok = bool(kv and moon and kv / moon >= GOALS[size])
            if size == 1 << 20:
                ok = ok and bool(kv and kv / bound >= RAW_GOAL)
            met = met and ok
            cells.append(f">= {GOALS[size]}x Mooncake" + (", >= 0.6 raw" if size == 1 << 20
                                                          else "") + (" ok" if ok else " MISSED"))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Two namespaced hosts over veth, TCP, batch 128, verified, {args.duration:g} s "
              f"per point, median of {args.rounds} round(s); GB/s = 10^9 B/s. Raw Python socket "
              f"stream in the same run: B->A {raw_med['B->A']:.2f} GB/s (the WRITE direction), "
              f"A->B {raw_med['A->B']:.2f} GB/s (READ)."]
    for skip in skipped:
        lines.append(f"Skipped {skip['engine']}: {skip['reason']}")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "figures": {f"{e} {op} {s}": v for (e, op, s), v in figures.items()},
            "raw_stream_gbps": raw, "duration_s": args.duration, "rounds": args.rounds},
            indent=2))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
