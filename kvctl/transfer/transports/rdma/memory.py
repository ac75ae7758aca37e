"""Memory the NICs can reach: memory regions per buffer and port, GPU memory, staging.

- Host buffers (shm, caller memory) get a plain MR on each port chosen for their location.
- GPU buffers get, in order of preference (``gpu_memory``): a dma-buf MR (the CUDA driver
  exports the range with ``cuMemGetHandleForAddressRange`` and ``ibv_reg_dmabuf_mr``
  registers it, as rdma-core's ``tests/test_cuda_dmabuf.py`` does); a plain MR on the
  device pointer (works with ``nvidia_peermem`` loaded); else no MR: *staged*, each slice
  copied through registered host memory. A staged buffer can be an initiator's, never a
  published target's (the target's CPU takes no part in one-sided RDMA).
- Files and anything else without an address are staged too.

Every MR is deregistered when its segment is unregistered (pinned pages do not leak, and a
new buffer can never match a stale lkey: lookups hold the buffer itself, not its ``id``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvctl.errors import UnavailableError
from kvctl.transfer.errors import TransportUnavailableError
from kvctl.transfer.segments import GpuBuffer, LocalBuffer, LocalSegment, MemoryBuffer
from kvctl.transfer.transports.rdma.devices import NicContext, registration_error

_log = logging.getLogger("kvctl.transfer.rdma")

MODES = ("host", "dmabuf", "peermem", "staged")
_PAGE = mmap.PAGESIZE
#: ``CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD``.
_DMA_BUF_FD = 1


class CudaGateway(Protocol):
    """What GPU registration needs from the CUDA driver."""

    def dmabuf(self, pointer: int, length: int) -> tuple[int, int]:
        """A dma-buf fd covering ``[pointer, pointer+length)`` and the offset of
        ``pointer`` in it (the caller closes the fd).

        Raises:
            UnavailableError: the driver cannot export it.
        """
        ...


class CudaDriver:
    """:class:`CudaGateway` on ``libcuda.so.1`` through ctypes (no CUDA Python package
    needed). ``cuMemGetHandleForAddressRange`` needs CUDA 11.7+, a driver with dma-buf
    support and a kernel with ``CONFIG_DMABUF_MOVE_NOTIFY``/P2P (5.12+)."""

    def __init__(self) -> None:
        self._lib: Any = None

    def _load(self) -> Any:
        if self._lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise UnavailableError(f"libcuda.so.1 not loadable ({exc})",
                                       "install the NVIDIA driver") from None
            rc = lib.cuInit(0)
            if rc != 0:
                raise UnavailableError(f"cuInit failed (CUresult {rc})",
                                       "check the driver with nvidia-smi")
            if not hasattr(lib, "cuMemGetHandleForAddressRange"):
                raise UnavailableError("the CUDA driver has no cuMemGetHandleForAddressRange",
                                       "use a driver of CUDA 11.7 or later")
            self._lib = lib
        return self._lib

    def dmabuf(self, pointer: int, length: int) -> tuple[int, int]:
        lib = self._load()
        start = pointer - pointer % _PAGE
        end = -(-(pointer + length) // _PAGE) * _PAGE
        fd = ctypes.c_int(-1)
        rc = lib.cuMemGetHandleForAddressRange(
            ctypes.byref(fd), ctypes.c_uint64(start), ctypes.c_size_t(end - start),
            ctypes.c_int(_DMA_BUF_FD), ctypes.c_ulonglong(0))
        if rc != 0 or fd.value < 0:
            raise UnavailableError(f"cuMemGetHandleForAddressRange failed (CUresult {rc})",
                                   "dma-buf needs a recent driver and kernel 5.12+")
        return fd.value, pointer - start


def peermem_loaded(sys_module: Path = Path("/sys/module")) -> bool:
    """Whether ``nvidia_peermem`` (or the older ``nv_peer_mem``) is loaded."""
    return (sys_module / "nvidia_peermem").exists() or (sys_module / "nv_peer_mem").exists()


@dataclasses.dataclass(frozen=True)
class LocalMr:
    """One buffer's memory region on one port.

    Attributes:
        lkey / rkey: its keys.
        base: I/O address of the buffer's first byte (the virtual address for host and
            peermem MRs, the offset in the dma-buf for dma-buf MRs).
        mode: ``host``, ``dmabuf`` or ``peermem``.
    """

    mr: Any
    lkey: int
    rkey: int
    base: int
    mode: str
    fd: int | None = None


class _Entry:
    __slots__ = ("buf", "mode", "mrs")

    def __init__(self, buf: LocalBuffer, mode: str) -> None:
        self.buf = buf
        self.mode = mode
        self.mrs: dict[str, LocalMr] = {}


class MemoryRegistry:
    """Memory regions of registered segments, per port.

    Args:
        nics: the open ports by name.
        access: MR access flags (local write, remote read and write).
        gpu_memory: ``auto``, ``dmabuf``, ``peermem`` or ``staged``.
        cuda: the CUDA driver gateway (``None``: :class:`CudaDriver` on first GPU buffer).
        peermem: whether plain MRs reach GPU memory (``None``: ask ``/sys/module``).
    """

    def __init__(self, nics: dict[str, NicContext], access: int, error: type[Exception], *,
                 gpu_memory: str = "auto", cuda: CudaGateway | None = None,
                 peermem: bool | None = None) -> None:
        self._nics = nics
        self._error = error
        self._access = access
        self._gpu_memory = gpu_memory
        self._cuda = cuda
        self._peermem = peermem
        self._entries: dict[int, _Entry] = {}
        self._segments: dict[str, list[int]] = {}

    def lookup(self, buf: LocalBuffer, nic: str) -> LocalMr | None:
        """``buf``'s MR on port ``nic``, or ``None`` (staged)."""
        entry = self._entries.get(id(buf))
        if entry is None or entry.buf is not buf:
            return None
        return entry.mrs.get(nic)

    def mode_of(self, buf: LocalBuffer) -> str:
        """How ``buf`` is reached: ``host``, ``dmabuf``, ``peermem`` or ``staged``."""
        entry = self._entries.get(id(buf))
        return entry.mode if entry is not None and entry.buf is buf else "staged"

    def nics_of(self, buf: LocalBuffer) -> list[str]:
        """The ports ``buf`` is registered on (empty: staged)."""
        entry = self._entries.get(id(buf))
        return list(entry.mrs) if entry is not None and entry.buf is buf else []

    def register(self, seg: LocalSegment, nics_for: Any) -> list[_Entry]:
        """Register every buffer of ``seg`` on the ports ``nics_for(buffer)`` names.

        Raises:
            TransportUnavailableError: a registration failed (everything registered for
                ``seg`` so far is released first); the cause names the limit to raise.
        """
        done: list[_Entry] = []
        try:
            for buf in seg.buffers:
                entry = self._register_buffer(buf, nics_for(buf))
                done.append(entry)
        except BaseException:
            for entry in done:
                self._release(entry)
            raise
        for entry in done:
            self._entries[id(entry.buf)] = entry
        self._segments[seg.name] = [id(entry.buf) for entry in done]
        return done

    def _register_buffer(self, buf: LocalBuffer, nics: Sequence[str]) -> _Entry:
        if isinstance(buf, MemoryBuffer):
            entry = _Entry(buf, "host")
            try:
                for name in nics:
                    mr = self._nics[name].register(buf.address, buf.length, self._access)
                    entry.mrs[name] = LocalMr(mr, int(mr.lkey), int(mr.rkey), buf.address, "host")
            except self._error as exc:
                self._release(entry)
                raise registration_error(f"buffer at offset {buf.offset}", buf.length,
                                         exc) from None
            return entry
        if isinstance(buf, GpuBuffer):
            return self._register_gpu(buf, nics)
        return _Entry(buf, "staged")

    def _register_gpu(self, buf: GpuBuffer, nics: Sequence[str]) -> _Entry:
        wanted = self._gpu_memory
        order = {"auto": ("dmabuf", "peermem"), "dmabuf": ("dmabuf",),
                 "peermem": ("peermem",), "staged": ()}[wanted]
        reasons: list[str] = []
        for mode in order:
            entry = _Entry(buf, mode)
            try:
                for name in nics:
                    entry.mrs[name] = (self._dmabuf_mr(buf, name) if mode == "dmabuf"
                                       else self._peermem_mr(buf, name))
            except (UnavailableError, self._error) as exc:
                self._release(entry)
                reasons.append(f"{mode}: {getattr(exc, 'cause', None) or str(exc).strip()}")
                continue
            _log.info("GPU buffer %s at offset %d registered for RDMA via %s",
                      buf.location, buf.offset, mode)
            return entry
        if reasons:
            _log.info("GPU buffer %s at offset %d is staged through host memory (%s)",
                      buf.location, buf.offset, "; ".join(reasons))
        if wanted in ("dmabuf", "peermem"):
            raise TransportUnavailableError(
                f"GPU memory cannot be registered by {wanted}: {'; '.join(reasons)}",
                "use gpu_memory='auto' to fall back, or fix the named cause")
        return _Entry(buf, "staged")

    def _dmabuf_mr(self, buf: GpuBuffer, nic: str) -> LocalMr:
        if self._cuda is None:
            self._cuda = CudaDriver()
        fd, offset = self._cuda.dmabuf(buf.device_pointer, buf.length)
        try:
            mr = self._nics[nic].register_dmabuf(fd, offset, buf.length, self._access)
        except BaseException:
            os.close(fd)
            raise
        return LocalMr(mr, int(mr.lkey), int(mr.rkey), offset, "dmabuf", fd)

    def _peermem_mr(self, buf: GpuBuffer, nic: str) -> LocalMr:
        if self._peermem is None:
            self._peermem = peermem_loaded()
        if not self._peermem:
            raise UnavailableError("nvidia_peermem is not loaded", "modprobe nvidia_peermem")
        pointer = buf.device_pointer
        mr = self._nics[nic].register(pointer, buf.length, self._access)
        return LocalMr(mr, int(mr.lkey), int(mr.rkey), pointer, "peermem")

    def _release(self, entry: _Entry) -> None:
        for local in entry.mrs.values():
            try:
                local.mr.close()
            except self._error as exc:
                _log.warning("deregistering an MR: %s", exc)
            if local.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(local.fd)
        entry.mrs.clear()

    def unregister(self, seg: LocalSegment) -> None:
        """Deregister every MR of ``seg`` (no-op when it had none)."""
        for key in self._segments.pop(seg.name, []):
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._release(entry)

    def close(self) -> None:
        """Deregister everything. Safe to call twice."""
        for entry in list(self._entries.values()):
            self._release(entry)
        self._entries.clear()
        self._segments.clear()


