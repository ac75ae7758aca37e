"""Helpers for topo tests: a topology straight from a fixture-built tree."""

from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.probe.nvml import RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.build import discover
from kvctl.topo.model import Topology
from tests.fixtures.sysfs import HostSpec


@pytest.fixture
def topology_of(sysfs_tree: Callable[[HostSpec], Path]) -> Callable[[HostSpec], Topology]:
    """``topology_of(h100_host())`` → the Topology of a fresh tree (no NVML, no verbs)."""

    def make(spec: HostSpec) -> Topology:
        root = sysfs_tree(spec)
        return discover(
            SysfsReader(root),
            RecordedNvml(Unavailable("nvml", "test: no NVML")),
            RecordedVerbs(Unavailable("verbs", "test: no verbs")),
        )

    return make
