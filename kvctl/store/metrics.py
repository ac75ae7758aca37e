"""The store master's Prometheus metrics (``kvctl store serve|master --metrics-port``).

Request counts and latencies are recorded per message; capacity, usage, objects per tier,
nodes by state, evictions, tier moves, the state backend's backlog and the master's own
pauses are read at scrape time, from counters kept as things change (a scrape costs
O(nodes), whatever the number of objects).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvctl.metrics import ServerMetrics
from kvctl.store.master import MasterCore

NAMESPACE = "kvctl_store"


def master_metrics(core: MasterCore) -> ServerMetrics:
    """Metrics for a master: register them before serving, pass to the server."""
    metrics = ServerMetrics(NAMESPACE)
    fam = metrics.families

    def collect() -> Iterable[Any]:
        status = core.status()
        gauge = fam.GaugeMetricFamily
        counter = fam.CounterMetricFamily
        yield gauge(f"{NAMESPACE}_capacity_bytes", "DRAM capacity of live nodes, bytes.",
                    value=status.capacity_bytes)
        yield gauge(f"{NAMESPACE}_used_bytes", "DRAM used on live nodes, bytes.",
                    value=status.used_bytes)
        nodes = gauge(f"{NAMESPACE}_nodes", "Registered storage nodes by liveness.",
                      labels=["alive"])
        alive = sum(1 for n in status.nodes if n.alive)
        nodes.add_metric(["true"], alive)
        nodes.add_metric(["false"], len(status.nodes) - alive)
        yield nodes
        objects = gauge(f"{NAMESPACE}_objects", "Committed objects by tier.", labels=["tier"])
        for tier, count in status.tiers.items():
            objects.add_metric([tier], count)
        yield objects
        evictions = counter(f"{NAMESPACE}_evictions", "Evictions by tier (dram: a DRAM "
                            "replica dropped or moved to SSD; ssd: an SSD copy dropped).",
                            labels=["tier"])
        evictions.add_metric(["dram"], status.evictions)
        evictions.add_metric(["ssd"], status.ssd_evictions)
        yield evictions
        yield counter(f"{NAMESPACE}_lost_objects", "Objects lost with their last replica.",
                      value=status.lost)
        states = gauge(f"{NAMESPACE}_node_states", "Registered storage nodes by state "
                       "(alive; suspect: silent past the node timeout, objects kept; "
                       "restored: not registered again since a master restart).",
                       labels=["state"])
        for state in ("alive", "suspect", "restored"):
            states.add_metric([state], sum(1 for n in status.nodes if n.state == state))
        yield states
        yield gauge(f"{NAMESPACE}_state_backlog", "Changes taken but not yet durable in the "
                    "master's state (journal or etcd).", value=core.state.backlog)
        yield counter(f"{NAMESPACE}_master_paused_seconds", "The master's own pauses (GC, "
                      "stops, a busy lock) not counted against its nodes' heartbeats, "
                      "seconds.", value=core.paused_s)
        used = gauge(f"{NAMESPACE}_node_used_bytes", "DRAM used per node, bytes.",
                     labels=["node", "tier"])
        for n in status.nodes:
            used.add_metric([n.node_id, "dram"], n.used_bytes)
            used.add_metric([n.node_id, "ssd"], n.ssd_used_bytes)
        yield used

    metrics.add_collector(collect)
    return metrics
