"""NIC ranking per location, and the exports built on it (Mooncake, env)."""

from collections.abc import Callable

import pytest

from kvctl.errors import NotFoundError, UnavailableError, UsageError
from kvctl.topo.export import env_lines, mooncake_topology
from kvctl.topo.model import NicKind, Topology
from kvctl.topo.rank import best_nics, preferred_nics
from tests.fixtures.sysfs import (
    Bridge,
    Gpu,
    HostSpec,
    Port,
    Rdma,
    Switch,
    a100_host,
    h100_host,
    roce_port,
    workstation_host,
)

Make = Callable[[HostSpec], Topology]


def _h100_with_down_port(nic: int) -> HostSpec:
    spec = h100_host()
    switch = spec.bridges[1 + nic // 2].ports[nic % 2]
    assert isinstance(switch, Switch)
    rdma = switch.children[1]
    assert isinstance(rdma, Rdma)
    rdma.ports = [Port(state="1: DOWN", phys="3: Disabled")]
    return spec


def test_h100_ranking_class_then_numa_then_rate(topology_of: Make) -> None:
    t = topology_of(h100_host())
    assert preferred_nics(t, "cuda:0") == [
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "eno1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert preferred_nics(t, "cuda:0", kind=NicKind.RDMA)[-1] == "mlx5_7"
    assert "eno1" not in preferred_nics(t, "cuda:5", kind=NicKind.RDMA)
    assert preferred_nics(t, "cpu:1")[:4] == ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert best_nics(t, "cuda:6") == ["mlx5_6"]
    assert best_nics(t, "cpu:0") == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


def test_down_port_is_listed_but_never_preferred(topology_of: Make) -> None:
    t = topology_of(_h100_with_down_port(0))
    ranked = preferred_nics(t, "cuda:0")
    assert ranked[0] == "mlx5_1"
    assert ranked[-1] == "mlx5_0"
    assert best_nics(t, "cuda:0") == ["mlx5_1"]
    preferred, available = mooncake_topology(t)["cuda:0"]
    assert "mlx5_0" not in preferred + available


def test_rate_breaks_ties(topology_of: Make) -> None:
    spec = HostSpec(numa={0: "0-3"}, bridges=[Bridge(numa=0, bus=0, ports=[Switch([
        Gpu(), Rdma("mlx5_0", [Port(rate="100 Gb/sec (4X EDR)")]),
        Rdma("mlx5_1", [Port(rate="400 Gb/sec (4X NDR)")])])])])
    t = topology_of(spec)
    assert preferred_nics(t, "cuda:0") == ["mlx5_1", "mlx5_0"]
    assert best_nics(t, "cuda:0") == ["mlx5_1"]


def test_bad_locations(topology_of: Make) -> None:
    t = topology_of(workstation_host())
    with pytest.raises(UsageError):
        preferred_nics(t, "gpu0")
    with pytest.raises(NotFoundError, match="cuda:3"):
        preferred_nics(t, "cuda:3")
    with pytest.raises(NotFoundError):
        preferred_nics(t, "cpu:7")


def test_mooncake_format(topology_of: Make) -> None:
    topo = mooncake_topology(topology_of(h100_host()))
    assert set(topo) == {f"cuda:{i}" for i in range(8)} | {"cpu:0", "cpu:1"}
    assert topo["cuda:0"] == [["mlx5_0"], ["mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5",
                                           "mlx5_6", "mlx5_7"]]
    assert topo["cpu:1"] == [["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"],
                             ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]]
    assert all(len(v) == 2 for v in topo.values())
    with pytest.raises(UnavailableError, match="no RDMA device") as err:
        mooncake_topology(topology_of(workstation_host()))
    assert err.value.exit_code == 3
    assert "MC_CUSTOM_TOPO_JSON" in (err.value.hint or "")


def test_env_blocks(topology_of: Make) -> None:
    h100 = "\n".join(env_lines(topology_of(h100_host())))
    assert "# GPU3 (cuda:3, " in h100
    gpu3 = h100.split("# GPU3")[1].split("\n\n")[0]
    assert "export NCCL_IB_HCA==mlx5_3:1" in gpu3
    assert "export UCX_NET_DEVICES=mlx5_3:1" in gpu3
    assert "export MOONCAKE_DEVICE=mlx5_3" in gpu3
    a100 = "\n".join(env_lines(topology_of(a100_host())))
    gpu0 = a100.split("# GPU0")[1].split("\n\n")[0]
    assert "export MOONCAKE_DEVICE=mlx5_0,mlx5_1,mlx5_2" in gpu0
    assert "export MC_GID_INDEX=3" in gpu0  # the IPv4-mapped RoCE v2 entry
    ws = "\n".join(env_lines(topology_of(workstation_host())))
    assert "export NCCL_SOCKET_IFNAME=enp5s0" in ws


def test_gid_index_absent_without_v2(topology_of: Make) -> None:
    spec = HostSpec(numa={0: "0-3"}, bridges=[Bridge(numa=0, bus=0, ports=[Switch([
        Gpu(), Rdma("mlx5_0", [roce_port("ens1", v2=False)])])])])
    text = "\n".join(env_lines(topology_of(spec)))
    assert "MOONCAKE_DEVICE=mlx5_0" in text
    assert "MC_GID_INDEX" not in text
