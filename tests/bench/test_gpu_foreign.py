"""GPU memory in the foreign engines' drivers: NIXL registers ``cuda:N`` regions as ``VRAM``
of device N, Mooncake registers the device pointer (CUDA build only); both verify through a
host copy of the region.

Here (no GPU) the CPU tests check the refusals and the plumbing, with ``tests.fakes.cuda``
standing in for torch's memory where kvctl's own code is the subject; the ``gpu`` tests run
the engines on a real GPU and skip here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvctl.bench.engines import driver_class
from kvctl.bench.engines.foreign import ForeignTarget
from kvctl.bench.engines.mooncake import cuda_build
from kvctl.bench.engines.nixl import nixl_memory
from kvctl.bench.region import LocalRegion
from kvctl.bench.spec import Location
from kvctl.errors import UnavailableError, UsageError
from tests.fakes import cuda as fake_cuda

SWEEP = ("-b", "64KiB", "-n", "4", "-i", "2", "--warmup", "0", "--verify", "--json")


def _engine(name: str) -> None:
    reason = driver_class(name).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name} unavailable: {reason}")


needs_gpu = pytest.mark.skipif(not fake_cuda.real_gpu(), reason="needs torch with a CUDA device")


def test_nixl_memory_types() -> None:
    assert nixl_memory("cuda:3") == ("VRAM", 3)
    assert nixl_memory("cpu:1") == ("DRAM", 0)


def test_target_descriptors_carry_the_location() -> None:
    target = ForeignTarget(engine="nixl", transport="tcp", used="ucx-tcp", host="10.0.0.2",
                           address=1 << 40, region_bytes=4096, agent="a",
                           agent_metadata=b"\x00meta", location="cuda:1")
    assert ForeignTarget.from_json(target.to_json()) == target
    old = target.to_json()
    del old["location"]  # a target of the previous kvctl: host memory
    assert ForeignTarget.from_json(old).location == "cpu:0"


def test_gpu_region_moves_patterns_through_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = fake_cuda.install(monkeypatch)
    region = LocalRegion(8192, Location("cuda", 0))
    try:
        (alloc,) = torch.allocations
        assert region.on_gpu
        assert region.address == alloc.address  # the device pointer is what gets registered
        assert region.device == 0
        region.view(0, 4)[:] = b"abcd"
        assert alloc.mm[:4] == bytes(4)  # the host copy only, until synced
        region.sync(0, 4)
        assert alloc.mm[:4] == b"abcd"
        alloc.mm[100:103] = b"xyz"  # the engine wrote GPU memory
        region.refresh(96, 8)
        assert bytes(region.view(100, 3)) == b"xyz"
        region.write(200, b"poke")
        assert alloc.mm[200:204] == b"poke"
    finally:
        region.close()
        region.close()  # idempotent


def test_host_region_is_its_own_view() -> None:
    region = LocalRegion(4096, Location("cpu", 0))
    try:
        assert not region.on_gpu
        region.write(0, b"host")
        assert bytes(region.view(0, 4)) == b"host"
    finally:
        region.close()


def test_no_gpu_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.install(monkeypatch, devices=0)
    with pytest.raises(UnavailableError, match="no CUDA device cuda:0"):
        LocalRegion(4096, Location("cuda", 0))


def test_file_regions_are_refused() -> None:
    with pytest.raises(UsageError, match="cpu:N or cuda:N"):
        LocalRegion(4096, Location("file", 0))


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_cli_gpu_without_a_gpu_exits_unavailable(kvctl: Callable[..., Any], engine: str
                                                 ) -> None:
    _engine(engine)
    r = kvctl("bench", "transfer", "--engine", engine, "-t", "tcp", "--remote-location",
              "cuda:0", *SWEEP)
    assert r.exit_code == 3, r.stderr
    text = " ".join(r.stderr.split())
    assert "Error: nothing could run:" in text
    assert ("GPU segments unavailable" in text if engine == "nixl" or cuda_build()
            else "non-CUDA build" in text), text
    assert "Hint:" in text


@pytest.mark.integration
def test_cli_file_location_is_a_usage_error_for_foreign_engines(kvctl: Callable[..., Any],
                                                                tmp_path: Any) -> None:
    _engine("nixl")
    r = kvctl("bench", "transfer", "--engine", "nixl", "-t", "tcp", "--local-location",
              f"file:{tmp_path / 'f'}", *SWEEP)
    assert r.exit_code == 2, r.stderr
    assert "benchmarks cpu:N and cuda:N memory" in " ".join(r.stderr.split())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("local", "remote"), [("cuda:0", "cuda:0"), ("cuda:0", "cpu:0"),
                                               ("cpu:0", "cuda:0")])
def test_real_nixl_vram_rows(kvctl: Callable[..., Any], local: str, remote: str) -> None:
    _engine("nixl")
    fake_cuda.verified_rows(kvctl("bench", "transfer", "--engine", "nixl", "-t", "tcp",
                                  "--local-location", local, "--remote-location", remote,
                                  *SWEEP))


@pytest.mark.gpu
@needs_gpu
def test_real_mooncake_gpu_rows(kvctl: Callable[..., Any]) -> None:
    _engine("mooncake")
    if not cuda_build():
        pytest.skip("the installed Mooncake is the non-CUDA build")
    fake_cuda.verified_rows(kvctl("bench", "transfer", "--engine", "mooncake", "-t", "tcp",
                                  "--local-location", "cuda:0", "--remote-location", "cuda:0",
                                  *SWEEP))
