"""GPU memory through the engine: GPU targets and GPU initiators over shm, tcp and rdma.

Without a GPU, ``tests.fakes.cuda`` stands in for torch's CUDA memory (a memfd the fake
NICs reach only by dma-buf, or by a plain MR when the fake host has peermem); each row's
path says which way the bytes went (``[dmabuf->host]``, ``[peermem->..]``,
``[staged->..]``). The tests marked ``gpu`` run the same on a real GPU and skip here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvctl.transfer import OpCode, TransferEngine, TransferRequest
from kvctl.transfer.transports.rdma import RdmaOptions
from tests.fakes import cuda as fake_cuda
from tests.fakes.fabric import Fabric, fabric_fixture  # noqa: F401
from tests.transfer._helpers import memory_url, pattern

MiB = 1 << 20


def _paths(engine: TransferEngine, batch: Any) -> set[str]:
    return {p for s in engine.status(batch) for p in s.path.split(",")}


def _gpu_bytes(engine: TransferEngine, name: str) -> bytes:
    buf = engine._segments[name].buffers[0]
    out = bytearray(buf.length)
    buf.read_into(0, memoryview(out))
    return bytes(out)


def _roundtrip(ini: TransferEngine, tgt: TransferEngine, local: str, remote: str,
               size: int, run: int) -> set[str]:
    data = pattern(run, 0, 0, size)
    local_buf = ini._segments[local].buffers[0]
    local_buf.write_from(0, memoryview(data))
    batch = ini.allocate_batch(1)
    result = ini.run(batch, [TransferRequest(OpCode.WRITE, local, 0, remote, 0, size)],
                     timeout_s=30)
    assert result.ok, result.first_cause
    paths = _paths(ini, batch)
    ini.free_batch(batch)
    target = tgt._segments[remote].buffers[0]
    got = bytearray(size)
    target.read_into(0, memoryview(got))
    assert bytes(got) == data
    back = pattern(run + 1, 0, 0, size)
    target.write_from(0, memoryview(back))
    assert ini.transfer([TransferRequest(OpCode.READ, local, 0, remote, 0, size)]).ok
    got = bytearray(size)
    local_buf.read_into(0, memoryview(got))
    assert bytes(got) == back
    return paths


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_gpu_initiator_and_gpu_target_over_shm_and_tcp(monkeypatch: pytest.MonkeyPatch,
                                                       transport: str) -> None:
    fake_cuda.install(monkeypatch)
    url = memory_url()
    with TransferEngine("t", url, transport="tcp") as tgt, TransferEngine(
            "i", url, transport=transport) as ini:
        if transport == "shm":  # shm maps host memory; a GPU target is served over tcp
            tgt.register_segment("host-kv", 2 * MiB)
        else:
            tgt.register_segment("host-kv", 2 * MiB, kind="gpu", location="cuda:0")
        ini.register_segment("gpu-kv", 2 * MiB, kind="gpu", location="cuda:0")
        _roundtrip(ini, tgt, "gpu-kv", "host-kv", 2 * MiB, 30)


def _gpu_host(fabric: Fabric, *, peermem: bool = False) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"),
                retry_s=0.01, peermem=peermem)


def test_gpu_target_and_initiator_over_rdma_by_dmabuf(fabric: Fabric,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch = fake_cuda.install(monkeypatch)
    _gpu_host(fabric)  # no peermem: a plain MR on device memory fails with EFAULT
    options = RdmaOptions(cuda=torch.gateway(), peermem=False)
    url = memory_url()
    with TransferEngine("t", url, transport="rdma", rdma=options) as tgt, TransferEngine(
            "i", url, transport="rdma", rdma=options) as ini:
        tgt.register_segment("gpu-remote", 4 * MiB, kind="gpu", location="cuda:0")
        info = tgt.lookup("gpu-remote")
        assert "rdma" in info.transports
        assert info.rdma[0]["mode"] == "dmabuf"
        ini.register_segment("gpu-local", 4 * MiB, kind="gpu", location="cuda:0")
        paths = _roundtrip(ini, tgt, "gpu-local", "gpu-remote", 4 * MiB, 31)
        assert paths == {"rdma:mlx5_0:1->mlx5_0:1[dmabuf->dmabuf]",
                         "rdma:mlx5_1:1->mlx5_1:1[dmabuf->dmabuf]"}


def test_gpu_memory_by_peermem(fabric: Fabric, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.install(monkeypatch)
    _gpu_host(fabric, peermem=True)
    options = RdmaOptions(gpu_memory="peermem", peermem=True)
    url = memory_url()
    with TransferEngine("t", url, transport="rdma") as tgt, TransferEngine(
            "i", url, transport="rdma", rdma=options) as ini:
        tgt.register_segment("remote", 2 * MiB)
        ini.register_segment("gpu-local", 2 * MiB, kind="gpu", location="cuda:0")
        paths = _roundtrip(ini, tgt, "gpu-local", "remote", 2 * MiB, 32)
        assert all(p.endswith("[peermem->host]") for p in paths)


def test_gpu_without_dmabuf_or_peermem_is_staged_and_never_a_target(
        fabric: Fabric, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.install(monkeypatch)
    _gpu_host(fabric)

    class NoDmabuf:
        def dmabuf(self, pointer: int, length: int) -> tuple[int, int]:
            from kvctl.errors import UnavailableError

            raise UnavailableError("cuMemGetHandleForAddressRange failed (CUresult 801)",
                                   "not supported")

    options = RdmaOptions(cuda=NoDmabuf(), peermem=False)
    url = memory_url()
    with TransferEngine("t", url, transport="auto", rdma=options) as tgt, TransferEngine(
            "i", url, transport="rdma", rdma=options) as ini:
        tgt.register_segment("gpu-remote", MiB, kind="gpu", location="cuda:0")
        assert tgt.lookup("gpu-remote").transports == ("tcp",)  # one-sided needs an MR
        tgt.register_segment("remote", 2 * MiB)
        ini.register_segment("gpu-local", 2 * MiB, kind="gpu", location="cuda:0")
        paths = _roundtrip(ini, tgt, "gpu-local", "remote", 2 * MiB, 33)
        assert all(p.endswith("[staged->host]") for p in paths)


def test_explicit_dmabuf_that_cannot_work_says_why(fabric: Fabric,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.transfer import TransportUnavailableError

    fake_cuda.install(monkeypatch)
    _gpu_host(fabric)
    options = RdmaOptions(gpu_memory="peermem", peermem=False)
    with TransferEngine("t", memory_url(), transport="rdma", rdma=options) as tgt, \
            pytest.raises(TransportUnavailableError, match="nvidia_peermem is not loaded"):
        tgt.register_segment("gpu", MiB, kind="gpu", location="cuda:0")


# ---------------------------------------------------------------------------- real GPU


def _torch_cuda() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


_NO_GPU = _torch_cuda()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=f"needs a GPU: {_NO_GPU}")
@pytest.mark.parametrize("transport", ["shm", "tcp", "auto"])
def test_real_gpu_segments_and_initiators(transport: str) -> None:  # pragma: no cover
    url = memory_url()
    with TransferEngine("t", url, transport=transport) as tgt, TransferEngine(
            "i", url, transport=transport) as ini:
        tgt.register_segment("host-kv", 8 * MiB)
        tgt.register_segment("gpu-kv", 8 * MiB, kind="gpu", location="cuda:0")
        ini.register_segment("gpu-local", 8 * MiB, kind="gpu", location="cuda:0")
        _roundtrip(ini, tgt, "gpu-local", "host-kv", 8 * MiB, 40)
        if transport != "shm":
            _roundtrip(ini, tgt, "gpu-local", "gpu-kv", 8 * MiB, 42)
