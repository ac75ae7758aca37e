"""The store master's Prometheus metrics (``kvctl store serve|master --metrics-port``).

Request counts and latencies are recorded per message (:func:`count_request`): a get's
outcome says whether it found its keys (hit, miss, evicted), bytes are the objects' payload
sizes (the bytes move between clients and nodes, the master only places them), and a node's
heartbeat, a long poll, is timed apart from the requests. Capacity, usage, objects per tier,
nodes by state, evictions, the state backend's backlog, the master's own pauses and, with a
shared tier, what ``kvctl store status`` shows of it (usage and quotas, purge backlog,
writes, errors by errno, write-through queues) are read at scrape time, from counters kept
as things change (a scrape costs O(nodes), whatever the number of objects).
``docs/metrics.md`` lists them all.
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
        with core._lock:  # one snapshot: the status and the tier's write-through queues
            status = core.status()
            queued = _write_through_queued(core)
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
            if tier != "shared" or status.shared is not None:  # no tier, no tier series
                objects.add_metric([tier], count)
        if status.shared is not None and "shared" not in status.tiers:  # an older master
            # the index counts DRAM and SSD copies; the rest have only a shared-tier file
            objects.add_metric(["shared"], max(0, status.objects - sum(status.tiers.values())))
        yield objects
        evictions = counter(f"{NAMESPACE}_evictions", "Evictions by tier (dram: a DRAM "
                            "replica dropped or moved to SSD; ssd: an SSD copy dropped).",
                            labels=["tier"])
        evictions.add_metric(["dram"], status.evictions)
        evictions.add_metric(["ssd"], status.ssd_evictions)
        if status.shared is not None:
            evictions.add_metric(["shared"], status.shared.evictions)
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
        if status.shared is not None and queued is not None:
            yield from _shared_tier(fam, status.shared, queued)

    metrics.add_collector(collect)
    return metrics


def _write_through_queued(core: MasterCore) -> tuple[int, int, int] | None:
    """The shared tier's write-through copies queued or running on nodes (count, bytes)
    and those skipped so far because a node's queue was full; ``None`` without a tier
    (the master's lock held: the tier's tables are read as they are)."""
    st = core._shared
    if st is None:
        return None
    return (sum(count for count, _ in st.queued.values()),
            sum(nbytes for _, nbytes in st.queued.values()), st.skipped)


#: ``kvctl_store_shared_tier_*`` read from :class:`~kvctl.store.protocol.SharedTierStatus`:
#: its field -> (metric, ``gauge`` or ``counter``, help). The tier's other fields: ``errors``
#: (``errors_total{errno}``), ``state`` (``full``), ``evictions``
#: (``kvctl_store_evictions_total{tier="shared"}``), and the text ``root``, ``policy``,
#: ``last_error`` (:data:`SHARED_TIER_TEXT`).
SHARED_TIER_NUMBERS: dict[str, tuple[str, str, str]] = {
    "used_bytes": ("used_bytes", "gauge", "Bytes of files in the shared tier (headers "
                   "included)."),
    "capacity_bytes": ("capacity_bytes", "gauge", "The shared tier's quota in bytes "
                       "(--shared-tier-capacity); least recently used copies are evicted "
                       "past it."),
    "files": ("files", "gauge", "Files in the shared tier (one per object copy, or per pack "
              "of copies)."),
    "max_files": ("max_files", "gauge", "The shared tier's quota in files "
                  "(--shared-tier-files)."),
    "purge_backlog": ("purge_backlog", "gauge", "Shared-tier files waiting to be deleted "
                      "(evicted, removed, replaced or found orphaned)."),
    "writes": ("writes", "counter", "Files written to the shared tier (renamed into "
               "place)."),
    "write_errors": ("write_errors", "counter", "Shared-tier writes that failed."),
    "purged": ("purged", "counter", "Shared-tier files deleted (evicted, removed, replaced, "
               "orphaned)."),
    "reports": ("reports", "counter", "Shared-tier files clients reported bad (the master "
                "checks each itself)."),
    "reports_dropped": ("reports_dropped", "counter", "Bad-file reports not taken (the check "
                        "queue was full, or the file was queued or verified good lately)."),
    "bad_files": ("bad_files", "counter", "Reported shared-tier files the master found bad "
                  "itself and dropped from the index."),
    "fs_free_bytes": ("fs_free_bytes", "gauge", "Free bytes of the file system under the "
                      "shared tier (statvfs, every 5 s)."),
    "fs_total_bytes": ("fs_size_bytes", "gauge", "Size of the file system under the shared "
                       "tier (statvfs, every 5 s)."),
    "pack_below": ("pack_below_bytes", "gauge", "Objects smaller than this are written "
                   "several to a pack file (--shared-tier-pack-below; 0: off)."),
    "packs": ("packs", "gauge", "Pack files in the shared tier (counted in files)."),
    "packed_objects": ("packed_objects", "gauge", "Object copies held as records of pack "
                       "files."),
}
SHARED_TIER_TEXT = ("root", "policy", "last_error")
#: statvfs figures: -1 (not exported) until the housekeeping's first statvfs.
_FS_FIELDS = ("fs_free_bytes", "fs_total_bytes")


def _shared_tier(fam: Any, sh: p.SharedTierStatus, queued: tuple[int, int, int]
                 ) -> Iterable[Any]:
    """``kvctl_store_shared_tier_*``: what ``kvctl store status`` shows of the tier, and
    its write-through queues (exported only by a master with a shared tier)."""
    from kvctl.store.sharedtier.fileformat import COUNTED_ERRNOS

    gauge, counter = fam.GaugeMetricFamily, fam.CounterMetricFamily
    ns = f"{NAMESPACE}_shared_tier"
    for field, (name, kind, text) in SHARED_TIER_NUMBERS.items():
        value = getattr(sh, field)
        if field in _FS_FIELDS and value < 0:
            continue
        yield (gauge if kind == "gauge" else counter)(f"{ns}_{name}", text, value=value)
    yield gauge(f"{ns}_full", "1 while shared-tier writes are paused because the file "
                "system refused one for lack of space, else 0.",
                value=1 if sh.state == "full" else 0)
    yield gauge(f"{ns}_write_through_queued", "Write-through copies queued or running on "
                "the nodes.", value=queued[0])
    yield gauge(f"{ns}_write_through_queued_bytes", "Bytes of the write-through copies "
                "queued or running on the nodes.", value=queued[1])
    yield counter(f"{ns}_write_through_skipped", "Write-through copies skipped because the "
                  "node's queue was full (the object is copied on eviction instead).",
                  value=queued[2])
    errors = counter(f"{ns}_errors", "Shared-tier file-system failures (writes, deletes, "
                     "the purge sweep) by errno name.", labels=["errno"])
    for name in dict.fromkeys((*COUNTED_ERRNOS, "other", *sh.errors)):
        errors.add_metric([name], sh.errors.get(name, 0))
    yield errors


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
