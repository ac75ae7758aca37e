"""Jobs reach agents through etcd's watch, not at the next poll (namespaced hosts)."""

from __future__ import annotations

from tests.cluster.conftest import MakeCluster
from tests.cluster.dispatch import post_jobs, start_agent, summary


def test_a_job_reaches_its_agent_well_under_the_poll_interval(ns_cluster: MakeCluster
                                                                ) -> None:
    cluster = ns_cluster(2, agents=[])
    start_agent(cluster, 1, "5s")  # a poll would take 2.5 s on average
    rows = post_jobs(cluster, 0, 1, 12)
    assert all(r["ok"] for r in rows), rows
    status = summary([r["status_ms"] for r in rows])
    trips = summary([r["round_trip_ms"] for r in rows])
    assert status["median"] < 250, status  # measured: 5 ms median on an idle machine
    assert trips["max"] < 1500, trips
