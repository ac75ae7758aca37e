"""The memory a foreign engine (Mooncake, NIXL) registers: host memory or GPU memory.

``cpu:N`` is an anonymous mapping. ``cuda:N`` is GPU memory allocated the way kvctl's own
GPU segments are (:func:`~kvctl.transfer.segments.create_gpu_segment`: torch, on the CUDA
ordinal under ``CUDA_VISIBLE_DEVICES``); the engine registers its device pointer (NIXL as
``VRAM`` on that device, Mooncake by address, its CUDA build telling the location itself).
Either way the region has a host view of the same size for verification patterns: for GPU
memory it is a copy, moved in with :meth:`LocalRegion.sync` and out with
:meth:`LocalRegion.refresh` around the engine's batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import TYPE_CHECKING

from kvctl.bench.spec import Location
from kvctl.errors import UnavailableError, UsageError

if TYPE_CHECKING:
    from kvctl.transfer.segments import GpuBuffer, LocalSegment


def check_gpu(index: int) -> None:
    """Whether GPU ``cuda:index`` can hold GPU memory here, allocating one byte through
    kvctl's GPU path (torch, under ``CUDA_VISIBLE_DEVICES``).

    Raises:
        UnavailableError: no torch, no CUDA device, or no device ``cuda:index``.
    """
    from kvctl.transfer.segments import create_gpu_segment

    create_gpu_segment("kvctl-bench-gpu-check", 1, device_index=index).close()


class LocalRegion:
    """``size`` bytes at ``location`` (``cpu:N`` or ``cuda:N``) and a host view of them.

    Attributes:
        address: what the engine registers and addresses: the mapping's address, or the
            GPU memory's device pointer.
        device: the CUDA ordinal for GPU memory, else 0 (NIXL's ``devID`` of DRAM).

    Raises (constructor):
        UsageError: a location that is neither ``cpu:N`` nor ``cuda:N``.
        UnavailableError: GPU memory cannot be allocated here.
    """

    def __init__(self, size: int, location: Location) -> None:
        if location.kind not in ("cpu", "cuda"):
            raise UsageError(f"foreign engines register cpu:N or cuda:N memory, not {location}",
                             "use --local-location/--remote-location cpu:0 or cuda:0")
        self.size = size
        self.location = location
        self._gpu: GpuBuffer | None = None
        self._seg: LocalSegment | None = None
        self._mm = mmap.mmap(-1, size)
        if location.kind == "cuda":
            from kvctl.transfer.segments import GpuBuffer, create_gpu_segment

            seg = create_gpu_segment("kvctl-bench-foreign", size, device_index=location.index)
            buf = seg.buffers[0]
            if not isinstance(buf, GpuBuffer):  # pragma: no cover - create_gpu_segment's type
                seg.close()
                raise UnavailableError("GPU memory came back as host memory",
                                       "report this as a kvctl bug")
            self._gpu, self._seg = buf, seg
            self.address = buf.device_pointer
            self.device = location.index
        else:
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
            self.device = 0

    @property
    def on_gpu(self) -> bool:
        """Whether the region is GPU memory."""
        return self._gpu is not None

    def view(self, offset: int, length: int) -> memoryview:
        """The host view of ``length`` bytes at ``offset`` (the memory itself for host
        regions, a copy for GPU ones)."""
        return memoryview(self._mm)[offset : offset + length]

    def sync(self, offset: int, length: int) -> None:
        """Copy the host view's bytes into GPU memory (no-op for host memory)."""
        if self._gpu is not None:
            self._gpu.write_from(offset, self.view(offset, length))

    def refresh(self, offset: int, length: int) -> None:
        """Copy GPU memory into the host view (no-op for host memory)."""
        if self._gpu is not None:
            self._gpu.read_into(offset, self.view(offset, length))

    def write(self, offset: int, data: bytes) -> None:
        """Put ``data`` at ``offset`` where the engine reads it."""
        self._mm[offset : offset + len(data)] = data
        self.sync(offset, len(data))

    def close(self) -> None:
        """Free the GPU memory and unmap (after the engine deregistered it). Idempotent."""
        self._gpu = None
        seg, self._seg = self._seg, None
        if seg is not None:
            seg.close()
        with contextlib.suppress(BufferError):  # a view still exported: the GC unmaps it
            self._mm.close()
