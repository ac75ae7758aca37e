"""The store client: put/get/batch/zero-copy against a master and its storage nodes.

A get is one master round trip (locations, and a lease that keeps the object from being
evicted or its space reused while it is read) plus one transfer-engine READ from the first
replica; the bytes are verified against the object's xxh3 checksum and, on a transfer
failure or a mismatch, read from the next replica. A get of a key this client wrote or read
recently also reads the remembered replica while the master answers (*early read*; the bytes
count only if they are where the master says and match its checksum). A master that hosts a
node in its own process (``kvctl store serve``) sends that node's bytes behind its answer
(*attached bytes*): one round trip, verified the same way.

A small put is placed by the client in space the master reserved for it (see
:mod:`kvctl.store.arena`): one engine WRITE per replica, then a report
(:class:`~kvctl.store.protocol.PutAt`), one master round trip. Other puts (large, or when
no reservation can be had) are one master round trip (allocation on ``replicas`` distinct
nodes), one WRITE per replica, and a commit, a second round trip (a reader that races the
commit sees the object as *pending*, reads it, and accepts it only if the checksum
matches).

*Durable or not acknowledged*: reports and commits ask for an answer (``ack``), which the
master sends only once the objects are durable in its state (its journal written and
fsync'ed, or etcd took them). A put returns only then; a key the master did not take (a
node of its reservation stopped answering heartbeats, its allocation expired) or could
not record fails (a reservation put is retried through the master first), so a put that
returned is readable for as long as a node holding it lives.

With a tenant's token the master confines the client to keys under ``<tenant>/`` (see
:mod:`kvctl.store.tenants`); the client learns that namespace at login and adds it to every
key it sends and strips it from every key it returns, so the API is the same for tenants.

Absence and failure stay distinct: a missing key raises (or, in batch results, is)
:class:`~kvctl.store.errors.ObjectNotFoundError`; anything else is a
:class:`~kvctl.store.errors.StoreError` or :class:`~kvctl.store.errors.StoreUnavailableError`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvctl.errors import KvctlError, NotFoundError
from kvctl.store import protocol as p
from kvctl.store.arena import DEFAULT_RESERVE_BYTES, Arena, Arenas
from kvctl.store.checksum import checksum
from kvctl.store.datapath import DataPath
from kvctl.store.errors import (
    BadRequestError,
    ChecksumMismatchError,
    ObjectNotFoundError,
    ProtocolError,
    StoreBusyError,
    StoreError,
    StoreUnavailableError,
)
from kvctl.store.localcopy import (
    DEFAULT_STAGING_BYTES,
)
from kvctl.store.recall import Recall, Where
from kvctl.store.rpc import MasterConnection, MasterPool, error_from
from kvctl.store.sharedtier.config import parse_map
from kvctl.store.sharedtier.reader import SharedReader
from kvctl.transfer.batch import OpCode, TransferRequest

_log = logging.getLogger("kvctl.store.client")

Buffer = bytes | bytearray | memoryview


#: Largest single write / read made without a batch (TransferEngine.move_direct). Larger
#: reads go faster as a batch: it slices them over several connections at once.
DIRECT_WRITE_BYTES = 4 << 20
DIRECT_READ_BYTES = 1 << 20
#: Most object bytes a get takes attached to the master's reply (node in the master's process).
ATTACHED_GET_BYTES = 4 << 20
#: How long a wait for the master's or a node's reply polls before it sleeps, microseconds.
DEFAULT_SPIN_US = 200.0


class StoreClient:
    """Connect to the master at ``master`` (``HOST:PORT``). Thread-safe; ``close()`` twice
    is fine.

    Args:
        master: master address.
        token: shared secret (master and data path).
        replicas: copies each put stores (on distinct nodes).
        transport: transfer-engine transport: ``auto`` (shm on the same host, else tcp),
            ``shm`` or ``tcp``.
        staging_bytes: size of the registered staging buffer for ``bytes`` values.
        timeout_s: per-operation timeout, seconds.
        lease: ask for a lease on gets (protects objects being read from eviction).
        reserve_bytes: space to reserve for placing small puts here (one round trip per put
            instead of two; see :mod:`kvctl.store.arena`); 0 puts everything through the
            master.
        attached_bytes: the most object bytes a get takes behind the master's reply when
            the master hosts a node (``kvctl store serve``); 0 always reads from the node.
        spin_us: how long a wait for the master's or a node's reply polls before the thread
            sleeps, microseconds. A sleeping thread's wake-up costs up to 100 µs on a virtual
            machine, most of a loopback round trip; polling costs up to this much CPU per
            request. 0 never polls.
        shared_map: where this host mounts the master's shared tier when not at the
            master's path: ``MASTER_DIR=LOCAL_DIR[,...]``.

    Raises:
        StoreUnavailableError: the master cannot be reached.
    """

    def __init__(self, master: str, *, token: str | None = None, replicas: int = 1,
                 transport: str = "auto", staging_bytes: int = DEFAULT_STAGING_BYTES,
                 timeout_s: float = 30.0, lease: bool = True,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES,
                 attached_bytes: int = ATTACHED_GET_BYTES,
                 spin_us: float = DEFAULT_SPIN_US, shared_map: str = "") -> None:
        if replicas < 1:
            raise BadRequestError(f"replicas {replicas} is below 1", "ask for 1 or more")
        self.master = master
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.lease = lease
        #: the most object bytes a get takes behind the master's reply (0: never).
        self.attached_bytes = max(0, attached_bytes)
        self._pool = MasterPool(master, token=token, timeout_s=timeout_s,
                                spin_s=max(0.0, spin_us) / 1e6)
        #: key prefix the master confines this client to (a tenant's), else "".
        self.namespace = self._pool.namespace
        try:
            self._data = DataPath(f"store-client-{secrets.token_hex(6)}", transport=transport,
                                  token=token, timeout_s=timeout_s,
                                  staging_bytes=staging_bytes, nodes=self._nodes,
                                  spin_s=max(0.0, spin_us) / 1e6)
        except BaseException:
            self._pool.close()
            raise
        #: the transfer engine that moves this client's bytes
        self.engine = self._data.engine
        #: leases to end, sent with the next request (no message of their own).
        self._releases: list[tuple[str, int]] = []
        self._releases_lock = threading.Lock()
        #: where keys were last written or read, and which memory the master attaches from
        self._recall = Recall()
        #: reads objects from the master's shared tier (kvctl.store.sharedtier)
        self.shared = SharedReader(parse_map(shared_map))
        #: shared-tier files found bad, reported after the get (:meth:`_read_shared`)
        self._shared_bad: list[tuple[str, int]] = []
        self._arenas = Arenas(reserve_bytes, replicas, self._reserve, self._end_arena)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the engine and the master connections."""
        if self._closed:
            return
        with contextlib.suppress(KvctlError):
            self._flush_releases()
        self._arenas.close()
        self._closed = True
        self.shared.close()
        self._data.close()
        self._pool.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def leader(self) -> str:
        """The master that answered last: :attr:`master`, or the one of its addresses
        that leads (``A:PORT,B:PORT``, see :class:`~kvctl.store.rpc.MasterSet`)."""
        return self._pool.answering

    def register_buffer(self, buffer: Any) -> None:
        """Register a writable buffer (bytearray, mmap, numpy array) for zero-copy
        :meth:`get_into`/:meth:`batch_get_into`/:meth:`put_from` on views of it."""
        self._data.register_buffer(buffer)

    # ------------------------------------------------------------------ master calls

    def _call(self, msg: Any) -> p.Reply:
        if self._closed:
            raise StoreError("store client is closed", "open a new StoreClient")
        return self._pool.call(msg)

    def _expect(self, reply: p.Reply, cls: type[Any], key: str | None = None) -> Any:
        if isinstance(reply, cls):
            return reply
        if isinstance(reply, p.Fail):
            raise error_from(reply.error, key=key)
        raise ProtocolError(f"unexpected {type(reply).__name__} reply from the master",
                            "use the same kvctl version as the master")

    def _nodes(self) -> list[p.NodeAddress]:
        """The live storage nodes (for the data path to learn their segments)."""
        reply: p.NodesReply = self._expect(self._call(p.Nodes()), p.NodesReply)
        return reply.nodes

    def _take_releases(self) -> tuple[list[str], list[int]]:
        """Leases to end, at most a quarter of a master frame of keys (the rest wait for
        the next request)."""
        with self._releases_lock:
            pending = self._releases
            budget = self._frame_budget()
            size = 0
            for n, (key, _) in enumerate(pending):
                size += len(key) * 4 + 16  # (UTF-8 is at most 4 bytes a character)
                if size > budget:
                    pending, self._releases = pending[:n], pending[n:]
                    break
            else:
                self._releases = []
        return [k for k, _ in pending], [v for _, v in pending]
    # ------------------------------------------------------------------ put

    def put(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key`` (replacing any previous value).

        Raises:
            StoreFullError: no room even after eviction.
            StoreUnavailableError: master or nodes unreachable.
        """
        err = self.batch_put([(key, value)])[0]
        if err is not None:
            raise err

    def put_from(self, key: str, view: memoryview) -> None:
        """Like :meth:`put`, writing straight from a view of a registered buffer."""
        self.put(key, view)

    def batch_put(self, items: Sequence[tuple[str, Buffer]]) -> list[KvctlError | None]:
        """Store many objects in one master round trip; per item ``None`` or its error.

        Items the master answers ``busy`` (room being made by write-back eviction, or
        another put of the key in flight) are retried with backoff until ``timeout_s``.
        """
        out: list[KvctlError | None] = [_odd_key(k) for k, _ in items]
        todo = [i for i, err in enumerate(out) if err is None]  # (odd keys are never sent)
        if not todo:
            return out
        deadline = time.monotonic() + self.timeout_s
        pause_s = 0.005
        while True:
            part = self._put_once([items[i] for i in todo])
            for i, err in zip(todo, part, strict=True):
                out[i] = err
            todo = [i for i in todo if isinstance(out[i], StoreBusyError)]
            if not todo or time.monotonic() + pause_s > deadline:
                return out
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.1)

    def _put_once(self, items: Sequence[tuple[str, Buffer]]) -> list[KvctlError | None]:
        views = [memoryview(v).cast("B") for _, v in items]
        keys = [k for k, _ in items]
        wire = [self.namespace + k for k in keys]
        sums = [checksum(v) for v in views]
        placed = self._arenas.place([v.nbytes for v in views]) if self._placeable(wire) \
            else None
        kept: set[int] = set()
        out = self._put_placed(keys, wire, views, sums, *placed, kept=kept) if placed \
            else None
        if out is None:  # no reservation, or the master that granted it is gone
            return self._put_via_master(keys, wire, views, sums)
        again = [i for i, err in enumerate(out) if err is not None]
        if again:  # a replica's node failed, or the write ended too late: through the master
            redo = self._put_via_master([keys[i] for i in again], [wire[i] for i in again],
                                        [views[i] for i in again], [sums[i] for i in again])
            for i, err in zip(again, redo, strict=True):
                # A kept item's second refusal ('takes no writes') would hide that the
                # master has it: its first answer stands.
                out[i] = out[i] if err is not None and i in kept else err
        return out

    def _placeable(self, wire: list[str]) -> bool:
        """Whether a put of these keys may be placed in a reservation: every key must be
        valid and the report must fit one master message (else the master answers for
        each key, in chunks)."""
        if len(wire) > p.MAX_BATCH or any(p.check_key(k) is not None for k in wire):
            return False
        return sum(len(k) * 4 + 32 for k in wire) <= self._pool.max_frame_bytes // 2

    def _put_via_master(self, keys: list[str], wire: list[str], views: list[memoryview],
                        sums: list[int]) -> list[KvctlError | None]:
        """Allocation by the master, writes, commits answered once durable (two round
        trips)."""
        out: list[KvctlError | None] = [None] * len(keys)
        for start, end in self._chunks([v.nbytes for v in views], wire):
            reply = self._expect(self._call(p.Put(
                items=[p.PutItem(wire[i], views[i].nbytes, sums[i]) for i in range(start, end)],
                replicas=self.replicas)), p.PutReply)
            self._check_slots(reply.slots, wire[start:end])
            self._write_chunk(keys, wire, views, reply.slots, start, out)
            self._recall.remember([(wire[start + j], Where(
                slot.version, sums[start + j], views[start + j].nbytes, slot.locations[0].segment,
                slot.locations[0].offset)) for j, slot in enumerate(reply.slots)
                if isinstance(slot, p.PutSlot) and slot.locations and not slot.skip
                and out[start + j] is None])
        return out

    def _put_placed(self, keys: list[str], wire: list[str], views: list[memoryview],
                    sums: list[int], arena: Arena, offsets: list[int], *,
                    kept: set[int] | None = None) -> list[KvctlError | None] | None:
        """Write objects at ``offsets`` of the reservation ``arena`` and report them to the
        master (one round trip per put, answered once they are durable); ``None`` when the
        master that granted the reservation is gone (the caller puts through the new
        one). ``kept`` gets the items the master recorded but could not make durable yet
        (its state is slow or stalls): it writes them later."""
        n = len(keys)
        out: list[KvctlError | None] = [None] * n
        slots: list[p.PutSlot | p.ErrorInfo] = [p.PutSlot(key=wire[i], version=0, locations=[
            p.Location(loc.node_id, loc.segment, loc.offset + offsets[i], views[i].nbytes)
            for loc in arena.locations]) for i in range(n)]
        settled = False
        try:
            with self._pool.connection() as conn:  # a restarted master is noticed here
                if conn.instance != arena.instance:
                    self._arenas.drop(arena)
                    settled = True
                    self._arenas.done(arena, report=False)
                    return None  # never write into space the new master may hand out
            self._write_slots(keys, views, slots, 0, out)
            if self._arenas.late(arena):
                # Written too close to the reservation's end: the report could arrive after
                # the master took the space back. The caller puts these through the master.
                for i in range(n):
                    out[i] = out[i] or StoreUnavailableError(
                        f"writing {keys[i]!r} into reservation {arena.rid:x} ended too late",
                        "retry the put (StoreClient does, through the master)")
            if any(out):
                self._arenas.retire(arena)  # a node failed, or too slow: reserve anew
            good = [i for i in range(n) if out[i] is None]
            reply: p.Reply = p.Ok()
            with self._pool.connection() as conn:
                same = conn.instance == arena.instance
                if not same:
                    self._arenas.drop(arena)
                count = self._arenas.done(arena, report=same)
                settled = True
                if same:
                    # The put returns once the master has recorded the objects durably
                    # (or refused them: a node of the reservation stopped answering).
                    report = p.PutAt(
                        reservation=arena.rid, keys=[wire[i] for i in good],
                        sizes=[views[i].nbytes for i in good], checksums=[sums[i] for i in good],
                        offsets=[offsets[i] for i in good], end=count is not None,
                        count=count or 0, ack=bool(good))
                    if good:
                        reply = conn.call(report)
                    else:
                        conn.send(report)
        finally:
            if not settled:
                count = self._arenas.done(arena, report=False)
                if count is not None:
                    self._end_arena(arena, count)
        if not same:
            return None
        self._settle(reply, good, keys, out)
        if kept is not None and isinstance(reply, p.Fail) and reply.error.code == "unavailable":
            kept.update(good)  # recorded, not durable yet (see above)
        if not isinstance(reply, p.Ok):
            self._arenas.retire(arena)  # refused (a node not alive): reserve anew
            good = [i for i in good if out[i] is None]
        first = arena.locations[0]
        self._recall.remember([(wire[i], Where(0, sums[i], views[i].nbytes, first.segment,
                                         first.offset + offsets[i])) for i in good])
        return out

    def _reserve(self, size: int, replicas: int) -> tuple[p.Reservation, str] | None:
        """Ask the master for a reservation (see :mod:`kvctl.store.arena`)."""
        try:
            with self._pool.connection() as conn:
                reply = conn.call(p.Reserve(size=size, replicas=replicas))
                instance = conn.instance
        except KvctlError as exc:
            _log.debug("no reservation: %s", exc.cause)
            return None
        if not isinstance(reply, p.Reservation) or len(reply.locations) != replicas:
            if isinstance(reply, p.Fail):
                _log.debug("no reservation: %s", reply.error.cause)
            return None
        return reply, instance

    def _end_arena(self, arena: Arena, count: int) -> None:
        """Give a reservation's unused space back once the master has taken ``count``
        reports for it (best effort: it expires anyway)."""
        try:
            with self._pool.connection() as conn:
                if conn.instance == arena.instance:
                    conn.send(p.PutAt(reservation=arena.rid, end=True, count=count))
        except KvctlError as exc:
            _log.debug("ending reservation %x: %s", arena.rid, exc.cause)

    def _check_slots(self, slots: Sequence[p.PutSlot | p.GetSlot | p.ErrorInfo],
                     wire: list[str]) -> None:
        """Every slot must answer the key asked for, in order: a reply meant for another
        request must never steer a write or a read."""
        if len(slots) != len(wire) or any(
                not isinstance(s, p.ErrorInfo) and s.key != k
                for s, k in zip(slots, wire, strict=False)):
            raise ProtocolError(f"store master at {self.master} answered for other keys than "
                                "asked", "use the same kvctl version as the master; retry")

    def _chunks(self, sizes: list[int], keys: list[str]) -> list[tuple[int, int]]:
        """Split a batch so each chunk fits in half the staging buffer and its keys (sent
        and answered with slots) in a quarter of a master frame."""
        limit = max(1, self._data.staging.capacity_bytes // 2)
        key_limit = min(KEY_CHUNK_BYTES // 2, self._frame_budget())  # (the master's frames)
        chunks: list[tuple[int, int]] = []
        start, total, key_total = 0, 0, 0
        for i, size in enumerate(sizes):
            key_bytes = len(keys[i]) * 4 + 64
            if i > start and (total + size > limit or i - start >= p.MAX_BATCH
                              or key_total + key_bytes > key_limit):
                chunks.append((start, i))
                start, total, key_total = i, 0, 0
            total += size
            key_total += key_bytes
        if sizes:
            chunks.append((start, len(sizes)))
        return chunks

    def _write_chunk(self, keys: list[str], wire: list[str], views: list[memoryview],
                     slots: list[p.PutSlot | p.ErrorInfo], start: int,
                     out: list[KvctlError | None]) -> None:
        commits = self._write_slots(keys, views, slots, start, out)
        good = [(i, v) for i, v in commits if out[i] is None]
        bad = [(wire[i], v) for i, v in commits if out[i] is not None]
        with self._pool.connection() as conn:
            if bad:
                conn.send(p.Commit(keys=[k for k, _ in bad], versions=[v for _, v in bad],
                                   ok=False))
            if good:
                # The put returns once the master has recorded the commit durably.
                reply = conn.call(p.Commit(keys=[wire[i] for i, _ in good],
                                           versions=[v for _, v in good], ack=True))
        if good:
            self._settle(reply, [i for i, _ in good], keys, out)

    def _settle(self, reply: p.Reply, items: list[int], keys: list[str],
                out: list[KvctlError | None]) -> None:
        """Apply the master's answer to a commit or report with ``ack`` (about ``items``,
        in order) to ``out``: an item the master did not take, or did not record durably,
        gets its error."""
        if isinstance(reply, p.Ok):
            return
        if isinstance(reply, p.Fail):
            for i in items:
                out[i] = out[i] or error_from(reply.error, key=keys[i])
            return
        if not isinstance(reply, p.Acked) or len(reply.refused) != len(reply.errors) or any(
                not 0 <= j < len(items) for j in reply.refused):
            raise ProtocolError(f"store master at {self.master} answered a commit with "
                                f"{type(reply).__name__}", "use the same kvctl version")
        for j, info in zip(reply.refused, reply.errors, strict=True):
            out[items[j]] = out[items[j]] or error_from(info, key=keys[items[j]])

    def _write_slots(self, keys: list[str], views: list[memoryview],
                     slots: Sequence[p.PutSlot | p.ErrorInfo], start: int,
                     out: list[KvctlError | None]) -> list[tuple[int, int]]:
        """Write item ``start + j`` to every location of ``slots[j]``; failures land in
        ``out``. Returns ``(item index, version)`` of every slot written or tried (not
        skipped, not refused by the master)."""
        reqs: list[TransferRequest] = []
        locals_: list[memoryview] = []
        owners: list[int] = []
        staged: list[tuple[int, int]] = []
        temps: list[str] = []
        commits: list[tuple[int, int]] = []  # (item index, version)
        with contextlib.suppress(KvctlError):  # unreachable: each write reports it below
            self._data.ensure_segments({loc.segment for s in slots if isinstance(s, p.PutSlot)
                                   for loc in s.locations})
        only = slots[0] if len(slots) == 1 else None
        tried = False  # the direct write below failed: the batch is the fallback
        if isinstance(only, p.PutSlot) and not only.skip and len(only.locations) == 1 and (
                only.locations[0].segment not in self._data.inline):
            # One value, one replica on another host: straight from the caller's buffer
            # (no staging copy, no batch); a batch below if that fails.
            loc, view = only.locations[0], views[start]
            if view.nbytes > 0:
                if self._data.direct(OpCode.WRITE, TransferRequest(
                        OpCode.WRITE, "", 0, loc.segment, loc.offset, view.nbytes), view):
                    return [(start, only.version)]
                tried = True
        try:
            for j, slot in enumerate(slots):
                i = start + j
                if isinstance(slot, p.ErrorInfo):
                    out[i] = error_from(slot, key=keys[i])
                    continue
                if slot.skip:
                    continue
                commits.append((i, slot.version))
                view = views[i]
                if view.nbytes == 0:
                    continue
                inline = all(loc.segment in self._data.inline for loc in slot.locations)
                src = ("", 0) if inline else self._data.source(view, staged, temps)
                for loc in slot.locations:
                    reqs.append(TransferRequest(OpCode.WRITE, src[0], src[1], loc.segment,
                                                loc.offset, view.nbytes))
                    locals_.append(view)
                    owners.append(i)
            failures = self._data.move(OpCode.WRITE, reqs, locals_, direct=not tried)
        finally:
            for stage in staged:
                self._data.release(stage, None)
            for name in temps:
                self._data.release(None, name)
        for i, cause in zip(owners, failures, strict=True):
            if cause is not None and out[i] is None:
                out[i] = StoreUnavailableError(f"writing {keys[i]!r} to a node failed: {cause}",
                                               "check the storage nodes (kvctl store status)")
        return commits

    # ------------------------------------------------------------------ get

    def get(self, key: str) -> bytes:
        """The value of ``key``.

        Raises:
            ObjectNotFoundError: the key is not stored (or was evicted).
            ChecksumMismatchError: every replica returned bytes that fail the checksum.
            StoreUnavailableError: master or every replica's node unreachable.
        """
        result = self.batch_get([key])[0]
        if isinstance(result, KvctlError):
            raise result
        return result

    def get_into(self, key: str, buffer: Any) -> int:
        """Read ``key`` into ``buffer`` (zero-copy when it is inside a registered buffer);
        returns the object size in bytes."""
        result = self.batch_get_into([key], [buffer])[0]
        if isinstance(result, KvctlError):
            raise result
        return result

    def batch_get(self, keys: Sequence[str]) -> list[bytes | KvctlError]:
        """Values of many keys in one master round trip; per key bytes or its error."""
        return self._get_all(list(keys), None)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]
                       ) -> list[int | KvctlError]:
        """Read many keys into caller buffers; per key the size or its error."""
        if len(keys) != len(buffers):
            raise BadRequestError(f"{len(keys)} keys but {len(buffers)} buffers",
                                  "pass one buffer per key")
        views = [memoryview(b).cast("B") for b in buffers]
        if any(v.readonly for v in views):  # (else a raw BufferError, or 'unavailable')
            i = next(j for j, v in enumerate(views) if v.readonly)
            raise BadRequestError(f"buffer {i} (for {keys[i]!r}) is read-only",
                                  "pass writable buffers (bytearray, mmap, numpy array)")
        return [r if isinstance(r, KvctlError) else len(r) if isinstance(r, bytes) else r
                for r in self._get_all(list(keys), views)]

    def _get_all(self, keys: list[str], dests: list[memoryview] | None) -> list[Any]:
        """Every key's result, in requests that fit the master's frames both ways (a reply
        echoes each key, so a batch of long keys is split by bytes, not only by count);
        keys the master left out of a full reply are asked again."""
        out: list[Any] = [None] * len(keys)
        todo: list[int] = []
        for i, key in enumerate(keys):
            bad = _odd_key(key)
            if bad is None:
                todo.append(i)
            else:
                out[i] = bad  # never sent: it cannot be encoded, or the master refuses it
        while todo:
            for start, end in self._get_chunks([keys[i] for i in todo]):
                part = todo[start:end]
                got = self._get_chunk([keys[i] for i in part],
                                      None if dests is None else [dests[i] for i in part])
                for i, result in zip(part, got, strict=True):
                    out[i] = result
            again = [i for i in todo if out[i] is _AGAIN]
            if len(again) == len(todo):  # not one answered: the master cannot fit any
                for i in again:
                    out[i] = ProtocolError(
                        f"store master at {self.master} answered no key of a get "
                        "(its replies are full)", "use the same kvctl version as the master")
                break
            todo = again
        return out

    def _get_chunks(self, keys: list[str]) -> list[tuple[int, int]]:
        """Cut a get into requests of at most MAX_BATCH keys and half a master frame of
        keys (the reply repeats each key with its locations)."""
        n = len(keys)
        if n <= 64 and sum(map(len, keys)) <= 64 * 1024:  # (at most 256 KiB of UTF-8)
            return [(0, n)] if n else []
        budget = self._frame_budget() * 2
        chunks: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, key in enumerate(keys):
            cost = len(self.namespace) + len(key.encode("utf-8")) + _SLOT_BYTES
            if i > start and (i - start >= p.MAX_BATCH or size + cost > budget):
                chunks.append((start, i))
                start, size = i, 0
            size += cost
        chunks.append((start, n))
        return chunks

    def _frame_budget(self) -> int:
        """A quarter of the largest master message, bytes."""
        return min(self._pool.max_frame_bytes, p.DEFAULT_MAX_FRAME_BYTES) // 4

    def _get_chunk(self, keys: list[str], dests: list[memoryview] | None
                   ) -> list[Any]:
        if not keys:
            return []
        rkeys, rversions = self._take_releases()
        wire = [self.namespace + k for k in keys]
        request = p.Get(keys=wire, lease=self.lease, release_keys=rkeys,
                        release_versions=rversions)
        guesses = self._recall.guesses(
            wire, None if dests is None else [d.nbytes for d in dests],
            mapped=self._data.inline, known=self._data.known)
        stages: list[tuple[int, int]] = []
        try:
            try:
                answer, early, attached = self._ask(request, guesses, dests, stages)
            except StoreUnavailableError:
                if self._closed:  # close() from another thread: not the master's doing
                    raise StoreError("store client was closed during the get",
                                     "close a StoreClient only once its calls returned"
                                     ) from None
                raise
            reply = self._expect(answer, p.GetReply)
            self._check_slots(reply.slots, wire)
            out, todo, slots = self._answered(keys, dests, reply, early, attached)
        finally:
            for room in stages:
                self._data.staging.give(*room)
        causes: dict[int, list[str]] = {i: [] for i in todo}
        seen: list[tuple[str, Where]] = []
        attempt = 0
        while todo:
            reqs: list[TransferRequest] = []
            placed: list[tuple[int, memoryview, tuple[int, int] | None, str | None]] = []
            nxt: list[int] = []
            try:
                with contextlib.suppress(KvctlError):  # unreachable: each read reports it
                    self._data.ensure_segments({slots[i].locations[attempt].segment for i in todo})
                for i in todo:
                    slot = slots[i]
                    loc = slot.locations[attempt]
                    if dests is None and loc.segment in self._data.inline:
                        # Same host, value wanted as bytes: one copy straight out of the
                        # node's pages.
                        data = self._data.inline_read(loc)
                        if data is not None and checksum(data) == slot.checksum:
                            out[i] = data
                            continue
                        causes[i].append(f"{loc.node_id}: checksum mismatch" if data
                                         is not None else f"{loc.node_id}: out of range")
                        if attempt + 1 < len(slot.locations):
                            nxt.append(i)
                        else:
                            out[i] = self._read_failure(keys[i], slot, causes[i], dests, i)
                        continue
                    dest, local, stage, temp = self._data.dest(
                        slot.size, dests[i] if dests else None,
                        inline=loc.segment in self._data.inline)
                    placed.append((i, dest, stage, temp))
                    reqs.append(TransferRequest(OpCode.READ, local[0], local[1], loc.segment,
                                                loc.offset, slot.size))
                failures = self._data.move(OpCode.READ, reqs, [d for _, d, _, _ in placed],
                                      [slots[i].checksum for i, _, _, _ in placed])
                for (i, dest, _, _), cause in zip(placed, failures, strict=True):
                    slot = slots[i]
                    node = slot.locations[attempt].node_id
                    if cause is None:  # landed and verified against slot.checksum
                        if dests is not None:
                            if dest is not dests[i]:  # staged: copy out
                                dests[i][:slot.size] = dest[:slot.size]
                            out[i] = slot.size
                        else:
                            out[i] = bytes(dest[:slot.size])
                        loc = slot.locations[attempt]
                        if loc.segment not in self._data.inline:
                            seen.append((slot.key, Where(slot.version, slot.checksum,
                                                          slot.size, loc.segment, loc.offset)))
                        continue
                    causes[i].append(f"{node}: {cause}" if cause else
                                     f"{node}: checksum mismatch")
                    if attempt + 1 < len(slot.locations):
                        nxt.append(i)
                    else:
                        out[i] = self._read_failure(keys[i], slot, causes[i], dests, i)
            finally:
                for _, _, stage, temp in placed:
                    self._data.release(stage, temp)
            todo = nxt
            attempt += 1
        self._recall.remember(seen)
        if self.lease:
            done = [(s.key, s.version) for s in slots.values() if not s.pending]
            with self._releases_lock:
                self._releases.extend(done)
                flush = len(self._releases) >= p.MAX_BATCH or (
                    len(self._releases) > 64
                    and sum(len(k) for k, _ in self._releases) * 4 > self._frame_budget())
            if flush:
                self._flush_releases()
        if self._shared_bad:
            self._report_shared_bad()
        return out

    def _answered(self, keys: list[str], dests: list[memoryview] | None, reply: p.GetReply,
                  early: dict[int, tuple[Where, bytes | int]],
                  attached: dict[int, memoryview]
                  ) -> tuple[list[Any], list[int], dict[int, p.GetSlot]]:
        """What the master's answer settles: per key the result where known (an error, an
        empty value, verified attached or early-read bytes), the indices still to read
        from a node, and the slot of every key that exists."""
        out: list[Any] = [None] * len(keys)
        todo: list[int] = []
        slots: dict[int, p.GetSlot] = {}
        files: list[int] = []  # read from the shared tier, all together below
        for i, slot in enumerate(reply.slots):
            if isinstance(slot, p.ErrorInfo):
                out[i] = _AGAIN if slot.code == p.REPLY_FULL else error_from(slot, key=keys[i])
            elif dests is not None and dests[i].nbytes < slot.size:
                out[i] = BadRequestError(f"buffer of {dests[i].nbytes} bytes is too small for "
                                         f"{keys[i]!r} ({slot.size} bytes)",
                                         "pass a larger buffer")
            elif slot.size == 0:
                out[i] = 0 if dests is not None else b""
            elif not slot.locations and slot.shared:  # only in the shared tier: read it here
                slots[i] = slot  # (its lease is released like any other)
                files.append(i)
            else:
                slots[i] = slot
                sent = attached.get(i)
                if sent is not None:
                    if checksum(sent) == slot.checksum:
                        # The node's bytes, sent by the master behind its answer.
                        out[i] = slot.size if dests is not None else bytes(sent)
                        continue
                    todo.append(i)  # read from the node like any other
                    continue
                got = early.get(i)
                if got is not None and (got[0].checksum, got[0].size) == (
                        slot.checksum, slot.size) and any(
                        (loc.segment, loc.offset) == (got[0].segment, got[0].offset)
                        for loc in slot.locations):
                    # Read, before the answer came, from where the master says the current
                    # version is, and verified against its checksum: the object's bytes.
                    out[i] = got[1]
                    continue
                todo.append(i)
        if files:  # on several threads when there are enough of them
            read = self._read_shared([(keys[i], slots[i], dests[i] if dests else None)
                                      for i in files])
            for i, result in zip(files, read, strict=True):
                out[i] = result
        return out, todo, slots

    def _ask(self, request: p.Get, guesses: list[tuple[int, Where]],
             dests: list[memoryview] | None, stages: list[tuple[int, int]]
             ) -> tuple[p.Reply, dict[int, tuple[Where, bytes | int]], dict[int, memoryview]]:
        """Send ``request`` to the master; the reply, what early reads found, and the bytes
        the master attached (staging room they took is added to ``stages``).

        *Early reads*: while the master answers, the guessed replicas are read, so a get of
        a key this client recently wrote or read costs one round trip instead of two. A
        guess only counts when its bytes match its checksum and the master's answer names
        the same version, size and checksum (the caller checks); anything else (a stale
        location after eviction, reuse or an overwrite) falls back to the normal read at the
        master's locations, so wrong bytes are never returned. With ``dests`` the guesses
        land in the caller's buffers (a rejected guess is overwritten by the normal read; a
        key that turns out missing leaves its buffer unspecified).

        *Attached bytes*: a master that hosts a node in its process sends the bytes of objects
        in that node's memory behind the reply (one round trip, no node read). They land
        in the caller's buffer when it fits, and are checked like any read (the caller
        verifies the checksum; a mismatch is read again from the node).
        """
        if self._closed:
            raise StoreError("store client is closed", "open a new StoreClient")
        segments = self._recall.attached
        with self._pool.connection() as conn:
            budget = min(self.attached_bytes, conn.attached_bytes)
            if budget and segments and all(s in self._data.inline for s in segments):
                budget = 0  # the master's node memory is mapped here: copying it is faster
            if budget:
                request = msgspec.structs.replace(request, attached_bytes=budget)
            conn.send(request)
            early = self._read_guesses(guesses, dests) if guesses else {}
            reply = conn.recv()
            attached: dict[int, memoryview] = {}
            if isinstance(reply, p.GetReply) and reply.attached:
                # Out of sync if this raises: the pool closes the connection.
                attached = self._recv_attached(conn, reply, dests, budget, stages)
        if self._recall.attached is not segments:
            # New memory of the master's node: map it if it is on this host (then later
            # gets copy from it instead of taking bytes attached).
            with contextlib.suppress(KvctlError):
                self._data.ensure_segments(set(self._recall.attached - segments))
        return reply, early, attached

    def _recv_attached(self, conn: MasterConnection, reply: p.GetReply,
                       dests: list[memoryview] | None, budget: int,
                       stages: list[tuple[int, int]]) -> dict[int, memoryview]:
        """Receive the bytes behind ``reply`` into the caller's buffers, else staging room
        (added to ``stages``: the caller gives it back) or new buffers."""
        out: dict[int, memoryview] = {}
        total = 0
        sources = reply.attached_from
        for n, i in enumerate(reply.attached):
            slot = reply.slots[i] if 0 <= i < len(reply.slots) else None
            if not isinstance(slot, p.GetSlot) or i in out:
                raise ProtocolError(f"store master at {conn.address} sent bytes for a slot "
                                    f"that has none ({i})", "use the same kvctl version")
            total += slot.size
            if total > budget:
                raise ProtocolError(f"store master at {conn.address} sent {total} attached "
                                    f"bytes (asked for at most {budget})",
                                    "use the same kvctl version")
            j = sources[n] if n < len(sources) else -1
            if 0 <= j < len(slot.locations):
                self._recall.learn_attached(slot.locations[j].segment)
            if dests is not None and dests[i].nbytes >= slot.size:
                out[i] = dests[i][:slot.size]
                continue
            # Bytes wanted (or a buffer too small, reported by the caller): the staging
            # buffer's pages are already mapped; a new buffer of a few MiB costs more in
            # page faults than the transfer itself.
            staging = self._data.staging
            offset = staging.take(slot.size, wait_s=0) if slot.size <= staging.capacity_bytes \
                else None
            if offset is None:
                out[i] = memoryview(bytearray(slot.size))
            else:
                stages.append((offset, slot.size))
                out[i] = staging.view[offset:offset + slot.size]
        conn.recv_data(list(out.values()))
        return out

    def _read_guesses(self, guesses: list[tuple[int, Where]],
                      dests: list[memoryview] | None = None
                      ) -> dict[int, tuple[Where, bytes | int]]:
        """Read each guess; per index whose bytes match the remembered checksum, the bytes
        (or, into ``dests``, the size: the bytes are in ``dests[i]``)."""
        found: dict[int, tuple[Where, bytes | int]] = {}
        placed: list[tuple[int, Where, memoryview, tuple[int, int] | None, str | None]] = []
        try:
            reqs: list[TransferRequest] = []
            for i, w in guesses:
                dest, local, stage, temp = self._data.dest(
                    w.size, dests[i] if dests is not None else None, inline=False)
                placed.append((i, w, dest, stage, temp))
                reqs.append(TransferRequest(OpCode.READ, local[0], local[1], w.segment,
                                            w.offset, w.size))
            if len(reqs) == 1 and self._data.direct(OpCode.READ, reqs[0], placed[0][2]):
                failures: list[str | None] = [None]  # one value: no batch
            else:
                failures = self._data.engine_move(OpCode.READ, reqs)
            for (i, w, dest, _, _), cause in zip(placed, failures, strict=True):
                if cause is None and checksum(dest[:w.size]) == w.checksum:
                    if dests is None:
                        found[i] = (w, bytes(dest[:w.size]))
                        continue
                    if dest is not dests[i]:  # staged: copy out
                        dests[i][:w.size] = dest[:w.size]
                    found[i] = (w, w.size)
        except KvctlError as exc:  # only a guess: the normal read follows
            _log.debug("early read failed: %s", exc.cause)
        finally:
            for _, _, _, stage, temp in placed:
                self._data.release(stage, temp)
        return found

    def _read_shared(self, wanted: list[tuple[str, p.GetSlot, memoryview | None]]
                     ) -> list[bytes | int | KvctlError]:
        """The shared-tier copy of each ``(key, slot, dest)`` (:meth:`SharedReader.
        read_many`); a miss is remembered, for the master to check the file and stop naming
        it if it is bad."""
        got = self.shared.read_many(wanted)
        bad = [(slot.key, slot.version) for (_, slot, _), g in zip(wanted, got, strict=True)
               if isinstance(g, KvctlError)]
        if bad:
            with self._releases_lock:
                self._shared_bad.extend(bad)
        return got

    def _report_shared_bad(self) -> None:
        """Send the bad files found (no reply; best effort: the master checks them)."""
        with self._releases_lock:
            budget, n = self._frame_budget(), 0
            for n, (key, _) in enumerate(self._shared_bad[:p.MAX_BATCH], 1):
                budget -= len(key) * 4 + 16
                if budget < 0:
                    n -= 1
                    break
            n = max(1, n)
            bad, self._shared_bad = self._shared_bad[:n], self._shared_bad[n:]
        if not bad:
            return
        with contextlib.suppress(KvctlError), self._pool.connection() as conn:
            if conn.shared_reports:  # an older master would answer it: out of step
                conn.send(p.SharedBad(keys=[k for k, _ in bad], versions=[v for _, v in bad]))

    def _flush_releases(self) -> None:
        for _ in range(p.MAX_BATCH):  # bounded: each round takes at least one
            keys, versions = self._take_releases()
            if not keys:
                return
            with self._pool.connection() as conn:
                conn.send(p.Release(keys=keys, versions=versions))

    def _read_failure(self, key: str, slot: p.GetSlot, causes: list[str],
                      dests: list[memoryview] | None, i: int) -> Any:
        """Every DRAM replica failed: the shared-tier copy if there is one, else the
        error."""
        if slot.shared and not slot.pending:
            got = self._read_shared([(key, slot, dests[i] if dests else None)])[0]
            if not isinstance(got, KvctlError):
                return got
            causes.append(f"shared tier: {got.cause}")
        if slot.pending:
            return ObjectNotFoundError(key, why="its put has not completed")
        if all(c.endswith("checksum mismatch") for c in causes):
            return ChecksumMismatchError(
                f"every replica of {key!r} failed its checksum ({'; '.join(causes)})",
                "the object may have been overwritten meanwhile; retry the get")
        return StoreUnavailableError(f"no replica of {key!r} could be read: "
                                     f"{'; '.join(causes)}",
                                     "check the storage nodes (kvctl store status)")

    # ------------------------------------------------------------------ metadata
    def _wire(self, keys: Sequence[str]) -> list[str]:
        return [self.namespace + k for k in keys]

    def _local(self, info: p.ObjectInfo) -> p.ObjectInfo:
        """``info`` with the key as the caller named it (namespace stripped)."""
        if not self.namespace:
            return info
        return msgspec.structs.replace(info, key=info.key.removeprefix(self.namespace))


    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (split into requests that fit the master's limits)."""
        out: list[bool] = []
        for chunk in _key_chunks(self._wire(keys), self._frame_budget() * 2):
            out.extend(self._expect(self._call(p.Exists(keys=chunk)), p.Bools).values)
        return out

    def remove(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it existed."""
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove many keys; ``True`` where one existed."""
        wire = self._wire(keys)
        self._recall.forget(wire)
        # End our own finished reads' leases first, so removed objects free their space now
        # rather than when the lease runs out (the release is ordered before the remove).
        with self._releases_lock:
            mine = bool(self._releases)
        if mine:
            self._flush_releases()
        out: list[bool] = []
        for chunk in _key_chunks(wire, self._frame_budget() * 2):
            out.extend(self._expect(self._call(p.Remove(keys=chunk)), p.Bools).values)
        return out

    def list(self, prefix: str = "", *, limit: int = 10000) -> tuple[list[p.ObjectInfo], bool]:
        """Objects whose keys start with ``prefix`` (sorted) and whether the list was cut."""
        reply = self._expect(self._call(p.ListKeys(prefix=self.namespace + prefix,
                                                   limit=limit)), p.KeyList)
        return [self._local(o) for o in reply.objects], reply.truncated


    def stat(self, key: str) -> p.ObjectInfo:
        """Metadata of ``key``.

        Raises:
            ObjectNotFoundError: the key is not stored.
        """
        reply = self._expect(self._call(p.Stat(key=self.namespace + key)), p.StatReply, key)
        return self._local(reply.info)

    def pin(self, key: str, pinned: bool = True) -> None:
        """Pin ``key`` so it is never evicted (or unpin it)."""
        self._expect(self._call(p.Pin(key=self.namespace + key, pinned=pinned)), p.Ok, key)

    def drop_node(self, node_id: str) -> None:
        """Drop storage node ``node_id`` now, with its objects' copies on it (the shared
        token only; what a node silent past its grace gets): objects with no copy left are
        lost. A node still running registers again with new memory.

        Raises:
            NotFoundError: no node of that name is registered.
            StoreForbiddenError: a tenant's token.
        """
        reply = self._call(p.DropNode(node_id=node_id))
        if isinstance(reply, p.Fail) and reply.error.code == "not_found":
            raise NotFoundError(reply.error.cause,
                                reply.error.hint or "see kvctl store status for the nodes")
        self._expect(reply, p.Ok)

    def status(self) -> p.StoreStatus:
        """Nodes, capacity, usage, evictions and tiers."""
        return self._expect(self._call(p.Status()), p.StatusReply).status  # type: ignore[no-any-return]


#: Key bytes per request of a key-only batch: half a frame, leaving room for encoding.
KEY_CHUNK_BYTES = p.DEFAULT_MAX_FRAME_BYTES // 2
#: What a get slot takes in a reply besides its key, bytes (one replica's location and a
#: shared-tier path; more is fitted by the master, which leaves out what does not fit).
_SLOT_BYTES = 256
#: A result still to come: the master left the key out of a full reply (asked again).
_AGAIN: Any = object()


def _odd_key(key: str) -> BadRequestError | None:
    """The error the master would answer for ``key`` (empty, too long, unprintable), or
    one it could not even be sent with (a lone surrogate: not UTF-8); ``None`` for a
    valid key. Cheap for the usual short printable key."""
    if 0 < len(key) <= p.MAX_KEY_BYTES // 4 and key.isprintable():
        return None
    bad = p.check_key(key)
    return None if bad is None else BadRequestError(bad.cause, bad.hint or None)


def _key_chunks(keys: list[str], budget: int = KEY_CHUNK_BYTES) -> list[list[str]]:
    """``keys`` cut into requests of at most MAX_BATCH keys and ``budget`` bytes of keys."""
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key in keys:
        length = len(key.encode("utf-8", "surrogatepass"))
        if current and (len(current) >= p.MAX_BATCH or size + length > budget):
            chunks.append(current)
            current, size = [], 0
        current.append(key)
        size += length
    if current or not chunks:
        chunks.append(current)
    return chunks
