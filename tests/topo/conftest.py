"""Helpers for topo tests: a topology straight from a fixture-built tree."""

from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.probe.nvml import NvmlReport, RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.build import discover
from kvctl.topo.model import Topology
from tests.fixtures.sysfs import HostSpec

NvmlAnswer = NvmlReport | Unavailable


@pytest.fixture
def topology_of(sysfs_tree: Callable[[HostSpec], Path]) -> Callable[..., Topology]:
    """``topology_of(h100_host())`` → the Topology of a fresh tree (no NVML, no verbs);
    ``topology_of(spec, nvml=report)`` replays that NVML answer."""

    def make(spec: HostSpec, *, nvml: NvmlAnswer | None = None) -> Topology:
        root = sysfs_tree(spec)
        return discover(
            SysfsReader(root),
            RecordedNvml(nvml if nvml is not None else Unavailable("nvml", "test: no NVML")),
            RecordedVerbs(Unavailable("verbs", "test: no verbs")),
        )

    return make

