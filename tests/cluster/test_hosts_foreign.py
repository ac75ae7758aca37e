"""A foreign engine in the cluster path: ``cluster bench --engine kvctl --engine mooncake``
on two namespaced hosts runs Mooncake's transfer engine (through kvctl's foreign driver)
between the agents, verified, beside kvctl's own."""

from __future__ import annotations

import pytest

from kvctl.bench.engines import driver_class
from tests.cluster.conftest import MakeCluster
from tests.cluster.nscluster import SWEEP, bench_json

pytestmark = pytest.mark.integration


def test_mooncake_runs_between_two_agents(ns_cluster: MakeCluster) -> None:
    reason = driver_class("mooncake").unavailable_reason()
    if reason is not None:
        pytest.skip(f"mooncake unavailable: {reason}")
    two = ns_cluster(2)
    doc = bench_json(two.kvctl(0, ["cluster", "bench", *SWEEP, "--engine", "kvctl",
                                   "--engine", "mooncake", "--json"]))
    assert doc["engines"] == ["kvctl", "mooncake"], doc["stderr"][-2000:]
    (pair,) = doc["pairs"]
    assert pair["state"] == "ok", pair
    rows = pair["rows"]
    assert {(r["engine"], r["op"]) for r in rows} == {
        (e, op) for e in ("kvctl", "mooncake") for op in ("read", "write")}, rows
    for row in rows:
        assert row["errors"] == 0, row
        assert row["verified"] is True, row
        assert row["gbytes_per_s"] > 0, row
