"""What a store client remembers about where objects are, to read them before the master
answers.

- **Where**: the replica each key was last written to or read from by this client
  (version, checksum, size, segment, offset), bounded and least recently used first out.
  A get of such a key reads that replica while the master answers (*early read*, see
  :mod:`kvctl.store.client`); the master's answer decides whether the bytes count.
- **Attached memory**: the node memory a master sends with its answers (a node in the
  master's process, ``kvctl store serve``). Keys there need no early read.

Thread-safe. Nothing here is ever trusted without the master's answer.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Container, Iterable, Sequence

#: Most keys whose last location a client remembers for early reads.
WHERE_ENTRIES = 65536
#: Largest read started before the master's answer (a wrong guess costs this much traffic).
EARLY_READ_BYTES = 4 << 20


class Where:
    """One replica of one version of an object, as this client last wrote or read it."""

    __slots__ = ("checksum", "offset", "segment", "size", "version")

    def __init__(self, version: int, checksum: int, size: int, segment: str, offset: int
                 ) -> None:
        self.version, self.checksum, self.size = version, checksum, size
        self.segment, self.offset = segment, offset


class Recall:
    """A client's memory of object locations and of the memory its master attaches from.

    Args:
        entries: most keys remembered.
    """

    def __init__(self, entries: int = WHERE_ENTRIES) -> None:
        self.entries = entries
        self.where: collections.OrderedDict[str, Where] = collections.OrderedDict()
        self.lock = threading.Lock()
        #: segments whose objects the master attaches to its answers; replaced, never
        #: changed in place, so readers take no lock.
        self.attached: frozenset[str] = frozenset()

    def remember(self, where: Sequence[tuple[str, Where]]) -> None:
        """Note where keys were just written or read."""
        if not where:
            return
        with self.lock:
            known = self.where
            for key, w in where:
                known[key] = w
                known.move_to_end(key)
            while len(known) > self.entries:
                known.popitem(last=False)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop keys (removed by this client)."""
        with self.lock:
            for key in keys:
                self.where.pop(key, None)

    def learn_attached(self, segment: str) -> None:
        """The master sent bytes of ``segment`` with an answer."""
        if segment not in self.attached:
            with self.lock:
                self.attached = self.attached | {segment}

    def guesses(self, wire: Sequence[str], sizes: Sequence[int] | None, *,
                mapped: Container[str], known: Container[str]) -> list[tuple[int, Where]]:
        """Keys (by index) worth reading before the master answers, with where: remembered,
        on a segment the engine knows (``known``) and not mapped here (``mapped``: a copy
        is cheaper than a guess), not in attached memory (the answer brings those), up to
        :data:`EARLY_READ_BYTES` in all, and fitting the caller's buffer (``sizes``)."""
        out: list[tuple[int, Where]] = []
        budget = EARLY_READ_BYTES
        attached = self.attached
        with self.lock:
            where = self.where
            if not where:
                return out
            for i, key in enumerate(wire):
                w = where.get(key)
                if w is not None and w.size <= budget and w.segment not in mapped \
                        and w.segment not in attached and w.segment in known and (
                            sizes is None or sizes[i] >= w.size):
                    out.append((i, w))
                    budget -= w.size
        return out
