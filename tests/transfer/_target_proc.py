"""A transfer target in its own process: ``python -m tests.transfer._target_proc URL NAME SIZE``.

Registers a shm segment, fills block i (of BLOCK bytes) with pattern(RUN, i, offset), prints
READY and serves until stdin closes.
"""

from __future__ import annotations

import sys

from kvctl.transfer.engine import TransferEngine
from tests.transfer._helpers import pattern

RUN = 77
BLOCK = 64 * 1024


def main() -> None:
    url, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ttl = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
    with TransferEngine(f"{name}-engine", url, lease_ttl_s=ttl) as engine:
        engine.register_segment(name, size)
        view = engine.local_view(name)
        for i in range(size // BLOCK):
            view[i * BLOCK : (i + 1) * BLOCK] = pattern(RUN, i, i * BLOCK, BLOCK)
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        sys.stdin.read()


if __name__ == "__main__":
    main()
