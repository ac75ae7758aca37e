"""The shared pool of ``kvctl sim pool`` replayed against a running kvctl store.

:class:`StorePoolRun` connects to a store master and hands the simulator one
:class:`StorePool` per pool cell (``pool_factory``). Each cell writes under its own key
prefix, ``kvctl-sim/<run-id>/c<cell>/``, so runs and cells never see each other's blocks and
never touch keys an engine wrote. A block is a small placeholder object
(:data:`DEFAULT_VALUE_BYTES` bytes taken from its block key); the store's own capacity and
LRU eviction decide what stays, so the simulator's ``pool_blocks`` is not a capacity here.

Per turn the replay costs at most three master round trips: one ``batch_exists`` for the
prompt's keys past the local hit, one ``batch_get`` of the pool hits (a read is a use: it
refreshes the store's LRU) and one ``batch_put`` of the blocks the instance computed. A
cell's keys are removed when the next cell starts and the last cell's when the run closes,
unless ``keep`` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence

from kvctl.errors import KvctlError, UsageError
from kvctl.store.allocator import DEFAULT_ALIGNMENT_BYTES
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError, StoreError, StoreUnavailableError
from kvctl.store.protocol import MAX_BATCH

_log = logging.getLogger("kvctl.sim.store_pool")

#: Root of every key a simulation run writes.
KEY_ROOT = "kvctl-sim/"
#: Bytes of each placeholder block object (the store allocates at least one 64-byte unit).
DEFAULT_VALUE_BYTES = 16
#: Staging buffer of the run's client: placeholder batches are tiny.
_STAGING_BYTES = 4 << 20


def _chunks(items: Sequence[str]) -> list[Sequence[str]]:
    return [items[i:i + MAX_BATCH] for i in range(0, len(items), MAX_BATCH)]


@dataclasses.dataclass
class _Counters:
    exists_calls: int = 0
    get_calls: int = 0
    put_calls: int = 0
    keys_written: int = 0
    read_misses: int = 0
    seconds: float = 0.0


class StorePool:
    """One pool cell backed by the store: block ``k`` is the object ``prefix + k.hex()``.

    Implements :class:`~kvctl.sim.pool.PoolBackend`.
    """

    name = "kvctl-store"

    def __init__(self, client: StoreClient, prefix: str, value_bytes: int,
                 counters: _Counters) -> None:
        self._client = client
        self.prefix = prefix
        self._value_bytes = value_bytes
        self._counters = counters
        #: every key this cell put (removed at the end unless the run keeps them).
        self.written: set[str] = set()

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.prefix + k.hex() for k in keys]

    def _value(self, key: bytes) -> bytes:
        size = self._value_bytes
        return (key * (size // max(1, len(key)) + 1))[:size]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the store holds (``batch_exists``; no recency change)."""
        started = time.perf_counter()
        out: list[bool] = []
        for chunk in _chunks(self._names(keys)):
            out.extend(self._client.batch_exists(chunk))
            self._counters.exists_calls += 1
        self._counters.seconds += time.perf_counter() - started
        return out

    def read_many(self, keys: Sequence[bytes]) -> None:
        """Read the blocks back (``batch_get``: a use in the store's LRU).

        A block gone since ``contains_many`` (another client's eviction) is counted in
        ``read_misses``; the replay already counted it as a hit.

        Raises:
            StoreError: the store returned other bytes than were put, or failed.
        """
        started = time.perf_counter()
        names = self._names(keys)
        results = self._client.batch_get(names)
        self._counters.seconds += time.perf_counter() - started
        self._counters.get_calls += (len(names) + MAX_BATCH - 1) // MAX_BATCH
        for key, name, got in zip(keys, names, results, strict=True):
            if isinstance(got, ObjectNotFoundError):
                self._counters.read_misses += 1
            elif isinstance(got, KvctlError):
                raise got
            elif got != self._value(key):
                raise StoreError(f"store returned other bytes for {name!r} than were put",
                                 "another client writes under this run's prefix; rerun")

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """Put a placeholder for each block (one ``batch_put``).

        Raises:
            StoreFullError, StoreUnavailableError: the first item that failed.
        """
        started = time.perf_counter()
        names = self._names(keys)
        items = [(name, self._value(key)) for name, key in zip(names, keys, strict=True)]
        errors = self._client.batch_put(items)
        self._counters.seconds += time.perf_counter() - started
        self._counters.put_calls += (len(items) + MAX_BATCH - 1) // MAX_BATCH
        for error in errors:
            if error is not None:
                raise error
        self.written.update(names)
        self._counters.keys_written += len(names)


@dataclasses.dataclass(frozen=True)
class StoreRunSummary:
    """What a store-backed run did.

    Attributes:
        store: master address.
        run_id: this run's id; its keys live under ``prefix``.
        prefix: ``kvctl-sim/<run-id>/``.
        value_bytes: size of each placeholder block object, bytes.
        capacity_bytes: the store's DRAM capacity when the run started, bytes.
        capacity_blocks: about how many placeholder blocks fit before the store evicts
            (capacity x high watermark / allocation unit); the simulator's ``pool_blocks``
            plays no part.
        cells: pool cells replayed against the store.
        keys_written: block objects put, over all cells.
        keys_removed: of those, removed at the end of their cell (0 with ``kept``).
        keys_left: objects still under ``prefix`` after the run (0 unless ``kept``);
            ``None`` when the cleanup failed (the store became unreachable).
        read_misses: blocks reported present but gone when read (another client evicted
            them); the replay counted them as hits.
        exists_calls, get_calls, put_calls: master round trips of each kind.
        store_seconds: time spent waiting on the store (exists, get, put, remove), seconds.
        kept: the run's keys were left in the store (``--keep``).
    """

    store: str
    run_id: str
    prefix: str
    value_bytes: int
    capacity_bytes: int
    capacity_blocks: int
    cells: int
    keys_written: int
    keys_removed: int
    keys_left: int | None
    read_misses: int
    exists_calls: int
    get_calls: int
    put_calls: int
    store_seconds: float
    kept: bool


