"""Python cost of kvctl's rdma transport per posted WR and per completion, measured on the
fake provider, and the message rate and line-rate projection they imply.

    .venv/bin/python -m tests.fakes.rdma_projection [--requests 4096] [--rounds 20] [--json]

The fake runs in "instant" mode: every WR completes the moment it is posted and no byte
moves. The objects kvctl builds per WR and per completion are the *real* pyverbs ones
(``SGE``, ``SendWR`` and ``WC`` are Cython classes that need no device), so their cost is
measured, not guessed. What stands in for ``ibv_post_send`` and ``ibv_poll_cq`` is the
fake's Python bookkeeping, which costs more than those C calls: the figures are an upper
bound on kvctl's Python cost, and everything derived from them is a projection until
``scripts/device-check`` measures a NIC.

Times are CPU time of the thread doing the work (``time.thread_time``), best of several
rounds: waiting for the GIL or for other processes on the machine is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LINE_GBITPS = 400.0
BLOCKS = (4 << 10, 64 << 10, 1 << 20)


def _hybrid_verbs() -> Any:
    """The fake provider, but with pyverbs' own SGE, SendWR and WC classes."""
    from kvctl.transfer.transports.rdma.provider import load_verbs

    real = load_verbs("pyverbs")
    return dataclasses.replace(load_verbs("tests.fakes.pyverbs"), SGE=real.SGE,
                               SendWR=real.SendWR)


def measure(requests: int, rounds: int, block: int) -> dict[str, float]:
    """CPU µs per request of the caller thread, per posted WR and per completion of the
    poster thread; one NIC, ``requests`` requests of ``block`` bytes per batch."""
    from kvctl.transfer import OpCode, TransferEngine, TransferRequest
    from kvctl.transfer.transports.rdma import datapath
    from kvctl.transfer.transports.rdma import transport as transport_mod
    from tests.fakes import pyverbs as fv
    from tests.fakes.pyverbs import cq as fake_cq
    from tests.fakes.pyverbs._hca import reset

    spent = {"post": 0.0, "poll": 0.0}
    saved = (datapath.Poster._post_all, datapath.Poster._poll, transport_mod.load_verbs,
             fake_cq.WC)
    real_post_all, real_poll = saved[0], saved[1]

    def post_all(self: Any) -> int:
        t = time.thread_time()
        try:
            return int(real_post_all(self))
        finally:
            spent["post"] += time.thread_time() - t

    def poll(self: Any) -> int:
        t = time.thread_time()
        try:
            return int(real_poll(self))
        finally:
            spent["poll"] += time.thread_time() - t

    root = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))
    os.environ["KVCTL_PYVERBS"] = "tests.fakes.pyverbs"
    datapath.Poster._post_all = post_all  # type: ignore[method-assign]
    datapath.Poster._poll = poll  # type: ignore[method-assign]
    hybrid = _hybrid_verbs()
    import pyverbs.cq as real_cq  # after the quiet first import of pyverbs

    transport_mod.load_verbs = lambda package=None: hybrid  # type: ignore[assignment]
    fake_cq.WC = real_cq.WC  # type: ignore[misc]
    try:
        fv.configure(fv.HostSpec(str(root), [fv.DeviceSpec("mlx5_0", [fv.roce_port(
            "10.9.0.1")])], instant=True))
        url = f"memory://projection-{os.getpid()}"
        with TransferEngine("t", url, transport="rdma") as tgt, TransferEngine(
                "i", url, transport="rdma") as ini:
            tgt.register_segment("remote", requests * block)
            ini.register_segment("local", requests * block)
            reqs = [TransferRequest(OpCode.WRITE, "local", k * block, "remote", k * block,
                                    block) for k in range(requests)]
            ini.transfer(reqs, timeout_s=60)  # warm up: QP exchange, caches
            assert ini._rdma is not None
            best = {"caller": float("inf"), "post": float("inf"), "poll": float("inf"),
                    "wall": float("inf")}
            for _ in range(rounds):
                spent["post"] = spent["poll"] = 0.0
                before = ini._rdma.stats()
                batch = ini.allocate_batch(requests)
                t, c = time.perf_counter(), time.thread_time()
                result = ini.run(batch, reqs, timeout_s=60)
                caller, wall = time.thread_time() - c, time.perf_counter() - t
                ini.free_batch(batch)
                if not result.ok:
                    raise RuntimeError(result.first_cause)
                after = ini._rdma.stats()
                posted = after["posted"] - before["posted"]
                done = after["completed"] - before["completed"]
                best["caller"] = min(best["caller"], caller / requests)
                best["post"] = min(best["post"], spent["post"] / posted)
                best["poll"] = min(best["poll"], spent["poll"] / done)
                best["wall"] = min(best["wall"], wall / requests)
        return {"caller_us": best["caller"] * 1e6, "post_wr_us": best["post"] * 1e6,
                "completion_us": best["poll"] * 1e6, "wall_us": best["wall"] * 1e6}
    finally:
        (datapath.Poster._post_all, datapath.Poster._poll, transport_mod.load_verbs,
         fake_cq.WC) = saved  # type: ignore[method-assign,assignment,misc]
        reset()
        shutil.rmtree(root, ignore_errors=True)


