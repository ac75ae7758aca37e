"""`--nic ,` (an empty pin list, or an empty item in one) is a usage error: it used to
pin nothing, so the bench quietly ran on topo's ranking while the user asked for a pin."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvctl.bench.spec import BenchSettings, build_sweep, parse_rdma_pins
from kvctl.errors import UsageError
from tests.fixtures.cli import CliResult


@pytest.mark.parametrize("nic", [",", " , ", ",,", "mlx5_0,", ",mlx5_0", "mlx5_0,,mlx5_1"])
def test_an_empty_item_is_refused(nic: str) -> None:
    with pytest.raises(UsageError, match="has an empty item") as info:
        build_sweep(BenchSettings(transport="rdma", nic=nic))
    assert "--nic mlx5_0,mlx5_1:1" in (info.value.hint or "")


def test_no_nic_pins_nothing_and_a_list_keeps_its_order() -> None:
    assert parse_rdma_pins("", None) == ((), None)
    assert parse_rdma_pins("  ", None) == ((), None)
    assert parse_rdma_pins(" mlx5_1:1 , mlx5_0 ", 2) == (("mlx5_1:1", "mlx5_0"), 2)


@pytest.mark.parametrize("role", [[], ["--role", "target"]])
def test_cli_nic_comma_is_exit_2_before_anything_runs(
        kvctl: Callable[..., CliResult], role: list[str]) -> None:
    r = kvctl("bench", "transfer", *role, "-t", "auto", "--nic", ",", "-b", "4KiB", "-n", "1",
              "--op", "read", "-d", "0.1s")
    assert r.exit_code == 2, r.stderr
    assert "Error: --nic ',' has an empty item: it would pin no NIC" in r.stderr
    assert "\nHint: " in r.stderr
    assert "Benchmarking" not in r.stdout + r.stderr
