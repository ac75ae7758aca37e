from pathlib import Path

import pytest

from kvctl.doctor.env import (
    Status,
    check_cuda,
    check_metadata_url,
    check_nvml,
    check_package,
    check_rdma,
)
from kvctl.probe.nvml import NvmlGpu, NvmlReport, RecordedNvml
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs, VerbsDevice, VerbsReport


def test_nvml_missing_driver_is_unavailable_with_hint() -> None:
    status = check_nvml(RecordedNvml(Unavailable("nvml", "no driver", "install the driver")))
    assert status.status is Status.UNAVAILABLE
    assert status.detail == "no driver"
    assert status.hint == "install the driver"


def test_nvml_with_gpus_is_ok() -> None:
    report = NvmlReport("550.54", (NvmlGpu(0, "0000:18:00.0"), NvmlGpu(1, "0000:2a:00.0")))
    status = check_nvml(RecordedNvml(report))
    assert status.status is Status.OK
    assert "550.54" in status.detail
    assert "2 GPU" in status.detail


def test_rdma_states() -> None:
    none = check_rdma(RecordedVerbs(VerbsReport(())))
    assert none.status is Status.UNAVAILABLE
    assert none.hint
    some = check_rdma(RecordedVerbs(VerbsReport((VerbsDevice("mlx5_0", ()),))))
    assert some.status is Status.OK
    assert "mlx5_0" in some.detail


def test_live_rdma_without_devices_says_why() -> None:
    status = check_rdma()
    # This machine has pyverbs but no RDMA NIC; a host with one reports ok.
    assert status.status in (Status.OK, Status.UNAVAILABLE)
    if status.status is Status.UNAVAILABLE:
        assert status.detail
        assert status.hint


def test_cuda_reports_every_reason() -> None:
    def importer(name: str) -> object:
        raise ImportError(f"No module named {name!r}", name=name)

    status = check_cuda(importer)
    assert status.status is Status.UNAVAILABLE
    assert "torch not installed" in status.detail
    assert "cupy not installed" in status.detail


def test_installed_package_is_ok_and_reports_binaries() -> None:
    status = check_package("mooncake", ["mooncake-transfer-engine-non-cuda"],
                           "mooncake.engine", "pip install it", binaries=["mooncake_master"])
    assert status.status is Status.OK, status.detail
    assert "mooncake_master" in status.detail


def test_missing_package_is_unavailable_with_install_hint() -> None:
    status = check_package("nothing", ["no-such-dist-kvctl"], "no_such_module_kvctl",
                           "pip install nothing")
    assert status.status is Status.UNAVAILABLE
    assert status.hint == "pip install nothing"


def test_metadata_url_reachable_and_not(tmp_path: Path) -> None:
    ok = check_metadata_url(f"file://{tmp_path}")
    assert ok.status is Status.OK
    down = check_metadata_url("http://127.0.0.1:1")
    assert down.status is Status.ERROR
    assert "127.0.0.1:1" in down.detail
    assert down.hint


def test_cli_json_lists_components(kvctl) -> None:
    result = kvctl("doctor", "env", "--json", "--metadata", "memory://")
    assert result.exit_code == 0
    doc = result.json()
    assert doc["kind"] == "doctor.env"
    names = [c["name"] for c in doc["components"]]
    assert names[:5] == ["nvml", "rdma", "cuda", "mooncake", "nixl"]
    assert "memory" in names
    assert (doc["ok"], doc["checks"]) == (True, [])  # nothing required, nothing judged


@pytest.mark.parametrize("component", ["cuda", "nosuch"])
def test_cli_require_missing_component_exits_3(kvctl, component: str) -> None:
    result = kvctl("doctor", "env", "--require", component)
    assert result.exit_code == 3
    assert "Error:" in result.stderr
    assert "Hint:" in result.stderr


def test_cli_require_says_how_a_component_is_unusable(kvctl) -> None:
    result = kvctl("doctor", "env", "--require", "memory", "--require", "cuda", "--json",
                   "--metadata", "memory://")
    assert result.exit_code == 3
    doc = result.json()
    assert doc["ok"] is False
    assert [(c["name"], c["status"]) for c in doc["checks"]] == [("memory", "pass"),
                                                                ("cuda", "fail")]
    assert "required component cuda is not available: " in result.stderr
    assert " is unavailable" not in result.stderr
    assert " is error" not in result.stderr