def object_costs() -> dict[str, float]:
    """CPU µs to build and free the real pyverbs objects of one WR (SGE, SendWR,
    set_wr_rdma, two closes) and of one completion (WC)."""
    v = _hybrid_verbs()
    import pyverbs.cq as real_cq

    en = v.enums

    def best(fn: Any, count: int = 20000) -> float:
        out = float("inf")
        for _ in range(7):
            t = time.thread_time()
            for _ in range(count):
                fn()
            out = min(out, (time.thread_time() - t) / count)
        return out * 1e6

    def wr() -> None:
        sge = v.SGE(0x10000, 4096, 7)
        w = v.SendWR(wr_id=12345, opcode=en.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                     send_flags=en.IBV_SEND_SIGNALED)
        sge.close()
        w.set_wr_rdma(9, 0x20000)
        w.close()

    def wc() -> None:
        real_cq.WC(wr_id=12345, status=0, opcode=1, qp_num=77, byte_len=4096)

    return {"wr_objects_us": best(wr), "wc_object_us": best(wc)}


def project(measured: dict[str, float], slice_bytes: int = 1 << 20) -> dict[str, Any]:
    """Message rate of one process (the GIL serialises its threads, so posters on several
    NICs share one core) and the throughput that gives per block size at 400 Gb/s."""
    per_request = measured["caller_us"] + measured["post_wr_us"] + measured["completion_us"]
    rate = 1e6 / per_request
    line_bytes = LINE_GBITPS * 1e9 / 8
    rows = []
    for block in BLOCKS:
        wr_bytes = min(block, slice_bytes)
        need = line_bytes / wr_bytes
        rows.append({"block_bytes": block, "needed_per_s": need, "projected_per_s": rate,
                     "projected_gbitps": min(LINE_GBITPS, rate * wr_bytes * 8 / 1e9),
                     "reaches_line_rate": rate >= need})
    return {"per_request_us": per_request, "messages_per_s": rate,
            "min_block_for_line_rate_bytes": line_bytes / rate, "rows": rows}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    measured = measure(args.requests, args.rounds, 4096)
    measured.update(object_costs())
    out = {"measured_on_fake": measured, "projection": project(measured),
           "python": sys.version.split()[0]}
    if args.json:
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    p = out["projection"]
    w = sys.stdout.write
    w("Measured on the fake pyverbs, instant completions, real pyverbs SGE/SendWR/WC, one "
      "NIC, batches of 4 KiB requests (CPU us, best round):\n")
    w(f"  caller (plan, slice, hand off)  {measured['caller_us']:6.2f} us per request\n")
    w(f"  poster, per posted WR           {measured['post_wr_us']:6.2f} us (of which "
      f"pyverbs SGE+SendWR {measured['wr_objects_us']:.2f} us)\n")
    w(f"  poster, per completion          {measured['completion_us']:6.2f} us (of which "
      f"pyverbs WC {measured['wc_object_us']:.2f} us)\n")
    w(f"  (wall time per request on this machine: {measured['wall_us']:.2f} us)\n")
    w(f"PROJECTION, one process: {p['per_request_us']:.2f} us per request -> "
      f"{p['messages_per_s'] / 1e3:.0f} k messages/s; a 400 Gb/s port needs messages of "
      f"at least {p['min_block_for_line_rate_bytes'] / 1024:.0f} KiB\n")
    for row in p["rows"]:
        w(f"  {row['block_bytes'] >> 10:5d} KiB blocks: {row['needed_per_s'] / 1e3:9.1f} k/s "
          f"needed, {row['projected_gbitps']:6.1f} Gb/s projected"
          f"{' (line rate)' if row['reaches_line_rate'] else ''}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
