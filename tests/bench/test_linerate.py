"""Measured baselines and which one applies to which path."""

from pathlib import Path

from kvctl.bench.linerate import (
    LineRate,
    LineRates,
    measure_memcpy,
    measure_tcp_loopback,
    nic_line_rate,
)
from kvctl.bench.session import nic_rates_for
from kvctl.probe.nvml import RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.build import discover
from kvctl.topo.model import NicKind, Topology
from kvctl.topo.rank import preferred_nics
from tests.fixtures.sysfs import build_sysfs, h100_host


def test_memcpy_and_tcp_loopback_measure_something() -> None:
    memcpy = measure_memcpy(8 << 20, 0.05)
    assert memcpy.gbytes_per_s > 0.05
    assert memcpy.source == "memcpy"
    tcp = measure_tcp_loopback(0.05, streams=2, chunk_bytes=1 << 20)
    assert tcp.gbytes_per_s > 0.01
    assert tcp.source == "tcp-loopback x2"
    assert tcp.gbits_per_s == tcp.gbytes_per_s * 8


def test_path_kinds() -> None:
    rates = LineRates()
    nic = LineRate(25.0, "nic mlx5_0 (200 Gbit/s)")
    assert rates.for_path("rdma", loopback=False, nic_rate=nic) is nic
    assert rates.for_path("tcp", loopback=False, nic_rate=None) is None
    assert rates.for_path("ucx", loopback=True) is None  # engine chose: unknown
    shm = rates.for_path("shm", loopback=True)
    assert shm is not None
    assert shm.source == "memcpy"
    assert rates.for_path("shm", loopback=True) is shm  # cached per process


def _topology(tmp_path: Path) -> Topology:
    root = build_sysfs(tmp_path / "host", h100_host())
    return discover(SysfsReader(root), RecordedNvml(Unavailable("nvml", "test")),
                    RecordedVerbs(Unavailable("verbs", "test")))


def test_nic_line_rate_from_topology(tmp_path: Path) -> None:
    topology = _topology(tmp_path)
    best = preferred_nics(topology, "cuda:0", kind=NicKind.RDMA)[0]
    nic = topology.nic(best)
    assert nic is not None
    assert nic.rate_gbps
    rate = nic_line_rate(topology, "cuda:0", rdma_only=True)
    assert rate is not None
    assert rate.gbytes_per_s == nic.rate_gbps / 8  # port Gbit/s -> GB/s
    assert rate.source == f"nic {best} ({nic.rate_gbps:g} Gbit/s port)"
    rates = nic_rates_for("cpu:1", topology)
    assert set(rates) == {"rdma", "tcp"}
    assert nic_rates_for("cpu:0", None) == {}
