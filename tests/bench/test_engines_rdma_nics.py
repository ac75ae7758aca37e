"""The foreign engines get their RDMA NICs from kvctl topo's ranking (issue 16): Mooncake's
``device_name``, NIXL's ``UCX_NET_DEVICES``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.bench.engines.mooncake import device_filter
from kvctl.bench.engines.nixl import _ucx_settings
from kvctl.topo.recorded import load_recorded
from kvctl.transfer.transports.rdma.devices import best_rdma_ports

H100 = Path(__file__).resolve().parents[2] / "examples" / "hosts" / "h100-8gpu.tar.gz"


def test_topo_ranks_the_nics_of_each_location() -> None:
    topology = load_recorded(H100)
    assert best_rdma_ports(topology, "cuda:0") == ["mlx5_0:1"]
    assert best_rdma_ports(topology, "cpu:1") == ["mlx5_4:1", "mlx5_5:1", "mlx5_6:1",
                                                  "mlx5_7:1"]


def test_mooncake_device_name() -> None:
    ranked = ["mlx5_0:1", "mlx5_1:1"]
    assert device_filter("rdma", {}, ranked) == "mlx5_0,mlx5_1"
    assert device_filter("auto", {}, ranked) == "mlx5_0,mlx5_1"
    assert device_filter("tcp", {}, ranked) == ""
    assert device_filter("rdma", {"MOONCAKE_DEVICE": "mlx5_7"}, ranked) == "mlx5_7"
    assert device_filter("rdma", {}, []) == ""  # Mooncake's own discovery


def test_nixl_ucx_net_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    cross = _ucx_settings(None, "192.0.2.10", rdma_ports=["mlx5_0:1"])
    assert cross["UCX_NET_DEVICES"] == "mlx5_0:1"  # 192.0.2.10 is no local interface
    assert "UCX_NET_DEVICES" not in _ucx_settings("tcp", "192.0.2.10", rdma_ports=["mlx5_0:1"])
    assert "UCX_NET_DEVICES" not in _ucx_settings(None, "127.0.0.1", rdma_ports=["mlx5_0:1"])
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_3:1")
    assert "UCX_NET_DEVICES" not in _ucx_settings(None, "192.0.2.10", rdma_ports=["mlx5_0:1"])
