"""A child process for two-process RDMA tests: a target engine on its own fake host.

Run as ``python -m tests.fakes.rdma_peer METADATA_URL SEGMENT SIZE RUN [--token T]
[--listen HOST:PORT]`` with ``KVCTL_PYVERBS`` and ``FAKE_PYVERBS_CONFIG`` set. It
registers ``SEGMENT`` (shm, filled with the test pattern of ``RUN``), prints ``READY <json
of the rdma ports>``, then serves until a line arrives on stdin: ``check RUN2 OFFSET
LENGTH`` answers ``MATCH`` or ``MISMATCH`` for the pattern of ``RUN2`` at that range;
``quit`` closes the engine and prints ``BYE <leftover verbs resources as JSON>``.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvctl.transfer import TransferEngine
from tests.fakes.fabric import leftovers
from tests.transfer._helpers import pattern


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("segment")
    parser.add_argument("size", type=int)
    parser.add_argument("run", type=int)
    parser.add_argument("--token")
    parser.add_argument("--listen")
    args = parser.parse_args(argv)
    url, segment, size, run = args.url, args.segment, args.size, args.run
    engine = TransferEngine(f"{segment}-engine", url, transport="rdma", token=args.token,
                            listen=args.listen)
    try:
        engine.register_segment(segment, size)
        engine.local_view(segment)[:] = pattern(run, 0, 0, size)
        ports = [p.name for p in engine._rdma.ports] if engine._rdma else []
        sys.stdout.write(f"READY {json.dumps(ports)}\n")
        sys.stdout.flush()
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            if words[0] == "check":
                run2, offset, length = (int(w) for w in words[1:4])
                got = bytes(engine.local_view(segment)[offset : offset + length])
                ok = got == pattern(run2, 0, 0, length)
                sys.stdout.write("MATCH\n" if ok else "MISMATCH\n")
                sys.stdout.flush()
    finally:
        engine.close()
    sys.stdout.write(f"BYE {json.dumps(leftovers())}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
