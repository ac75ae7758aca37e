"""Measured baselines and which one applies to which path."""

from pathlib import Path

import pytest

from kvctl.bench import linerate
from kvctl.bench.linerate import (
    LineRate,
    LineRates,
    Shape,
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


def test_memcpy_and_tcp_loopback_measure_the_rows_shape() -> None:
    shape = Shape(4096, 8)
    memcpy = measure_memcpy(shape, rounds=2, round_s=0.01)
    assert memcpy.gbytes_per_s > 0.05
    assert memcpy.source == "memcpy 4 KiB x8"
    two = measure_memcpy(Shape(4096, 8, threads=2), rounds=1, round_s=0.01)
    assert two.source == "memcpy 4 KiB x8, 2 threads"
    tcp = measure_tcp_loopback(Shape(65536, 4), streams=2, rounds=2, round_s=0.01)
    assert tcp.gbytes_per_s > 0.01
    assert tcp.source == "tcp-loopback 64 KiB x4, 2 streams"
    assert tcp.gbits_per_s == tcp.gbytes_per_s * 8
    # a batch that does not divide over the streams, and one bigger than the buffers
    odd = measure_tcp_loopback(Shape(1000, 3), streams=4, rounds=1, round_s=0.01)
    assert odd.gbytes_per_s > 0


def test_a_batch_larger_than_the_buffers_reuses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linerate, "MAX_BUFFER_BYTES", 64 << 10)
    monkeypatch.setattr(linerate, "MAX_TCP_BUFFER_BYTES", 16 << 10)
    shape = Shape(64 << 10, 4)  # 256 KiB per batch
    assert measure_memcpy(shape, rounds=1, round_s=0.01).gbytes_per_s > 0
    assert measure_tcp_loopback(shape, streams=2, rounds=1, round_s=0.01).gbytes_per_s > 0


def test_path_kinds_and_one_baseline_per_shape() -> None:
    rates = LineRates()
    small, large = Shape(4096, 8), Shape(65536, 8)
    nic = LineRate(25.0, "nic mlx5_0 (200 Gbit/s)")
    assert rates.for_path("rdma", loopback=False, shape=small, nic_rate=nic) is nic
    assert rates.for_path("tcp", loopback=False, shape=small, nic_rate=None) is None
    assert rates.for_path("ucx", loopback=True, shape=small) is None  # engine chose: unknown
    shm = rates.for_path("shm", loopback=True, shape=small)
    assert shm is not None
    assert shm.source == "memcpy 4 KiB x8"
    assert rates.for_path("shm", loopback=True, shape=small) is shm  # the other op reuses it
    other = rates.for_path("shm", loopback=True, shape=large)
    assert other is not None
    assert other.source == "memcpy 64 KiB x8"  # another shape is measured on its own
    tcp = rates.for_path("tcp", loopback=True, shape=small)
    assert tcp is not None
    assert tcp.source.startswith("tcp-loopback 4 KiB x8")


def test_a_beaten_baseline_is_measured_once_more_and_the_better_kept() -> None:
    rates = LineRates()
    shape = Shape(4096, 8)
    readings = iter([1.0, 1.5, 9.0])
    calls: list[float] = []

    def measure() -> LineRate:
        value = next(readings)
        calls.append(value)
        return LineRate(value, "memcpy 4 KiB x8")

    first = rates.measured("memcpy", shape, measure, beaten_by=0.5)
    assert (first.gbytes_per_s, calls) == (1.0, [1.0])
    again = rates.measured("memcpy", shape, measure, beaten_by=2.0)
    assert again.gbytes_per_s == 1.5
    assert again.source == "memcpy 4 KiB x8 (re-measured)"
    still = rates.measured("memcpy", shape, measure, beaten_by=2.0)
    assert still is again  # at most one re-measurement per shape
    assert calls == [1.0, 1.5]


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
