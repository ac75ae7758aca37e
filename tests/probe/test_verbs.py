"""The verbs backend: unavailable here, and port facts from a fake pyverbs."""

from types import SimpleNamespace
from typing import Any

import pytest

from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import PyverbsBackend, VerbsReport, verbs_from_dict, verbs_to_dict


class FakeError(Exception):
    pass


class FakeContext:
    def __init__(self, ports: dict[int, dict[str, int]], name: str) -> None:
        self.ports = ports
        self.name = name
        self.closed = False

    def query_device(self) -> Any:
        return SimpleNamespace(phys_port_cnt=len(self.ports))

    def query_port(self, port: int) -> Any:
        return SimpleNamespace(**self.ports[port])

    def query_gid(self, port: int, index: int) -> str:
        if index == 0:
            return "fe80:0000:0000:0000:0a00:00ff:fe00:0001"
        if index == 1:
            return "0000:0000:0000:0000:0000:0000:0000:0000"
        raise FakeError("no gid")

    def query_gid_type(self, port: int, index: int) -> int:
        return 1  # IBV_GID_TYPE_SYSFS_ROCE_V2, as ibv_query_gid_type answers

    def close(self) -> None:
        self.closed = True


def fake_pyverbs(ports: dict[int, dict[str, int]] | None, *, fail: bool = False) -> Any:
    contexts: list[FakeContext] = []

    def get_device_list() -> list[Any]:
        if fail:
            raise FakeError("Failed to get devices list")
        return [] if ports is None else [SimpleNamespace(name=b"mlx5_0")]

    def context(name: str) -> FakeContext:
        ctx = FakeContext(ports or {}, name)
        contexts.append(ctx)
        return ctx

    return SimpleNamespace(PyverbsError=FakeError, get_device_list=get_device_list,
                           Context=context, contexts=contexts)


ACTIVE = {"state": 4, "active_mtu": 5, "max_mtu": 5, "active_speed": 64, "active_width": 2,
          "link_layer": 2, "gid_tbl_len": 3}
DOWN = {**ACTIVE, "state": 1, "active_mtu": 3}


def test_real_pyverbs_here_is_unavailable() -> None:
    answer = PyverbsBackend().query()
    if isinstance(answer, VerbsReport):
        pytest.skip("this host has RDMA devices")
    assert answer.source == "verbs"
    assert answer.reason


def test_device_list_failure_and_no_devices() -> None:
    failed = PyverbsBackend(fake_pyverbs(None, fail=True)).query()
    assert isinstance(failed, Unavailable)
    assert "Failed to get devices list" in failed.reason
    empty = PyverbsBackend(fake_pyverbs(None)).query()
    assert isinstance(empty, Unavailable)
    assert "no RDMA devices" in empty.reason


def test_ports_up_and_down() -> None:
    module = fake_pyverbs({1: ACTIVE, 2: DOWN})
    answer = PyverbsBackend(module).query()
    assert isinstance(answer, VerbsReport)
    (dev,) = answer.devices
    up, down = dev.ports
    assert (up.state, up.active_mtu_bytes, up.lanes, up.rate_gbps, up.link_layer) == (
        "ACTIVE", 4096, 4, 200.0, "Ethernet")
    assert (down.state, down.active_mtu_bytes) == ("DOWN", 1024)
    assert [(g.index, g.type) for g in up.gids] == [(0, "RoCE v2")]
    assert all(ctx.closed for ctx in module.contexts)
    assert verbs_from_dict(verbs_to_dict(answer)) == answer
