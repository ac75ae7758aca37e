"""Paths, slicing and the retry/pause policy shared by the multi-path transports.

A *path* is one way to reach a peer: a TCP connection from a given local address (NIC), or
an RDMA queue pair on a given device. Large requests are cut into slices of at most
``slice_bytes`` and spread over the paths; a slice that fails is retried on another path up to
``max_retries`` times; a path that fails ``pause_after`` times in a row is paused for
``pause_s`` seconds (skipped unless every path is paused).

NICs are passed in (e.g. the ranking ``kvctl topo`` computes for a buffer's location), never
discovered here.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How failures are retried and failing paths paused.

    Attributes:
        max_retries: extra attempts per slice after the first, each on another path.
        pause_after: consecutive failures that pause a path.
        pause_s: how long a paused path is skipped, seconds.
    """

    max_retries: int = 3
    pause_after: int = 3
    pause_s: float = 5.0


class PathHealth:
    """Failure counts and pause deadlines for a fixed set of paths (thread-safe)."""

    def __init__(self, names: Sequence[str], policy: RetryPolicy) -> None:
        self.names = list(names)
        self.policy = policy
        self._failures = [0] * len(names)
        self._paused_until = [0.0] * len(names)
        self._next = 0
        self._lock = threading.Lock()

    def ok(self, index: int) -> None:
        """Record a success on path ``index``."""
        self._failures[index] = 0

    def failed(self, index: int) -> bool:
        """Record a failure; returns whether the path is now paused."""
        with self._lock:
            self._failures[index] += 1
            if self._failures[index] >= self.policy.pause_after:
                self._paused_until[index] = time.monotonic() + self.policy.pause_s
                self._failures[index] = 0
                return True
            return False

    def paused(self, index: int) -> bool:
        """Whether path ``index`` is paused now."""
        return self._paused_until[index] > time.monotonic()

    def pick(self, exclude: int = -1) -> int:
        """Next usable path round-robin, avoiding ``exclude`` and paused paths if possible."""
        with self._lock:
            n = len(self.names)
            now = time.monotonic()
            for step in range(n):
                i = (self._next + step) % n
                if i != exclude and self._paused_until[i] <= now:
                    self._next = i + 1
                    return i
            for step in range(n):  # every other path is paused: take any but the excluded
                i = (self._next + step) % n
                if i != exclude or n == 1:
                    self._next = i + 1
                    return i
            return 0  # pragma: no cover - n == 0 is rejected by callers


def slice_ranges(length: int, slice_bytes: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` pieces of at most ``slice_bytes`` covering ``[0, length)``."""
    offset = 0
    while offset < length:
        piece = min(slice_bytes, length - offset)
        yield offset, piece
        offset += piece
