"""``memory://``: an in-process metadata service (one process; tests and embedded use).

Every ``memory://NAME`` URL in a process shares one store per NAME, so an engine and the
target it spawned in a thread see each other. Leases expire on a monotonic clock. Lease ids
are random 62-bit numbers, so a client holding a lease from an earlier store (e.g. before the
HTTP server that embeds one restarted) never renews somebody else's lease by accident.
"""

from __future__ import annotations

import heapq
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Self

from kvctl.errors import UsageError
from kvctl.metadata.base import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataOptions,
    register_backend,
)
from kvctl.metadata.watch import (
    DEFAULT_POLL_S,
    Change,
    QueueWatch,
    Snapshot,
    Watch,
    WatchEvent,
)


class _Store:
    """Entries, leases, and the keys bound to each lease; leases expire through a heap of
    deadlines (a keepalive pushes a new deadline, stale ones are skipped when they come
    up), so expiring costs O(log n) per lease that ends, not a scan of every lease."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, tuple[bytes, LeaseId | None]] = {}
        self.leases: dict[LeaseId, tuple[float, float]] = {}  # id -> (ttl_s, deadline)
        self.bound: dict[LeaseId, set[str]] = {}  # id -> keys put under it
        self._deadlines: list[tuple[float, LeaseId]] = []
        self.watchers: list[QueueWatch] = []

    def notify(self, key: str, value: bytes | None) -> None:
        """Tell the watchers of ``key`` (called with the lock held, after the change)."""
        for watcher in self.watchers:
            if watcher.matches(key):
                watcher.push([WatchEvent(key, value)])

    def new_lease_id(self) -> LeaseId:
        while True:
            lid = LeaseId(secrets.randbits(62) + 1)
            if lid not in self.leases:
                return lid

    def grant(self, lid: LeaseId, ttl_s: float, now: float) -> None:
        self.leases[lid] = (ttl_s, now + ttl_s)
        self.bound[lid] = set()
        heapq.heappush(self._deadlines, (now + ttl_s, lid))

    def renew(self, lid: LeaseId, now: float) -> None:
        ttl, _ = self.leases[lid]
        self.leases[lid] = (ttl, now + ttl)
        heapq.heappush(self._deadlines, (now + ttl, lid))
        # Deadlines superseded by renewals pile up in the heap: rebuild it when they
        # outnumber the live leases.
        if len(self._deadlines) > 4 * len(self.leases) + 64:
            self._deadlines = [(d, lid) for lid, (_, d) in self.leases.items()]
            heapq.heapify(self._deadlines)

    def put(self, key: str, value: bytes, lease: LeaseId | None) -> None:
        old = self.data.get(key)
        if old is not None and old[1] is not None and old[1] != lease:
            self.bound.get(old[1], set()).discard(key)
        self.data[key] = (value, lease)
        if lease is not None:
            self.bound[lease].add(key)
        if self.watchers:
            self.notify(key, value)

    def delete(self, key: str) -> bool:
        old = self.data.pop(key, None)
        if old is None:
            return False
        if old[1] is not None:
            self.bound.get(old[1], set()).discard(key)
        if self.watchers:
            self.notify(key, None)
        return True

    def drop_lease(self, lid: LeaseId) -> None:
        self.leases.pop(lid, None)
        for key in self.bound.pop(lid, ()):
            entry = self.data.get(key)
            if entry is not None and entry[1] == lid:
                del self.data[key]
                if self.watchers:
                    self.notify(key, None)

    def expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, lid = heapq.heappop(heap)
            current = self.leases.get(lid)
            if current is not None and current[1] == deadline:
                self.drop_lease(lid)


_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()


class MemoryMetadata(MetadataClient):
    """Leased key/value entries in this process's memory."""

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        with _STORES_LOCK:
            self._store = _STORES.setdefault(name, _Store())
        self._closed = False

    @classmethod
    def private(cls) -> Self:
        """A client on a fresh store shared with nobody (e.g. the state of one HTTP server)."""
        client = cls.__new__(cls)
        client.url = "memory://(private)"
        client._store = _Store()
        client._closed = False
        return client

    def _now(self) -> float:
        return time.monotonic()

    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        with self._store.lock:
            self._store.expire(self._now())
            if lease is not None and lease not in self._store.leases:
                raise LeaseExpiredError(f"lease {lease} has expired or never existed",
                                    "grant a new lease and publish again")
            self._store.put(key, bytes(value), lease)

    def get(self, key: str) -> bytes | None:
        with self._store.lock:
            self._store.expire(self._now())
            entry = self._store.data.get(key)
            return None if entry is None else entry[0]

    def list(self, prefix: str) -> dict[str, bytes]:
        with self._store.lock:
            self._store.expire(self._now())
            return {k: v for k, (v, _) in self._store.data.items() if k.startswith(prefix)}

    def delete(self, key: str) -> bool:
        with self._store.lock:
            self._store.expire(self._now())
            return self._store.delete(key)

    def grant_lease(self, ttl_s: float) -> LeaseId:
        if ttl_s <= 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        with self._store.lock:
            lid = self._store.new_lease_id()
            self._store.grant(lid, ttl_s, self._now())
            return lid

    def keepalive(self, lease: LeaseId) -> None:
        with self._store.lock:
            self._store.expire(self._now())
            if lease not in self._store.leases:
                raise LeaseExpiredError(f"lease {lease} has expired",
                                        "grant a new lease and republish")
            self._store.renew(lease, self._now())

    def revoke(self, lease: LeaseId) -> None:
        with self._store.lock:
            self._store.drop_lease(lease)

    def watch(self, prefixes: str | Sequence[str], *, poll_s: float = DEFAULT_POLL_S) -> Watch:
        """Pushed: every put, delete and expiry reaches the watch as it happens (expiries
        are found at least every ``poll_s``, as the store finds them lazily)."""
        return _MemoryWatch(self._store, prefixes, poll_s=poll_s, now=self._now)

    def close(self) -> None:
        self._closed = True


class _MemoryWatch(QueueWatch):
    def __init__(self, store: _Store, prefixes: str | Sequence[str], *, poll_s: float,
                 now: Callable[[], float]) -> None:
        if not poll_s > 0:
            raise ValueError(f"watch poll interval {poll_s} s is not positive")
        super().__init__(prefixes, on_close=self._leave)
        self._store = store
        self._poll_s = poll_s
        self._now = now
        with store.lock:  # the snapshot and the subscription at one moment
            store.expire(now())
            self.push([Snapshot(p, {k: v for k, (v, _) in store.data.items()
                                    if k.startswith(p)}) for p in self.prefixes])
            store.watchers.append(self)

    def _leave(self) -> None:
        with self._store.lock:
            if self in self._store.watchers:
                self._store.watchers.remove(self)

    def wait(self, timeout_s: float) -> list[Change]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._store.lock:  # expiries are found lazily: look for them
                self._store.expire(self._now())
            left = deadline - time.monotonic()
            changes = super().wait(max(0.0, min(left, self._poll_s)))
            if changes or self.closed or time.monotonic() >= deadline:
                return changes


@register_backend("memory")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    return MemoryMetadata(parsed.netloc + parsed.path)
