"""``--nic`` reaches the Mooncake and NIXL targets ``--role target`` starts (they used
topo's ranking whatever was pinned), and the same-host targets an initiator spawns."""

from __future__ import annotations

from typing import Any

import pytest

from kvctl.bench.engines import mooncake, nixl
from kvctl.bench.target.kvctl import TargetSpec
from kvctl.bench.target.serve import TargetSet
from kvctl.errors import UnavailableError


@pytest.mark.parametrize("module", [mooncake, nixl])
def test_the_pins_reach_the_target_process(module: Any, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    seen: list[tuple[Any, ...]] = []

    def spawn(main: Any, args: tuple[Any, ...], **_kw: Any) -> tuple[None, None]:
        seen.append(args)
        return None, None

    monkeypatch.setattr(module, "launch_target", spawn)
    driver = mooncake.MooncakeDriver if module is mooncake else nixl.NixlDriver
    monkeypatch.setattr(driver, "check_transport", classmethod(lambda *a, **k: None))
    driver.launch_target(1 << 20, "rdma", "10.0.0.5", "cpu:0", ("mlx5_1", "mlx5_0:1"))
    driver.launch_target(1 << 20, "tcp", "10.0.0.5", "cpu:0")
    assert seen[0][-1] == ("mlx5_1", "mlx5_0:1")
    assert seen[1][-1] == ()
    # the target's entry point takes them before its pipe (the spawn appends the pipe)
    params = list(module._target_main.__code__.co_varnames[:6])
    assert params[4:] == ["nics", "conn"]


def test_role_target_hands_its_pins_to_each_foreign_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[tuple[str, ...]] = []

    def launch(cls: Any, region_bytes: int, transport: str, host: str,
               location: str = "cpu:0", nics: tuple[str, ...] = ()) -> Any:
        got.append(tuple(nics))
        raise UnavailableError("not here", None)

    monkeypatch.setattr(mooncake.MooncakeDriver, "launch_target", classmethod(launch))
    monkeypatch.setattr(mooncake.MooncakeDriver, "unavailable_reason",
                        classmethod(lambda cls: None))
    server = TargetSet(TargetSpec(1 << 20, nics=("mlx5_2",)), ["mooncake"], ["rdma"])
    skipped: list[Any] = []
    assert server._serve("mooncake", "10.0.0.5", skipped) == []
    assert got == [("mlx5_2",)]
