"""The NVML gateway: lazy init, typed unavailability, NotSupported fields, NVLinks."""

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from kvctl.probe.nvml import (
    NvmlReport,
    PynvmlBackend,
    nvml_from_dict,
    nvml_to_dict,
)
from kvctl.probe.types import Unavailable


class FakeNvml:
    """Stands in for the pynvml module, raising pynvml's real error classes."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_NVLINK_MAX_LINKS = 4
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def __init__(self, *, init_error: int | None = None, unsupported: tuple[str, ...] = (),
                 nvlinks: int = 0) -> None:
        self.init_error = init_error
        self.unsupported = unsupported
        self.nvlinks = nvlinks
        self.init_calls = 0
        self.shutdowns = 0

    def _maybe(self, name: str, value: Any) -> Any:
        if name in self.unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._maybe("name", "NVIDIA H100 80GB HBM3")

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._maybe("uuid", f"GPU-{h}")

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return self._maybe("memory", SimpleNamespace(total=80 << 30))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self._maybe("pcie", 5)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self._maybe("pcie", 5)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self._maybe("pcie", 16)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return self._maybe("pcie", 16)

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return SimpleNamespace(busId=b"00000000:E1:00.0")

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return 2


def test_real_pynvml_without_driver_is_unavailable_not_a_crash() -> None:
    backend = PynvmlBackend()
    answer = backend.query()
    backend.close()
    if isinstance(answer, NvmlReport):
        pytest.skip("this host has an NVIDIA driver")
    assert answer.source == "nvml"
    assert "not found" in answer.reason or "not loaded" in answer.reason


def test_driver_not_loaded_is_typed_and_init_is_not_retried() -> None:
    fake = FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    backend = PynvmlBackend(fake)
    first = backend.query()
    second = backend.query()
    assert isinstance(first, Unavailable)
    assert first.reason == "NVIDIA driver not loaded"
    assert second == first
    assert fake.init_calls == 1


def test_full_answer_and_lazy_init() -> None:
    fake = FakeNvml(nvlinks=3)
    backend = PynvmlBackend(fake)
    assert fake.init_calls == 0
    answer = backend.query()
    assert isinstance(answer, NvmlReport)
    assert answer.driver_version == "550.54.15"
    assert [g.pci for g in answer.gpus] == ["0000:18:00.0", "0000:19:00.0"]
    gpu = answer.gpus[0]
    assert (gpu.name, gpu.memory_total_bytes, gpu.pcie_width_max) == (
        "NVIDIA H100 80GB HBM3", 80 << 30, 16)
    assert len(gpu.nvlinks) == 3
    assert all(link.remote_is_switch and link.remote_pci == "0000:e1:00.0"
               for link in gpu.nvlinks)
    backend.close()
    backend.close()
    assert fake.shutdowns == 1


def test_not_supported_fields_become_none_with_reason() -> None:
    answer = PynvmlBackend(FakeNvml(unsupported=("memory", "pcie"))).query()
    assert isinstance(answer, NvmlReport)
    gpu = answer.gpus[1]
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.memory_total_bytes is None
    assert gpu.pcie_gen_current is None
    assert gpu.missing["memory_total_bytes"] == "not supported"
    assert gpu.nvlinks == ()


def test_round_trip_through_json_form() -> None:
    answer = PynvmlBackend(FakeNvml(nvlinks=2, unsupported=("uuid",))).query()
    assert nvml_from_dict(nvml_to_dict(answer)) == answer
    gone = Unavailable("nvml", "NVIDIA driver not loaded", "load it")
    assert nvml_from_dict(nvml_to_dict(gone)) == gone
