"""doctor env's NIXL and CUDA items as kvctl uses them (issue 16 item 14)."""

from __future__ import annotations

from types import SimpleNamespace

from kvctl.doctor.env import Status, check_cuda, check_nixl


def importer_with(*present: str, cuda_devices: int = 1) -> object:
    def load(name: str) -> object:
        if name not in present:
            raise ImportError(f"No module named {name!r}", name=name)
        if name == "torch":
            return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: cuda_devices > 0,
                                                        device_count=lambda: cuda_devices),
                                   version=SimpleNamespace(cuda="12.4"))
        if name == "cupy":
            runtime = SimpleNamespace(getDeviceCount=lambda: cuda_devices)
            return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
        return SimpleNamespace()

    return load


def test_nixl_through_the_cuda_wheel_is_ok_with_the_meta_package_hint() -> None:
    status = check_nixl(importer_with("nixl_cu12._api"))  # type: ignore[arg-type]
    assert status.status is Status.OK
    assert "nixl_cu12._api importable" in status.detail
    assert status.hint is not None
    assert "pip install --no-deps nixl" in status.hint


def test_nixl_meta_package_is_plain_ok() -> None:
    status = check_nixl(importer_with("nixl._api"))  # type: ignore[arg-type]
    assert status.status is Status.OK
    assert status.hint is None


def test_nixl_nothing_importable() -> None:
    status = check_nixl(importer_with())  # type: ignore[arg-type]
    assert status.status in (Status.ERROR, Status.UNAVAILABLE)  # ERROR when a wheel is there
    assert "nixl_cu12._api" in status.detail


def test_cupy_alone_is_not_enough_for_gpu_segments() -> None:
    status = check_cuda(importer_with("cupy"))  # type: ignore[arg-type]
    assert status.status is Status.UNAVAILABLE
    assert "GPU segments need torch" in status.detail
    assert status.hint is not None
    assert "torch" in status.hint


def test_torch_with_cuda_is_ok() -> None:
    status = check_cuda(importer_with("torch", "cupy", cuda_devices=2))  # type: ignore[arg-type]
    assert status.status is Status.OK
    assert status.detail == "torch: 2 CUDA device(s), built for CUDA 12.4"
