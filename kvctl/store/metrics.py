"""The store master's Prometheus metrics (``kvctl store serve|master --metrics-port``).

Request counts and latencies are recorded per message (:func:`count_request`): a get's
outcome says whether it found its keys (hit, miss, evicted), bytes are the objects' payload
sizes (the bytes move between clients and nodes, the master only places them), and a node's
heartbeat, a long poll, is timed apart from the requests. Capacity, usage, objects per tier,
nodes by state, evictions, the state backend's backlog and the master's own pauses are read
at scrape time, from counters kept as things change (a scrape costs O(nodes), whatever the
number of objects). ``docs/metrics.md`` lists them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvctl.metrics import EVICTED, HIT, MISS, OK, ServerMetrics
from kvctl.store import protocol as p
from kvctl.store.master import MasterCore

if TYPE_CHECKING:
    from kvctl.store.node import StorageNode

NAMESPACE = "kvctl_store"
#: A storage node's own metrics (its data path, SSD tasks), beside or apart from the master's.
NODE_NAMESPACE = "kvctl_node"
#: What a key of a get slot that is still being written counts as.
PENDING = "pending"
_KEY_OUTCOMES = {"not_found": MISS, "evicted": EVICTED}
#: Precedence of a batch get's outcome: the first of these that any key had.
_GET_PRECEDENCE = (EVICTED, MISS, PENDING)


def op_name(msg: p.Request) -> str:
    """The operation a request counts as: puts a client placed in its reservation count as
    puts (the master takes them then), the reservation's own messages as ``reserve``."""
    if isinstance(msg, p.PutAt):
        return "put" if msg.keys else "reserve"
    return type(msg).__name__.lower()


def count_request(metrics: ServerMetrics, msg: p.Request, reply: p.Reply | None,
                  seconds: float) -> None:
    """Count one request the master answered with ``reply`` after ``seconds``.

    Outcomes: an error reply's code; for a get ``hit`` (every key found), else ``evicted``,
    ``miss`` or ``pending`` (the first that any key had), each key also counted in
    ``kvctl_store_get_keys_total``; a put whose keys were not all placed, the first
    failing key's code; an aborted commit ``aborted``; else ``ok``. Bytes: a get's found
    objects out, a put's placed objects in (payload sizes, not message sizes).
    """
    op = op_name(msg)
    if isinstance(msg, p.Heartbeat) and msg.wait_s > 0:
        metrics.record_poll(op, seconds, reply.error.code if isinstance(reply, p.Fail) else OK)
        return
    outcome, bytes_in, bytes_out = OK, 0, 0
    if isinstance(reply, p.Fail):
        outcome = reply.error.code
    elif isinstance(reply, p.GetReply):
        outcome, bytes_out = _count_get(metrics, reply)
    elif isinstance(reply, p.PutReply) and isinstance(msg, p.Put):
        for item, slot in zip(msg.items, reply.slots, strict=False):
            if isinstance(slot, p.ErrorInfo):
                outcome = slot.code if outcome == OK else outcome
            elif not slot.skip:
                bytes_in += item.size
    elif isinstance(msg, p.PutAt):
        bytes_in = sum(msg.sizes)
    elif isinstance(msg, p.Commit) and not msg.ok:
        outcome = "aborted"
    metrics.record(op, seconds, outcome, bytes_in=bytes_in, bytes_out=bytes_out)


def _get_keys(metrics: ServerMetrics) -> Any:
    return metrics.counter("get_keys", "Keys looked up by gets, by outcome (hit, miss, "
                           "evicted, pending, or an error code).", ("outcome",))


def _count_get(metrics: ServerMetrics, reply: p.GetReply) -> tuple[str, int]:
    keys = _get_keys(metrics)
    seen: dict[str, int] = {}
    size = 0
    for slot in reply.slots:
        if isinstance(slot, p.ErrorInfo):
            key_outcome = _KEY_OUTCOMES.get(slot.code, slot.code)
        elif slot.pending:
            key_outcome = PENDING
        else:
            key_outcome = HIT
            size += slot.size
        seen[key_outcome] = seen.get(key_outcome, 0) + 1
    for key_outcome, count in seen.items():
        metrics.child(keys, key_outcome).inc(count)
    for outcome in _GET_PRECEDENCE:
        if outcome in seen:
            return outcome, size
    errors = set(seen) - {HIT}
    return (min(errors) if errors else (HIT if seen else OK)), size


def master_metrics(core: MasterCore) -> ServerMetrics:
    """Metrics for a master: register them before serving, pass to the server."""
    metrics = ServerMetrics(NAMESPACE)
    _get_keys(metrics)  # exported (empty) before the first get
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


def node_metrics(*, share: ServerMetrics | None = None) -> ServerMetrics:
    """Metrics for a storage node (``kvctl_node_*``): its data path's reads and writes (the
    node's transfer target counts them; copies a same-host client makes through the shared
    mapping never reach it) and its SSD tasks. ``share``: export through the master's
    endpoint (``kvctl store serve``)."""
    return ServerMetrics(NODE_NAMESPACE, share=share)


def watch_node(metrics: ServerMetrics, node: StorageNode) -> None:
    """Gauges read from ``node`` at scrape time: its DRAM and SSD capacity."""
    metrics.gauge("capacity_bytes", "DRAM this node contributes, bytes.",
                  lambda: float(node.capacity_bytes))
    metrics.gauge("ssd_capacity_bytes", "Most bytes this node keeps on SSD (0: no SSD tier).",
                  lambda: float(node.ssd_capacity_bytes))
