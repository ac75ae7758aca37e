"""How many KV block events per second ``kvctl verify-keys watch`` checks, in one process.

A bounded local publisher (a separate process, so it does not share the watcher's
interpreter) sends ``--blocks`` blocks of vLLM-shaped ``BlockStored`` events (sha256_cbor
hashes, int form, 16 tokens a block, ``--per-event`` blocks an event, ``--instances`` PUB
sockets on ipc://) with chains from their roots; the watcher — the library's
:class:`~kvctl.keys.watch.session.WatchSession`, every check on: recompute, cross-instance
index, pool accounting — counts the blocks it checked and the wall time from its first to its
last message, and the watcher process's CPU time (the publishers compete for the same cores
on a small machine: blocks per CPU-second is what one watcher process sustains). Prints one
markdown line; exit 1 if any block failed to verify.

    .venv/bin/python benchmarks/keys_watch.py                 # 400,000 blocks
    .venv/bin/python benchmarks/keys_watch.py --blocks 100000 --per-event 4 --algo sha256
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

from kvctl.keys.profiles import KeyConfig
from kvctl.keys.profiles.vllm import object_hash
from kvctl.keys.watch.session import WatchOptions, WatchSession
from kvctl.keys.watch.source import Endpoint

BLOCK = 16


def _payloads(blocks: int, per_event: int, seed: int, algo: str = "sha256_cbor"
              ) -> list[bytes]:
    """Batches of one BlockStored each, chains of 4 events from a root (vLLM's hashes)."""
    h = object_hash(algo)
    none_hash = h("vllm-none-hash")
    rnd = random.Random(seed)
    out: list[bytes] = []
    digest, parent = none_hash, None
    for n in range(blocks // per_event):
        if n % 4 == 0:
            digest, parent = none_hash, None
        tokens = [rnd.randrange(151_936) for _ in range(BLOCK * per_event)]
        hashes = []
        for i in range(per_event):
            digest = h((digest, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), None))
            hashes.append(int.from_bytes(digest[-8:], "big"))
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                 "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "extra_keys": [None] * per_event, "group_idx": 0}
        parent = hashes[-1]
        out.append(msgspec.msgpack.encode([time.time(), [event], 0]))
    return out


def _publish(url: str, payloads: list[bytes], ready: threading.Event | None = None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(url)
    sock.recv()  # the watcher's subscription: it is connected
    for seq, payload in enumerate(payloads):
        sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    sock.close(linger=-1)
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=400_000, help="blocks in all")
    parser.add_argument("--per-event", type=int, default=8, help="blocks per BlockStored")
    parser.add_argument("--instances", type=int, default=1, help="publishers")
    parser.add_argument("--shared", action="store_true",
                        help="every instance publishes the same traffic (all duplicates)")
    parser.add_argument("--algo", default="sha256_cbor", choices=("sha256_cbor", "sha256"),
                        help="vLLM --prefix-caching-hash-algo of the events")
    args = parser.parse_args()
    per_instance = args.blocks // args.instances
    print(f"preparing {args.blocks:,} blocks...", file=sys.stderr)
    streams = [_payloads(per_instance, args.per_event, 0 if args.shared else seed, args.algo)
               for seed in range(args.instances)]
    with tempfile.TemporaryDirectory(prefix="kvwb") as tmp:
        urls = [f"ipc://{Path(tmp)}/p{i}" for i in range(args.instances)]
        procs = [multiprocessing.Process(target=_publish, args=(u, s))
                 for u, s in zip(urls, streams, strict=True)]
        for p in procs:
            p.start()
        endpoints = [Endpoint(f"i{i}", u) for i, u in enumerate(urls)]
        config = KeyConfig(profile=f"vllm:{args.algo}", block_size=BLOCK)
        total = sum(len(s) for s in streams)
        with WatchSession(endpoints, config, WatchOptions()) as session:
            first: float | None = None
            cpu0 = time.process_time()
            deadline = time.monotonic() + 600
            while sum(i.stats.batches for i in session.checker.instances.values()) < total:
                if session.step(0.05) and first is None:
                    first = time.perf_counter()
                if time.monotonic() > deadline:
                    break
            wall = time.perf_counter() - (first or time.perf_counter())
            cpu = time.process_time() - cpu0
            stats = [i.stats for i in session.checker.instances.values()]
        for p in procs:
            p.join(timeout=30)
    blocks = sum(s.blocks_seen for s in stats)
    verified = sum(s.verified for s in stats)
    shared = ", shared traffic" if args.shared else ""
    print(f"| {args.algo} | {blocks:,} blocks ({args.per_event}/event, {args.instances} "
          f"instances{shared}) | "
          f"{wall:.2f} s | {blocks / wall:,.0f} blocks/s | {total / wall:,.0f} events/s | "
          f"{blocks / cpu:,.0f} blocks per CPU-second of the watcher | verified {verified:,} |")
    sys.exit(0 if verified == blocks == per_instance // args.per_event * args.per_event
             * args.instances else 1)


if __name__ == "__main__":
    main()
