"""``store smoke``'s failover check hands the next check a settled store (issue 30): it
stopped a node and the eviction check, started at once, placed objects on it before the
master marked it suspect, so its reads failed ("its copies are on nodes not answering
heartbeats: smoke-b (suspect)") on a loaded machine."""

from __future__ import annotations

from kvctl.store.client import StoreClient
from kvctl.store.smoke import _EmbeddedCluster, _eviction, _failover, _Run


def test_failover_drops_the_stopped_node_before_the_next_check() -> None:
    cluster = _EmbeddedCluster()
    try:
        with StoreClient(cluster.address) as client:
            run = _Run(client, new_client=lambda: StoreClient(cluster.address),
                       prefix="failover-state-test/", progress=None)
            run.check("failover", lambda: _failover(
                run, client, cluster.stop_node,
                lambda: StoreClient(cluster.address, replicas=2)))
            # at once: no wait for the node timeout, which a loaded machine stretches
            states = {n.node_id: n.alive for n in client.status().nodes}
            run.check("eviction", lambda: _eviction(run, client))
            client.batch_remove(sorted(run.keys))
    finally:
        cluster.close()
    failover, eviction = run.checks
    assert failover.status == "pass", failover
    assert failover.detail.endswith("then dropped it"), failover.detail
    assert list(states.values()) == [True]  # the victim is gone: no placement goes there
    (victim,) = {"smoke-a", "smoke-b"} - set(states)
    assert f"after stopping {victim}" in failover.detail
    assert eviction.status == "pass", eviction
