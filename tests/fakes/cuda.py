"""A stand-in for CUDA memory without a GPU: the slice of torch that GPU segments use, and a
CUDA driver gateway that exports device memory as dma-bufs.

"Device memory" is a memfd mapped into this process, so NICs of the fake pyverbs can reach
it the ways real NICs reach GPU memory, and only those: a dma-buf MR (the memfd is the
dma-buf) works; a plain MR on the device pointer fails with EFAULT unless the fake host
has ``peermem`` (as with nvidia_peermem loaded). Host code never touches device memory
directly: :class:`GpuBuffer <kvctl.transfer.segments.GpuBuffer>` copies through pinned
host tensors, as with real CUDA.

Use :func:`install` with ``monkeypatch`` to make ``kvctl.transfer.segments`` see it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from tests.fakes.pyverbs._hca import STATE

uint8 = "uint8"


class _Allocation:
    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("fake-cuda", 0)
        os.ftruncate(self.fd, max(size, 1))
        self.mm = mmap.mmap(self.fd, max(size, 1), mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        with STATE.lock:
            STATE.gpu_ranges.append((self.address, self.address + size))


class Tensor:
    """A 1-D uint8 tensor over host bytes or fake device memory."""

    def __init__(self, view: memoryview, device: str, alloc: _Allocation | None = None,
                 offset: int = 0) -> None:
        self._view = view
        self.device = device
        self._alloc = alloc
        self._offset = offset

    def numel(self) -> int:
        return self._view.nbytes

    def data_ptr(self) -> int:
        if self._alloc is not None:
            return self._alloc.address + self._offset
        return ctypes.addressof(ctypes.c_char.from_buffer(self._view))

    def __getitem__(self, key: slice) -> Tensor:
        start, stop, _ = key.indices(self._view.nbytes)
        return Tensor(self._view[start:stop], self.device, self._alloc, self._offset + start)

    def copy_(self, other: Tensor) -> Tensor:
        if other.numel() != self.numel():
            raise RuntimeError(f"copy_ of {other.numel()} bytes into {self.numel()}")
        self._view[:] = other._view
        return self

    def tobytes(self) -> bytes:
        """Test helper: the bytes (what ``tensor.cpu().numpy().tobytes()`` gives)."""
        return bytes(self._view)


class _Cuda:
    def __init__(self, devices: int) -> None:
        self._devices = devices

    def is_available(self) -> bool:
        return self._devices > 0

    def device_count(self) -> int:
        return self._devices


class FakeTorch:
    """``torch`` as :mod:`kvctl.transfer.segments` uses it."""

    uint8 = uint8

    def __init__(self, devices: int = 1) -> None:
        self.cuda = _Cuda(devices)
        self.allocations: list[_Allocation] = []

    def zeros(self, size: int, dtype: str = uint8, device: str = "cpu") -> Tensor:
        if device.startswith("cuda"):
            alloc = _Allocation(size)
            self.allocations.append(alloc)
            return Tensor(memoryview(alloc.mm)[:size], device, alloc)
        return Tensor(memoryview(bytearray(size)), device)

    def empty(self, size: int, dtype: str = uint8, pin_memory: bool = False) -> Tensor:
        return Tensor(memoryview(bytearray(size)), "cpu")

    def frombuffer(self, buffer: Any, dtype: str = uint8) -> Tensor:
        return Tensor(memoryview(buffer).cast("B"), "cpu")

    def gateway(self) -> FakeCudaDriver:
        return FakeCudaDriver(self)


class FakeCudaDriver:
    """:class:`~kvctl.transfer.transports.rdma.memory.CudaGateway` over the fake memory:
    ``cuMemGetHandleForAddressRange`` returns a new fd of the allocation's memfd."""

    def __init__(self, torch: FakeTorch) -> None:
        self._torch = torch
        self.exported = 0

    def dmabuf(self, pointer: int, length: int) -> tuple[int, int]:
        for alloc in self._torch.allocations:
            if alloc.address <= pointer and pointer + length <= alloc.address + alloc.size:
                self.exported += 1
                return os.dup(alloc.fd), pointer - alloc.address
        from kvctl.errors import UnavailableError

        raise UnavailableError("cuMemGetHandleForAddressRange failed (CUresult 1)",
                               "the range is not device memory")


def install(monkeypatch: Any, devices: int = 1) -> FakeTorch:
    """Make GPU segments use a :class:`FakeTorch` for the rest of the test."""
    from kvctl.transfer import segments

    torch = FakeTorch(devices)
    monkeypatch.setattr(segments, "_torch", lambda: torch)
    return torch


def real_gpu() -> bool:
    """Whether torch is installed and sees a CUDA device (the ``gpu`` tests need one)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def verified_rows(result: Any) -> list[dict[str, Any]]:
    """The rows of a ``kvctl bench transfer --verify --json`` run, checked: exit 0, at least
    one row, every row verified without errors."""
    assert result.exit_code == 0, result.stderr
    rows: list[dict[str, Any]] = result.json()["rows"]
    assert rows
    assert all(row["verified"] and not row["errors"] for row in rows), rows
    return rows
