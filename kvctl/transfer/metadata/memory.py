"""``memory://``: an in-process metadata service (one process; tests and embedded use).

Every ``memory://NAME`` URL in a process shares one store per NAME, so an engine and the
target it spawned in a thread see each other. Leases expire on a monotonic clock. Lease ids
are random 62-bit numbers, so a client holding a lease from an earlier store (e.g. before the
HTTP server that embeds one restarted) never renews somebody else's lease by accident.
"""

from __future__ import annotations

import secrets
import threading
import time
import urllib.parse
from typing import Self

from kvctl.errors import UsageError
from kvctl.transfer.metadata.base import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataOptions,
    register_backend,
)


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, tuple[bytes, LeaseId | None]] = {}
        self.leases: dict[LeaseId, tuple[float, float]] = {}  # id -> (ttl_s, deadline)

    def new_lease_id(self) -> LeaseId:
        while True:
            lid = LeaseId(secrets.randbits(62) + 1)
            if lid not in self.leases:
                return lid

    def expire(self, now: float) -> None:
        dead = {lid for lid, (_, deadline) in self.leases.items() if deadline <= now}
        if not dead:
            return
        for lid in dead:
            del self.leases[lid]
        for key in [k for k, (_, lid) in self.data.items() if lid in dead]:
            del self.data[key]


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
            self._store.data[key] = (bytes(value), lease)

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
            return self._store.data.pop(key, None) is not None

    def grant_lease(self, ttl_s: float) -> LeaseId:
        if ttl_s <= 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        with self._store.lock:
            lid = self._store.new_lease_id()
            self._store.leases[lid] = (ttl_s, self._now() + ttl_s)
            return lid

    def keepalive(self, lease: LeaseId) -> None:
        with self._store.lock:
            self._store.expire(self._now())
            if lease not in self._store.leases:
                raise LeaseExpiredError(f"lease {lease} has expired",
                                        "grant a new lease and republish")
            ttl, _ = self._store.leases[lease]
            self._store.leases[lease] = (ttl, self._now() + ttl)

    def revoke(self, lease: LeaseId) -> None:
        with self._store.lock:
            self._store.leases.pop(lease, None)
            for key in [k for k, (_, lid) in self._store.data.items() if lid == lease]:
                del self._store.data[key]

    def close(self) -> None:
        self._closed = True


@register_backend("memory")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    return MemoryMetadata(parsed.netloc + parsed.path)