class StorePoolRun:
    """Connect to the store at ``address`` and make one :class:`StorePool` per cell.

    Use as a context manager; pass :meth:`factory` as ``simulate_pool(...,
    pool_factory=run.factory)``; read :attr:`summary` after the ``with`` block.

    Args:
        address: master ``HOST:PORT``.
        token: the store's shared secret.
        run_id: key namespace of this run (default: random, 12 hex characters).
        keep: leave the run's keys in the store.
        value_bytes: placeholder object size, bytes (1 or more).

    Raises:
        UsageError: bad ``run_id`` or ``value_bytes``.
        StoreUnavailableError: the master cannot be reached.
    """

    def __init__(self, address: str, *, token: str | None = None, run_id: str | None = None,
                 keep: bool = False, value_bytes: int = DEFAULT_VALUE_BYTES) -> None:
        run_id = run_id or secrets.token_hex(6)
        if "/" in run_id or not run_id.isprintable():
            raise UsageError(f"run id {run_id!r} contains '/' or unprintable characters",
                             "use letters, digits, '-' or '_'")
        if value_bytes < 1:
            raise UsageError(f"placeholder size {value_bytes} bytes is below 1", "use 1 or more")
        self.address = address
        self.run_id = run_id
        self.prefix = f"{KEY_ROOT}{run_id}/"
        self.keep = keep
        self.value_bytes = value_bytes
        try:
            self._client = StoreClient(address, token=token, lease=False,
                                       staging_bytes=_STAGING_BYTES)
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(
                exc.cause, "start one with 'kvctl store serve', or pass --store HOST:PORT of a "
                "running master") from exc
        try:
            status = self._client.status()
        except BaseException:
            self._client.close()
            raise
        unit = -(-value_bytes // DEFAULT_ALIGNMENT_BYTES) * DEFAULT_ALIGNMENT_BYTES
        self._capacity_bytes = status.capacity_bytes
        self._capacity_blocks = int(status.capacity_bytes * status.high_watermark) // unit
        self._counters = _Counters()
        self._cells: list[StorePool] = []
        self._removed = 0
        self._closed = False
        self.summary: StoreRunSummary | None = None

    @property
    def capacity_blocks(self) -> int:
        """About how many placeholder blocks the store holds before it evicts."""
        return self._capacity_blocks

    def factory(self, capacity_blocks: int) -> StorePool:
        """A fresh, empty pool cell (``capacity_blocks`` is ignored: the store decides).

        The previous cell's keys are removed first (unless ``keep``), so cells do not share
        the store's capacity.
        """
        del capacity_blocks
        if self._closed:
            raise StoreError("the store-backed pool run is closed", "start a new run")
        if self._cells and not self.keep:
            self._remove(self._cells[-1])
        pool = StorePool(self._client, f"{self.prefix}c{len(self._cells)}/", self.value_bytes,
                         self._counters)
        self._cells.append(pool)
        return pool

    def _remove(self, pool: StorePool) -> None:
        started = time.perf_counter()
        names = sorted(pool.written)
        for chunk in _chunks(names):
            self._removed += sum(self._client.batch_remove(chunk))
        pool.written.clear()
        self._counters.seconds += time.perf_counter() - started

    def close(self) -> StoreRunSummary:
        """Remove the last cell's keys (unless ``keep``), count what is left under the run's
        prefix, close the client and return the summary (idempotent)."""
        if self.summary is not None:
            return self.summary
        self._closed = True
        left: int | None = None
        try:
            if self._cells and not self.keep:
                self._remove(self._cells[-1])
            objects, truncated = self._client.list(self.prefix, limit=MAX_BATCH)
            left = len(objects)
            if truncated:
                _log.warning("more than %d keys left under %s", left, self.prefix)
        except KvctlError as exc:
            _log.warning("could not clean up %s in the store at %s: %s (remove them with "
                         "'kvctl store ls %s' and 'kvctl store rm')", self.prefix, self.address,
                         exc.cause, self.prefix)
        finally:
            with contextlib.suppress(KvctlError):
                self._client.close()
        c = self._counters
        self.summary = StoreRunSummary(
            store=self.address, run_id=self.run_id, prefix=self.prefix,
            value_bytes=self.value_bytes, capacity_bytes=self._capacity_bytes,
            capacity_blocks=self._capacity_blocks, cells=len(self._cells),
            keys_written=c.keys_written, keys_removed=self._removed, keys_left=left,
            read_misses=c.read_misses, exists_calls=c.exists_calls, get_calls=c.get_calls,
            put_calls=c.put_calls, store_seconds=c.seconds, kept=self.keep)
        return self.summary

    def __enter__(self) -> StorePoolRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_VALUE_BYTES", "KEY_ROOT", "StorePool", "StorePoolRun", "StoreRunSummary"]
