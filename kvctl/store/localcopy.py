"""The store client's local memory: its registered staging buffer and same-host copies.

Bytes objects a caller hands to ``put``/``get`` travel through :class:`Staging`, a
registered buffer carved into per-request ranges; same-host transfers are plain copies
between mapped memory, done by :func:`copy_views` (``ctypes.memmove`` for large copies, which
releases the GIL), each verified against its checksum right after it lands.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading

from kvctl.store.allocator import ExtentAllocator
from kvctl.store.checksum import checksum
from kvctl.transfer.engine import TransferEngine

#: Default size of the client's staging buffer (bytes objects are copied through it).
DEFAULT_STAGING_BYTES = 64 << 20


class Staging:
    """A registered buffer carved into per-request ranges."""

    def __init__(self, engine: TransferEngine, name: str, size_bytes: int) -> None:
        self.name = name
        self._mem = mmap.mmap(-1, size_bytes)
        self.view = memoryview(self._mem)
        engine.register_memory(name, [self._mem])
        self._alloc = ExtentAllocator(size_bytes, alignment_bytes=4096)
        self._cond = threading.Condition()

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    def take(self, size: int, *, wait_s: float) -> int | None:
        """An offset for ``size`` bytes, waiting up to ``wait_s`` for others to free space;
        ``None`` when it does not fit."""
        with self._cond:
            offset = self._alloc.allocate(size)
            if offset is None and wait_s > 0:
                self._cond.wait_for(lambda: self._alloc.largest_free_bytes >= self._alloc
                                    .rounded(size), timeout=wait_s)
                offset = self._alloc.allocate(size)
            return offset

    def give(self, offset: int, size: int) -> None:
        with self._cond:
            self._alloc.free(offset, size)
            self._cond.notify_all()

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self._mem.close()


#: Copies of this many bytes or more use ctypes.memmove (releases the GIL).
MEMMOVE_BYTES = 64 << 10
#: A same-host batch of this many bytes or more is copied by two threads at once.
PARALLEL_COPY_BYTES = 8 << 20
MISMATCH = "checksum mismatch"

#: (request index, source view, destination view) of one same-host copy
Copy = tuple[int, memoryview, memoryview]


def copy_views(copies: list[Copy], sums: list[int] | None, out: list[str | None]) -> None:
    """Copy each source view into its destination (same length); with ``sums``, verify
    each destination right after its copy and record a mismatch in ``out``."""
    for i, src, dst in copies:
        try:
            n = src.nbytes
            dst_at = address_of(dst) if n >= MEMMOVE_BYTES else None
            src_at = address_of(src) if dst_at is not None else None
            if dst_at is not None and src_at is not None:
                ctypes.memmove(dst_at, src_at, n)
            else:
                dst[:] = src
        except (ValueError, TypeError, BufferError) as exc:
            out[i] = str(exc)
            continue
        if sums is not None and checksum(dst) != sums[i]:
            out[i] = MISMATCH


def address_of(view: memoryview) -> int | None:
    """The address of a writable, non-empty view's first byte, else ``None``."""
    if view.readonly or view.nbytes == 0:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