class Bounce:
    """Registered host memory on one port, cut into slice-sized chunks, for staged slices.

    Used by that port's poster thread only (no locking).
    """

    def __init__(self, nic: NicContext, total_bytes: int, chunk_bytes: int, access: int
                 ) -> None:
        self.chunk_bytes = chunk_bytes
        count = max(1, total_bytes // chunk_bytes)
        self._mm = mmap.mmap(-1, count * chunk_bytes)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self._base = ctypes.addressof(anchor)
        del anchor
        self._view = memoryview(self._mm)
        try:
            self._mr = nic.register(self._base, count * chunk_bytes, access)
        except nic.verbs.Error as exc:
            self._view.release()
            self._mm.close()
            raise registration_error("the staging buffer", count * chunk_bytes, exc) from None
        self.lkey = int(self._mr.lkey)
        self._error = nic.verbs.Error
        self._free = list(range(count))

    def take(self) -> int | None:
        """A free chunk's index, or ``None`` when all are in use."""
        return self._free.pop() if self._free else None

    def give(self, index: int) -> None:
        """Return chunk ``index``."""
        self._free.append(index)

    def address(self, index: int) -> int:
        """Address of chunk ``index``."""
        return self._base + index * self.chunk_bytes

    def view(self, index: int, length: int) -> memoryview:
        """The first ``length`` bytes of chunk ``index``."""
        start = index * self.chunk_bytes
        return self._view[start : start + length]

    def close(self) -> None:
        """Deregister and unmap (after the port's QPs are gone)."""
        try:
            self._mr.close()
        except self._error as exc:
            _log.warning("deregistering the staging buffer: %s", exc)
        self._view.release()
        with contextlib.suppress(BufferError):
            self._mm.close()
