"""The loopback TCP bound on this machine: what any TCP data path can reach here.

Not a test: run it by hand next to ``benchmarks/store.py``::

    .venv/bin/python benchmarks/loopback_bound.py [--rounds 3]

Measures, in interleaved rounds, one request answered by 32 chunks of 64 KiB, 1 MiB and
4 MiB on one loopback connection: in C (``loopback_bound.c``, built with ``cc -O2`` into a
temporary directory) and in plain Python (blocking ``sendall``/``recv_into``, no framing).
The store benchmark's batch gets move the same shape (32 keys per call); their GB/s can be
read against these. Prints the median GB/s per size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = (64 << 10, 1 << 20, 4 << 20)
CHUNKS = 32


def _python_server(port_q: mp.Queue[int], chunk: int) -> None:  # type: ignore[type-arg]
    data = memoryview(bytearray(b"\x07" * (chunk * CHUNKS)))
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = bytearray(16)
    while conn.recv_into(request, 16, socket.MSG_WAITALL) == 16:
        for i in range(CHUNKS):
            conn.sendall(data[i * chunk:(i + 1) * chunk])


def python_gbps(chunk: int, reps: int = 30) -> float:
    """Median GB/s of a plain-Python server and client (separate processes)."""
    port_q: mp.Queue[int] = mp.Queue()  # type: ignore[type-arg]
    server = mp.Process(target=_python_server, args=(port_q, chunk), daemon=True)
    server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", port_q.get(timeout=10)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = chunk * CHUNKS
        view = memoryview(bytearray(total))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            sock.sendall(b"0123456789abcdef")
            got = 0
            while got < total:
                n = sock.recv_into(view[got:])
                if not n:
                    raise RuntimeError("server closed")
                got += n
            times.append(time.perf_counter() - start)
        sock.close()
        return total / statistics.median(times) / 1e9
    finally:
        server.terminate()
        server.join()


def build_c(workdir: Path) -> Path | None:
    """Compile loopback_bound.c; ``None`` when no C compiler is installed."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    binary = workdir / "loopback_bound"
    subprocess.run([cc, "-O2", "-o", str(binary), str(HERE / "loopback_bound.c")],
                   check=True)
    return binary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, dict[int, list[float]]] = {"c": {s: [] for s in SIZES},
                                                   "python": {s: [] for s in SIZES}}
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_c(Path(tmp))
        if binary is None:
            print("no C compiler (cc): measuring Python only", file=sys.stderr)
        for r in range(args.rounds):
            for size in SIZES:
                if binary is not None:
                    out = subprocess.run([str(binary), str(size)], check=True,
                                         capture_output=True, text=True).stdout
                    results["c"][size].append(float(out))
                results["python"][size].append(python_gbps(size))
                print(f"round {r} {size:>8d} B  " + "  ".join(
                    f"{k} {v[size][-1]:.2f} GB/s" for k, v in results.items() if v[size]),
                    flush=True)
    print("\nmedian GB/s, one connection, 32 chunks per request")
    for size in SIZES:
        print(f"{size:>8d} B  " + "  ".join(
            f"{k} {statistics.median(v[size]):.2f} (range {min(v[size]):.2f}-"
            f"{max(v[size]):.2f})" for k, v in results.items() if v[size]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
