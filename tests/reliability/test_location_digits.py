"""Hostile spellings of cuda:N, RDMA NIC pins and CUDA_VISIBLE_DEVICES: str.isdigit()
accepts '²' (int() refuses it: an internal error) and ARABIC-INDIC DIGIT ONE (int()
reads 1: a silent misparse); every such value must be a usage error or, in
CUDA_VISIBLE_DEVICES, end the list as CUDA does."""

from __future__ import annotations

import pytest

from kvctl import cli
from kvctl.bench.spec import parse_location as bench_location
from kvctl.errors import UsageError
from kvctl.probe.nvml import NvmlGpu, cuda_ordinals
from kvctl.transfer.segments import parse_location as segment_location
from kvctl.transfer.transports.rdma import RdmaOptions

NOT_ASCII = ["²", "\u0661", "\u0663", "\U0001d7d8"]
GPUS = (NvmlGpu(0, "0000:a3:00.0", "H100", "GPU-aaaa-0000"),
        NvmlGpu(1, "0000:a7:00.0", "H100", "GPU-bbbb-0000"))


@pytest.mark.parametrize("digit", NOT_ASCII)
def test_cuda_visible_devices_with_a_non_ascii_digit_ends_the_list(digit: str) -> None:
    ordinals = cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": f"1,{digit}"})
    assert [g.pci for g in ordinals.visible] == ["0000:a7:00.0"]
    assert any(digit in note for note in ordinals.notes)


@pytest.mark.parametrize(("raw", "visible"), [
    ("-1", []), ("", []), ("1,1", ["0000:a7:00.0"]), ("0,-1,1", ["0000:a3:00.0"]),
    (" 1 , 0 ", ["0000:a7:00.0", "0000:a3:00.0"]), ("GPU-", []),
    ("MIG-GPU-aaaa-0000/1/0", []), ("gpu-BBBB", ["0000:a7:00.0"]), ("7", []),
])
def test_odd_cuda_visible_devices(raw: str, visible: list[str]) -> None:
    ordinals = cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": raw})
    assert [g.pci for g in ordinals.visible] == visible
    assert len(ordinals.visible) + len(ordinals.hidden) == len(GPUS)


@pytest.mark.parametrize("digit", NOT_ASCII)
def test_locations_with_a_non_ascii_digit_are_usage_errors(digit: str) -> None:
    with pytest.raises(UsageError):
        bench_location(f"cuda:{digit}")
    with pytest.raises(UsageError):
        segment_location(f"cuda:{digit}")


@pytest.mark.parametrize("digit", NOT_ASCII)
def test_a_nic_port_with_a_non_ascii_digit_is_a_usage_error(digit: str) -> None:
    with pytest.raises(UsageError, match="mlx5_0:"):
        RdmaOptions(nics=(f"mlx5_0:{digit}",)).check()


@pytest.mark.parametrize("args", [
    ["bench", "transfer", "-t", "tcp", "--local-location", "cuda:²"],
    ["bench", "transfer", "-t", "rdma", "--nic", "mlx5_0:²"],
    ["bench", "transfer", "-t", "tcp", "-n", "²"],
])
def test_the_cli_says_usage_not_bug(args: list[str], capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    assert cli.main([*args, "-d", "0.1s", "-b", "4KiB"]) == 2
    err = capsys.readouterr().err
    assert "Error: " in err
    assert "Hint: " in err
    assert "this is a bug" not in err


@pytest.mark.parametrize("digit", NOT_ASCII)
@pytest.mark.parametrize("url", ["etcd://127.0.0.1:{d}", "redis://127.0.0.1:6379/{d}",
                                 "http://127.0.0.1:{d}"])
def test_metadata_urls_with_a_non_ascii_number_are_usage_errors(kvctl, url: str,
                                                                digit: str) -> None:
    result = kvctl("metadata", "ls", "--metadata", url.format(d=digit))
    assert result.exit_code == 2, result.stderr
    assert "Error: " in result.stderr
    assert "Hint: " in result.stderr
    assert "bug" not in result.stderr
