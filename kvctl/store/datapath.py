"""The store client's data path: how object bytes move between a caller's memory and the
storage nodes' segments.

- Same host: a node's segment is shared memory. It is mapped here (pre-faulted) and copied
  in the calling thread; copies of 64 KiB and more use ``ctypes.memmove`` (the GIL is
  released), and a batch of 8 MiB or more is copied by two threads at once. Each value is
  verified against its checksum right after its copy, while it is still in cache.
- Other hosts, or ``transport="tcp"``: one value moves with
  :meth:`TransferEngine.move_direct <kvctl.transfer.engine.TransferEngine.move_direct>`
  (no batch; writes straight from the caller's buffer), and anything else as one engine
  batch through :meth:`TransferEngine.run`, which falls back on other paths.
- Values in plain ``bytes`` pass through a registered staging buffer; buffers the caller
  registered (:meth:`DataPath.register_buffer`) move with no copy.

:class:`~kvctl.store.client.StoreClient` decides *what* to move (its put and get flows,
replicas, checksums, early reads); this module only moves bytes and knows the segments.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.errors import BadRequestError
from kvctl.store.localcopy import (
    MISMATCH,
    PARALLEL_COPY_BYTES,
    Copy,
    Staging,
    address_of,
    copy_views,
)
from kvctl.store.shmmap import SharedMapping
from kvctl.transfer.admin import segment_key
from kvctl.transfer.batch import BatchResult, OpCode, TransferRequest
from kvctl.transfer.engine import TransferEngine
from kvctl.transfer.errors import TransferTimeoutError
from kvctl.transfer.segments import SegmentInfo, find_buffer

_log = logging.getLogger("kvctl.store.datapath")

#: Largest single write / read made without a batch (TransferEngine.move_direct). Larger
#: reads go faster as a batch: it slices them over several connections at once.
DIRECT_WRITE_BYTES = 4 << 20
DIRECT_READ_BYTES = 1 << 20


class _Registered:
    __slots__ = ("address", "name", "nbytes", "obj")

    def __init__(self, name: str, address: int, nbytes: int, obj: Any) -> None:
        self.name, self.address, self.nbytes, self.obj = name, address, nbytes, obj


class DataPath:
    """The transfer engine, staging buffer, registered buffers and same-host mappings of
    one store client (thread-safe).

    Args:
        name: engine name.
        transport: ``auto``, ``shm`` or ``tcp`` (see :class:`StoreClient`).
        token: shared secret of the nodes' data path.
        timeout_s: per-move timeout, seconds.
        staging_bytes: size of the registered staging buffer.
        nodes: the live storage nodes (asked when a segment is not known yet).
        spin_s: how long a wait for a node's reply polls before it sleeps.
    """

    def __init__(self, name: str, *, transport: str, token: str | None, timeout_s: float,
                 staging_bytes: int, nodes: Callable[[], list[p.NodeAddress]],
                 spin_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self._token = token
        self._nodes = nodes
        self.engine = TransferEngine(name, metadata=f"memory://kvctl-{name}",
                                     transport=transport, token=token, timeout_s=timeout_s,
                                     spin_s=spin_s)
        #: node segments whose descriptors the engine knows
        self.known: set[str] = set()
        self._lock = threading.Lock()
        #: same-host segments mapped for copies in the caller's thread (see move).
        self.inline: dict[str, tuple[list[int], list[int], list[SharedMapping]]] = {}
        self._inline_ok = transport in ("auto", "shm")
        #: helper thread for large same-host copies (see _copy_inline), started on demand
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._copier_lock = threading.Lock()
        self._registered: list[_Registered] = []
        try:
            self.staging = Staging(self.engine, f"{name}.staging", staging_bytes)
        except BaseException:
            self.engine.close()
            raise

    def close(self) -> None:
        """Stop the copy helper, unmap the node segments, close the engine and staging."""
        with self._copier_lock:
            copier, self._copier = self._copier, None
        if copier is not None:
            copier.shutdown(wait=True)
        for _, _, bufs in self.inline.values():
            for buf in bufs:
                buf.close()
        self.inline.clear()
        self.engine.close()
        self.staging.close()

    def release(self, stage: tuple[int, int] | None, temp: str | None) -> None:
        """Give back what :meth:`dest` or :meth:`source` took (staging room, a temporary
        segment)."""
        if stage is not None:
            self.staging.give(*stage)
        if temp is not None:
            self.engine.unregister_segment(temp)

    def register_buffer(self, buffer: Any) -> None:
        """Register a writable buffer (bytearray, mmap, numpy array) for zero-copy
        :meth:`get_into`/:meth:`batch_get_into`/:meth:`put_from` on views of it."""
        view = memoryview(buffer).cast("B")
        address = address_of(view)
        if address is None:
            raise BadRequestError("only writable, non-empty buffers can be registered",
                                  "pass a bytearray, mmap or numpy array")
        name = f"{self.engine.name}.user{len(self._registered)}"
        self.engine.register_memory(name, [buffer])
        self._registered.append(_Registered(name, address, view.nbytes, buffer))

    def find_registered(self, view: memoryview) -> tuple[str, int] | None:
        address = address_of(view)
        if address is None:
            return None
        for reg in self._registered:
            if reg.address <= address and address + view.nbytes <= reg.address + reg.nbytes:
                return reg.name, address - reg.address
        return None

    def ensure_segments(self, names: set[str]) -> None:
        with self._lock:
            missing = names - self.known
        if not missing:
            return
        nodes = self._nodes()
        metadata = self.engine.metadata
        live = {node.segment for node in nodes}
        with self._lock:
            for node in nodes:
                if node.segment not in self.known and node.descriptor:
                    key = segment_key(self.engine.cluster_id, node.segment)
                    metadata.put(key, self._vouched(key, node.descriptor))
                    self.known.add(node.segment)
                    self._map_inline(node.segment)
            for gone in [s for s in self.inline if s not in live]:
                for buf in self.inline.pop(gone)[2]:
                    buf.close()

    def _vouched(self, key: str, descriptor: bytes) -> bytes:
        """A node descriptor the master handed over an authenticated connection, signed
        for this client's private metadata with the client's own token (a tenant's differs
        from the nodes'), so the engine's signature check holds."""
        if self._token is None:
            return descriptor
        return SegmentInfo.from_json(descriptor, source=key).to_json(token=self._token, key=key)

    def _map_inline(self, segment: str) -> None:
        """Map a same-host node segment so small copies skip the engine's worker thread."""
        if not self._inline_ok:
            return
        try:
            handle = self.engine.open_segment(segment)
            if handle.transport != "shm" or handle.kind != "shm":
                return
            bufs = [SharedMapping(b, segment=segment, populate="read")
                    for b in handle.buffers]
        except KvctlError as exc:
            _log.info("segment %s: no inline mapping (%s); using the engine", segment,
                      exc.cause)
            return
        self.inline[segment] = ([b.offset for b in bufs], [b.length for b in bufs], bufs)

    def move(self, op: OpCode, reqs: list[TransferRequest], views: list[memoryview],
              sums: list[int] | None = None, *, direct: bool = True) -> list[str | None]:
        """Run ``reqs`` (local side ``views``); per request ``None`` (done) or the cause.

        Same-host shm segments are copied in this thread through the engine's shared
        mapping (two thread hand-offs less than a batch on the engine's shm worker); the
        rest goes through the engine as one batch, or, when it is a single request (and
        ``direct``), without a batch (:meth:`direct`, the batch its fallback). With ``sums``
        (READs), each request's
        bytes are verified as soon as they land (while still in cache), and a mismatch is
        the cause ``checksum mismatch``.
        """
        if not reqs:
            return []
        try:
            self.ensure_segments({r.target_segment for r in reqs})
        except KvctlError as exc:
            return [exc.cause] * len(reqs)
        out: list[str | None] = [None] * len(reqs)
        rest: list[int] = []
        read = op is OpCode.READ
        copies: list[Copy] = []
        for i, req in enumerate(reqs):
            mapped = self.inline.get(req.target_segment)
            if mapped is None:
                rest.append(i)
                continue
            try:
                bi, rel = find_buffer(mapped[0], mapped[1], req.target_offset, req.length,
                                      segment=req.target_segment)
            except KvctlError as exc:
                out[i] = exc.cause
                continue
            remote = mapped[2][bi].view[rel:rel + req.length]
            local = views[i][:req.length]
            copies.append((i, remote, local) if read else (i, local, remote))
        if copies:
            self._copy_inline(copies, sums if read else None, out)
        if direct and len(rest) == 1 and self.direct(op, reqs[rest[0]], views[rest[0]]):
            i = rest.pop()
            if sums is not None and read and checksum(views[i][:reqs[i].length]) != sums[i]:
                out[i] = MISMATCH
        if rest:
            done = self.engine_move(op, [reqs[i] for i in rest])
            for i, cause in zip(rest, done, strict=True):
                if cause is None and sums is not None and read and checksum(
                        views[i][:reqs[i].length]) != sums[i]:
                    cause = MISMATCH
                out[i] = cause
        return out

    def _copy_inline(self, copies: list[Copy], sums: list[int] | None,
                     out: list[str | None]) -> None:
        """Copy ``(index, source, destination)`` views, verifying destinations against
        ``sums`` when given. Large copies use ``ctypes.memmove``, which releases the GIL, so
        past :data:`PARALLEL_COPY_BYTES` half the copies run on a helper thread at once
        (one thread copies while the other checksums)."""
        total = sum(src.nbytes for _, src, _ in copies)
        if total < PARALLEL_COPY_BYTES or len(copies) < 2:
            copy_views(copies, sums, out)
            return
        half, acc = 0, 0
        while half < len(copies) - 1 and acc < total // 2:
            acc += copies[half][1].nbytes
            half += 1
        with self._copier_lock:
            if self._copier is None:
                self._copier = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="kvctl-store-copy")
            copier = self._copier
        try:
            other = copier.submit(copy_views, copies[half:], sums, out)
        except RuntimeError:  # shut down by a concurrent close: copy here
            copy_views(copies, sums, out)
            return
        copy_views(copies[:half], sums, out)
        other.result()

    def direct(self, op: OpCode, req: TransferRequest, view: memoryview) -> bool:
        """Move one request in this thread without a batch (the engine's tcp fast path);
        ``False`` when it cannot or failed (the caller then runs it as a batch, which
        retries on other paths)."""
        if req.length > (DIRECT_READ_BYTES if op is OpCode.READ else DIRECT_WRITE_BYTES):
            return False
        try:
            self.engine.move_direct(op, req.target_segment, req.target_offset,
                                    view[:req.length])
        except KvctlError as exc:
            _log.debug("direct %s of %s failed (%s); through a batch", op.value,
                       req.target_segment, exc.cause)
            return False
        return True

    def engine_move(self, op: OpCode, reqs: list[TransferRequest]) -> list[str | None]:
        engine = self.engine
        result: BatchResult | None = None
        try:
            batch = engine.allocate_batch(len(reqs))
            # run = submit + wait; small tcp batches move in this thread (no worker hand-off)
            result = engine.run(batch, reqs, timeout_s=self.timeout_s)
        except TransferTimeoutError:
            pass  # submitted, not settled in time: handled below
        except KvctlError as exc:
            if len(reqs) > 1:  # one unreachable target must not fail the others
                out: list[str | None] = []
                for r in reqs:
                    out.extend(self.engine_move(op, [r]))
                return out
            return [exc.cause]
        try:
            if result is None:
                # A stalled peer. The engine times a path with no progress out by itself
                # (after timeout_s) and closes it, so no late byte lands in our buffers;
                # wait for that once more rather than abandon requests still in flight, and
                # never redo them one by one (that would multiply the timeout).
                result = engine.wait(batch, self.timeout_s + 1.0)
            statuses = None if result.ok else engine.status(batch)
            engine.free_batch(batch)
        except KvctlError as exc:
            return [exc.cause] * len(reqs)
        if statuses is None:
            return [None] * len(reqs)
        return [None if s.state.value == "completed" else (s.cause or s.state.value)
                for s in statuses]

    def source(self, view: memoryview, staged: list[tuple[int, int]], temps: list[str]
                ) -> tuple[str, int]:
        reg = self.find_registered(view)
        if reg is not None:
            return reg
        size = view.nbytes
        if size <= self.staging.capacity_bytes:
            offset = self.staging.take(size, wait_s=self.timeout_s)
            if offset is not None:
                staged.append((offset, size))
                self.staging.view[offset:offset + size] = view
                return self.staging.name, offset
        name = f"{self.engine.name}.tmp{secrets.token_hex(4)}"
        self.engine.register_memory(name, [bytearray(view)])
        temps.append(name)
        return name, 0

    def dest(self, size: int, user: memoryview | None, *, inline: bool
              ) -> tuple[memoryview, tuple[str, int], tuple[int, int] | None, str | None]:
        if user is not None:
            if inline:
                return user, ("", 0), None, None
            reg = self.find_registered(user)
            if reg is not None:
                return user, reg, None, None
        elif inline:
            return memoryview(bytearray(size)), ("", 0), None, None
        if size <= self.staging.capacity_bytes:
            offset = self.staging.take(size, wait_s=self.timeout_s)
            if offset is not None:
                return (self.staging.view[offset:offset + size],
                        (self.staging.name, offset), (offset, size), None)
        buf = bytearray(size)
        name = f"{self.engine.name}.tmp{secrets.token_hex(4)}"
        self.engine.register_memory(name, [buf])
        return memoryview(buf), (name, 0), None, name

    def inline_read(self, loc: p.Location) -> bytes | None:
        mapped = self.inline[loc.segment]
        try:
            bi, rel = find_buffer(mapped[0], mapped[1], loc.offset, loc.size,
                                  segment=loc.segment)
        except KvctlError:
            return None
        return bytes(mapped[2][bi].view[rel:rel + loc.size])

