"""``pyverbs.mr``: memory regions over host memory (``MR``) and dma-bufs (``DmaBufMR``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from typing import Any

from tests.fakes.pyverbs import enums as e
from tests.fakes.pyverbs._hca import STATE, mmap_dmabuf, rdma_error

_PAGE = mmap.PAGESIZE


def _pages(addr: int, length: int) -> int:
    start = addr - addr % _PAGE
    end = -(-(addr + length) // _PAGE) * _PAGE
    return end - start


class MR:
    """``ibv_reg_mr``: pins ``length`` bytes at ``address`` (or a buffer it allocates)."""

    def __init__(self, creator: Any, length: int = 0, access: int = 0,
                 address: int | None = None, implicit: bool = False, **kwargs: Any) -> None:
        self._init_common(creator, length, access)
        if (access & (e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC)
                and not access & e.IBV_ACCESS_LOCAL_WRITE) or length <= 0:
            raise self._failed(errno.EINVAL)
        self._own: Any = None
        if not address:
            self._own = ctypes.create_string_buffer(length)
            address = ctypes.addressof(self._own)
        host = STATE.host()
        with STATE.lock:
            for start, end in STATE.gpu_ranges:
                if start <= address < end and not host.peermem:
                    raise self._failed(errno.EFAULT)  # device memory without nvidia_peermem
            pinned = _pages(address, length)
            if host.memlock_bytes is not None and STATE.pinned_bytes + pinned > host.memlock_bytes:
                raise self._failed(errno.ENOMEM)
            STATE.pinned_bytes += pinned
        self._pinned = pinned
        self.buf = address
        self.iova = address
        self.host_base = address
        self._register(creator)

    def _init_common(self, pd: Any, length: int, access: int) -> None:
        self.pd = pd
        self.length = length
        self.access = access
        self.closed = False
        self.access_lock = threading.Lock()
        self._pinned = 0
        self.lkey = self.rkey = 0

    def _failed(self, code: int) -> Exception:
        return rdma_error(f"Failed to register a MR. length: {self.length}, access flags: "
                          f"{self.access}", code)

    def _register(self, pd: Any) -> None:
        if getattr(pd, "_closed", True):
            raise self._failed(errno.EINVAL)
        key = STATE.new_key()
        self.lkey = self.rkey = key
        pd.add_mr(self)

    def translate(self, addr: int, length: int) -> int | None:
        """The host address of ``[addr, addr+length)`` in this MR's I/O space, if inside."""
        if self.closed or length < 0:
            return None
        rel = addr - self.iova
        if rel < 0 or rel > self.length - length:
            return None
        return self.host_base + rel

    @property
    def handle(self) -> int:
        return self.lkey

    def close(self) -> None:
        with self.access_lock:
            if self.closed:
                return
            self.closed = True
        self.pd.drop_mr(self)
        with STATE.lock:
            STATE.pinned_bytes -= self._pinned
            STATE.keys.discard(self.lkey)
        self._own = None


class DmaBufMR(MR):
    """``ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd, access)``, as pyverbs v44
    calls it: the MR's I/O addresses start at ``offset`` and ``buf`` is 0."""

    def __init__(self, pd: Any, length: int, access: int, dmabuf: Any = None, offset: int = 0,
                 gpu: int = 0, gtt: int = 0) -> None:
        self._init_common(pd, length, access)
        self._mapping: mmap.mmap | None = None
        if dmabuf is None:
            raise rdma_error("Failed to allocate a DRM dma-buf", errno.ENODEV)
        fd = dmabuf if isinstance(dmabuf, int) else dmabuf.fd
        try:
            os.fstat(fd)
        except OSError:
            raise rdma_error(f"Failed to register a dma-buf MR. length: {length}, access "
                             f"flags: {access}", errno.EBADF) from None
        if length <= 0:
            raise self._failed(errno.EINVAL)
        try:
            self._mapping, base = mmap_dmabuf(fd, offset, length)
        except (OSError, ValueError):
            raise rdma_error(f"Failed to register a dma-buf MR. length: {length}, access "
                             f"flags: {access}", errno.EINVAL) from None
        self.buf = 0
        self.iova = offset
        self.offset = offset
        self.host_base = base
        self._register(pd)

    def close(self) -> None:
        super().close()
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still exported: freed with it
                mapping.close()
