"""The store master: object metadata, placement, allocation, leases, eviction, liveness.

:class:`MasterCore` is the whole policy with no I/O of its own besides its
:class:`~kvctl.store.state.StateBackend`: the listener (:mod:`kvctl.store.server`) calls it,
tests call it directly with a fake clock. The master never touches object bytes: it hands
out locations (node segment + offset), and it hands nodes *tasks* (persist to SSD, load
from SSD, drop an SSD copy) through their heartbeat long-poll.

Rules kept here (and checked by tests/store/test_master_props.py):

- Allocations on a node never overlap and never exceed its capacity.
- A put is *pending* until committed: pending objects are not evictable; a pending put that
  is never committed is released after ``pending_ttl_s``.
- A *reservation* is space a client places its own puts in (one round trip per put instead
  of two): at most ``reservation_share`` of a node, on ``replicas`` distinct nodes, never
  evicted; objects the client reports inside it (:class:`~kvctl.store.protocol.PutAt`) must
  lie in still-unused parts of it; the rest is given back when the client ends it or after
  ``pending_ttl_s`` without use.
- A get grants a lease of ``lease_ttl_s``: a leased or pinned object is never evicted, and
  its space is not reused before the lease ends even if it is removed or overwritten.
- When a node's usage passes ``high_watermark`` of its capacity, least recently used
  objects are evicted until usage is at most ``high_watermark - evict_ratio``; an allocation
  that does not fit evicts what it needs.
- A node silent for ``node_timeout_s`` is dead: its replicas are dropped, objects with
  replicas elsewhere stay readable, objects with none left are lost.
- A node whose SSD refused a write for lack of space is marked ``full``: no offload to it
  (write-through copies are skipped, write-back evictions just free DRAM) until a retry
  after ``ssd_full_retry_s`` succeeds; its DRAM keeps serving.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import msgspec

from kvctl.cache.lru import LruIndex
from kvctl.store import protocol as p
from kvctl.store.allocator import AllocatorInvariantError, ExtentAllocator
from kvctl.store.state import NodeRecord, NoState, ObjectRecord, ReplicaRecord, StateBackend

_log = logging.getLogger("kvctl.store.master")

SSD_POLICIES = ("off", "write-through", "write-back")
#: Smallest reservation worth granting (less is refused: put through the master instead).
MIN_RESERVATION_BYTES = 64 << 10
#: How many evicted keys the master remembers, to answer "evicted" instead of "not found".
EVICTED_MEMORY = 65536


@dataclasses.dataclass(frozen=True)
class MasterConfig:
    """Master policy knobs.

    Attributes:
        high_watermark: fraction of a node's capacity above which eviction starts.
        evict_ratio: eviction brings usage down to ``high_watermark - evict_ratio``.
        lease_ttl_s: how long a get protects an object from eviction and reuse, seconds.
        node_timeout_s: heartbeat silence after which a node is declared dead, seconds.
        pending_ttl_s: how long an uncommitted put holds its space, seconds.
        load_timeout_s: how long a get waits for a node to load an SSD copy, seconds.
        default_replicas: copies per object when a put does not say.
        ssd_full_retry_s: after a node's SSD reported "no space", how long offload to it
            pauses before one more write is tried, seconds.
        reservation_share: the largest reservation, as a fraction of a node's capacity.
        reservations_share: the most of a node's capacity all unused reservation space
            together may hold (more clients put through the master instead).
    """

    high_watermark: float = 0.95
    evict_ratio: float = 0.05
    lease_ttl_s: float = 2.0
    node_timeout_s: float = 3.0
    pending_ttl_s: float = 30.0
    load_timeout_s: float = 5.0
    default_replicas: int = 1
    ssd_full_retry_s: float = 5.0
    reservation_share: float = 1 / 16
    reservations_share: float = 1 / 4


@dataclasses.dataclass
class _Reservation:
    """Space a client places puts in; ``free`` tracks its unused parts (offsets relative to
    each replica's ``start``; the same on every replica node)."""

    rid: int
    namespace: str
    size: int
    #: node id -> start offset of this reservation's range on that node
    starts: dict[str, int]
    free: ExtentAllocator
    expires: float
    #: PutAt messages taken, and (once the client ended it) how many it sent in all.
    seen: int = 0
    expected: int = 0


@dataclasses.dataclass
class _Replica:
    node_id: str
    offset: int
    size: int


@dataclasses.dataclass
class _Object:
    key: str
    size: int
    checksum: int
    version: int
    replicas: list[_Replica]
    ssd: set[str]
    created: float
    pinned: bool = False
    lease_until: float = 0.0
    #: gets whose bytes are being read (lease ends when it drops to 0 or at lease_until).
    readers: int = 0
    pending_until: float = 0.0
    #: node id -> task id of a running write-back persist (DRAM freed when it finishes).
    evicting: dict[str, int] = dataclasses.field(default_factory=dict)
    #: node id -> task id of a running SSD → DRAM load.
    loading: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self) -> ObjectRecord:
        return ObjectRecord(
            self.key, self.size, self.checksum, self.version,
            [ReplicaRecord(r.node_id, r.offset, r.size) for r in self.replicas],
            sorted(self.ssd), self.pinned)

    @property
    def tier(self) -> str:
        if self.replicas and self.ssd:
            return "dram+ssd"
        return "dram" if self.replicas else "ssd"


@dataclasses.dataclass
class _Node:
    node_id: str
    epoch: str
    segment: str
    endpoint: str
    host_id: str
    capacity_bytes: int
    alloc: ExtentAllocator
    ssd_capacity_bytes: int
    ssd_policy: str
    last_seen: float
    descriptor: bytes = b""
    alive: bool = True
    lru: LruIndex[str] = dataclasses.field(default_factory=LruIndex)
    ssd_lru: LruIndex[str] = dataclasses.field(default_factory=LruIndex)
    tasks: deque[p.Task] = dataclasses.field(default_factory=deque)
    inflight: dict[int, p.Task] = dataclasses.field(default_factory=dict)
    #: the SSD refused a write for lack of space (cleared by the next successful persist).
    ssd_full: bool = False
    #: while ``ssd_full``: no offload before this time (then one more write is tried).
    ssd_retry_at: float = 0.0
    ssd_error: str = ""

    def offload_paused(self, now: float) -> bool:
        """Whether DRAM → SSD copies to this node are paused (full disk, retry not due)."""
        return self.ssd_full and now < self.ssd_retry_at

    @property
    def ssd_state(self) -> str:
        """``off``, ``full`` or ``ok``."""
        if self.ssd_policy == "off":
            return "off"
        return "full" if self.ssd_full else "ok"

    def address(self) -> p.NodeAddress:
        return p.NodeAddress(self.node_id, self.segment, self.endpoint, self.host_id,
                             self.descriptor)

    def record(self) -> NodeRecord:
        return NodeRecord(self.node_id, self.epoch, self.segment, self.endpoint, self.host_id,
                          self.capacity_bytes, self.ssd_capacity_bytes, self.ssd_policy)


def _leased(obj: _Object, now: float) -> bool:
    return obj.readers > 0 and obj.lease_until > now


def _err(code: str, cause: str, hint: str = "") -> p.ErrorInfo:
    return p.ErrorInfo(code=code, cause=cause, hint=hint)




class MasterCore:
    """Master state machine. Thread-safe: every method takes the one lock.

    Args:
        config: policy knobs.
        state: persistence backend (its records are replayed here on start).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, config: MasterConfig | None = None, state: StateBackend | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MasterConfig()
        if not 0 < self.config.high_watermark <= 1 or not (
                0 <= self.config.evict_ratio < self.config.high_watermark):
            raise ValueError("need 0 < high_watermark <= 1 and 0 <= evict_ratio < high_watermark")
        self.state = state or NoState()
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._objects: dict[str, _Object] = {}
        self._pending: dict[str, _Object] = {}
        self._nodes: dict[str, _Node] = {}
        self._evicted: OrderedDict[str, str] = OrderedDict()
        self._deferred: list[tuple[float, _Node, int, int]] = []
        self._reservations: dict[int, _Reservation] = {}
        #: node id -> epoch of nodes declared dead: that memory must not come back (clients
        #: may still write to locations in it), the node registers new memory instead.
        self._dropped: dict[str, str] = {}
        #: names this run of the master (sent in Hello): reservations die with it.
        self.instance = secrets.token_hex(8)
        self._reports: dict[int, p.TaskReport] = {}
        self._versions = itertools.count(1)
        self._task_ids = itertools.count(1)
        self.evictions = 0
        self.ssd_evictions = 0
        self.lost = 0
        self._restore()

    # ------------------------------------------------------------------ restore

    def _restore(self) -> None:
        loaded = self.state.load()
        now = self._clock()
        max_version = 0
        for rec in loaded.nodes:
            self._nodes[rec.node_id] = _Node(
                rec.node_id, rec.epoch, rec.segment, rec.endpoint, rec.host_id,
                rec.capacity_bytes, ExtentAllocator(rec.capacity_bytes),
                rec.ssd_capacity_bytes, rec.ssd_policy, last_seen=now, alive=False)
        for orec in loaded.objects:
            obj = _Object(orec.key, orec.size, orec.checksum, orec.version, [],
                          set(orec.ssd_replicas) & set(self._nodes), now, pinned=orec.pinned)
            max_version = max(max_version, orec.version)
            for r in orec.replicas:
                node = self._nodes.get(r.node_id)
                if node is None:
                    continue
                try:
                    node.alloc.reserve(r.offset, r.size)
                except RuntimeError:
                    _log.warning("master state: replica of %r on %s overlaps; dropped",
                                 orec.key, r.node_id)
                    continue
                obj.replicas.append(_Replica(r.node_id, r.offset, r.size))
                node.lru.add(obj.key, node.alloc.rounded(r.size))
            for nid in obj.ssd:
                self._nodes[nid].ssd_lru.add(obj.key, obj.size)
            if obj.replicas or obj.ssd:
                self._objects[obj.key] = obj
        self._versions = itertools.count(max_version + 1)
        if loaded.objects or loaded.nodes:
            _log.info("master state: restored %d objects on %d nodes (nodes must re-register "
                      "within %.1f s)", len(self._objects), len(self._nodes),
                      self.config.node_timeout_s)

    # ------------------------------------------------------------------ nodes

    def register_node(self, msg: p.RegisterNode) -> p.ErrorInfo | None:
        """Add (or re-adopt after a master restart) a storage node."""
        if msg.ssd_policy not in SSD_POLICIES:
            return _err("bad_request", f"unknown SSD policy {msg.ssd_policy!r}",
                        f"use one of {', '.join(SSD_POLICIES)}")
        if msg.capacity_bytes <= 0 or msg.ssd_capacity_bytes < 0:
            return _err("bad_request", "node capacity must be positive")
        with self._cond:
            now = self._clock()
            if self._dropped.get(msg.node_id) == msg.epoch:
                return _err("node_dropped", f"node {msg.node_id} was declared dead; its "
                            "memory may still be written by clients holding old locations",
                            "register again with new memory (a new epoch and segment)")
            old = self._nodes.get(msg.node_id)
            if old is not None and old.epoch == msg.epoch and (
                    old.capacity_bytes == msg.capacity_bytes):
                old.alive = True
                old.last_seen = now
                old.endpoint, old.segment, old.host_id = msg.endpoint, msg.segment, msg.host_id
                old.ssd_capacity_bytes, old.ssd_policy = msg.ssd_capacity_bytes, msg.ssd_policy
                old.descriptor = msg.descriptor
                self.state.put_node(old.record())
                _log.info("node %s re-registered (epoch kept: %d objects adopted)",
                          msg.node_id, len(old.lru))
                self._cond.notify_all()
                return None
            if old is not None:
                self._drop_node(old, why="restarted with new memory")
            node = _Node(msg.node_id, msg.epoch, msg.segment, msg.endpoint, msg.host_id,
                         msg.capacity_bytes, ExtentAllocator(msg.capacity_bytes),
                         msg.ssd_capacity_bytes, msg.ssd_policy, last_seen=now,
                         descriptor=msg.descriptor)
            self._nodes[msg.node_id] = node
            self.state.put_node(node.record())
            _log.info("node %s registered: %d bytes DRAM, SSD %s", msg.node_id,
                      msg.capacity_bytes, msg.ssd_policy)
            return None

    def heartbeat(self, msg: p.Heartbeat) -> list[p.Task] | p.ErrorInfo:
        """Record liveness and task reports; return new tasks (waiting up to ``wait_s``)."""
        with self._cond:
            node = self._nodes.get(msg.node_id)
            if node is None and self._dropped.get(msg.node_id) == msg.epoch:
                return _err("node_dropped", f"node {msg.node_id} was declared dead",
                            "register again with new memory (a new epoch and segment)")
            if node is None or node.epoch != msg.epoch or not node.alive:
                return _err("unknown_node", f"node {msg.node_id} is not registered",
                            "register again")
            node.last_seen = self._clock()
            for report in msg.reports:
                self._apply_report(node, report)
            if not node.tasks and msg.wait_s > 0:
                self._cond.wait_for(lambda: bool(node.tasks) or not node.alive,
                                    timeout=min(msg.wait_s, 5.0))
            tasks = list(node.tasks)
            node.tasks.clear()
            for t in tasks:
                node.inflight[t.task_id] = t
            return tasks

    def tick(self) -> None:
        """Periodic housekeeping: dead nodes, expired pending puts, deferred frees, state
        writes the backend could not make earlier."""
        with self._cond:
            self.state.sync()
            now = self._clock()
            for node in list(self._nodes.values()):
                if now - node.last_seen > self.config.node_timeout_s:
                    self._drop_node(node, why=f"no heartbeat for {now - node.last_seen:.1f} s")
                    self._dropped[node.node_id] = node.epoch
            for key, obj in list(self._pending.items()):
                if obj.pending_until <= now:
                    _log.warning("put of %r was never committed; releasing its space", key)
                    del self._pending[key]
                    self._release(obj, now)
            for res in [r for r in self._reservations.values() if r.expires <= now]:
                _log.info("reservation %x unused for %.0f s; giving its space back", res.rid,
                          self.config.pending_ttl_s)
                self._end_reservation(res)
            if self._deferred:
                keep = []
                for item in self._deferred:
                    deadline, node, offset, size = item
                    if deadline > now:
                        keep.append(item)
                    elif self._nodes.get(node.node_id) is node:
                        node.alloc.free(offset, size)
                self._deferred = keep

    def _drop_node(self, node: _Node, *, why: str) -> None:
        _log.warning("node %s dropped: %s", node.node_id, why)
        node.alive = False
        del self._nodes[node.node_id]
        self.state.delete_node(node.node_id)
        for res in list(self._reservations.values()):
            res.starts.pop(node.node_id, None)
            if not res.starts:
                del self._reservations[res.rid]
        for table in (self._objects, self._pending):
            for key, obj in list(table.items()):
                before = len(obj.replicas) + len(obj.ssd)
                obj.replicas = [r for r in obj.replicas if r.node_id != node.node_id]
                obj.ssd.discard(node.node_id)
                obj.evicting.pop(node.node_id, None)
                obj.loading.pop(node.node_id, None)
                if len(obj.replicas) + len(obj.ssd) == before:
                    continue
                if obj.replicas or obj.ssd:
                    if table is self._objects:
                        self.state.put_object(obj.record())
                    continue
                del table[key]
                if table is self._objects:
                    self.lost += 1
                    self._remember_evicted(key, f"its only node {node.node_id} died")
                    self.state.delete_object(key)
        self._cond.notify_all()

    # ------------------------------------------------------------------ put

    def put(self, msg: p.Put) -> list[p.PutSlot | p.ErrorInfo]:
        """Allocate space for each item on ``replicas`` distinct live nodes."""
        replicas = msg.replicas or self.config.default_replicas
        out: list[p.PutSlot | p.ErrorInfo] = []
        with self._cond:
            now = self._clock()
            touched: set[str] = set()
            for item in msg.items:
                out.append(self._put_one(item, replicas, now, touched))
            for nid in touched:
                node = self._nodes.get(nid)
                if node is not None:
                    self._watermark(node, now)
        return out

    def _put_one(self, item: p.PutItem, replicas: int, now: float,
                 touched: set[str]) -> p.PutSlot | p.ErrorInfo:
        bad = p.check_key(item.key)
        if bad is not None:
            return bad
        if item.size < 0 or not 0 <= item.checksum < 1 << 64:
            return _err("bad_request", f"bad size or checksum for {item.key!r}")
        if item.key in self._pending:
            return _err("busy", f"another put of {item.key!r} is in flight",
                        "retry after it commits")
        cur = self._objects.get(item.key)
        if cur is not None and cur.size == item.size and cur.checksum == item.checksum and (
                cur.replicas):
            return p.PutSlot(key=item.key, version=cur.version, locations=[], skip=True)
        if replicas < 1:
            return _err("bad_request", f"{replicas} replicas asked for {item.key!r}",
                        "ask for 1 or more replicas")
        live = [n for n in self._nodes.values() if n.alive]
        if replicas > len(live):
            return _err("unavailable",
                        f"{replicas} replica(s) asked for {item.key!r}, "
                        f"{len(live)} live node(s)",
                        "start more storage nodes or ask for fewer replicas")
        live.sort(key=lambda n: n.alloc.free_bytes, reverse=True)
        placed = self._place(live, item.size, replicas, now)
        if placed is None:
            freeing = sum(self._freeing_bytes(n) for n in live)
            if freeing:
                return _err("busy", f"no room for {item.size} bytes of {item.key!r} yet: "
                            f"{freeing} bytes are being written back to SSD to make room",
                            "retry shortly (StoreClient retries until its timeout)")
            return _err("full", f"no room for {item.size} bytes of {item.key!r} on "
                        f"{replicas} node(s) (everything left is leased, pinned or pending)",
                        "add capacity, unpin objects, or retry when leases expire")
        obj = _Object(item.key, item.size, item.checksum, next(self._versions),
                      [_Replica(n.node_id, off, item.size) for n, off in placed], set(), now,
                      pending_until=now + self.config.pending_ttl_s)
        self._pending[item.key] = obj
        touched.update(n.node_id for n, _ in placed)
        return p.PutSlot(key=item.key, version=obj.version, locations=[
            p.Location(n.node_id, n.segment, off, item.size) for n, off in placed])

    def _place(self, nodes: list[_Node], size: int, replicas: int, now: float
               ) -> list[tuple[_Node, int]] | None:
        """``size`` bytes on each of ``replicas`` of ``nodes`` (in that order, evicting as
        needed), as ``(node, offset)``; ``None`` (and nothing held) when fewer fit."""
        placed: list[tuple[_Node, int]] = []
        for node in nodes:
            if len(placed) == replicas:
                break
            offset = self._allocate(node, size, now)
            if offset is not None:
                placed.append((node, offset))
        if len(placed) < replicas:
            for node, offset in placed:
                node.alloc.free(offset, size)
            return None
        return placed

    def _freeing_bytes(self, node: _Node) -> int:
        """Bytes of DRAM replicas on ``node`` whose write-back persist will free them."""
        return sum(r.size for obj in self._objects.values() if node.node_id in obj.evicting
                   for r in obj.replicas if r.node_id == node.node_id)

    def _allocate(self, node: _Node, size: int, now: float) -> int | None:
        offset = node.alloc.allocate(size)
        if offset is not None:
            return offset
        need = node.alloc.rounded(size)
        # Evict least recent first until a contiguous extent fits: in a fragmented segment
        # free bytes alone do not make room, so keep going while anything is evictable
        # (each round evicts at least `need` bytes, so this ends).
        while True:
            victims = node.lru.victims(max(need - node.alloc.free_bytes, need),
                                       keep=lambda k: self._keep(k, now))
            if not victims:
                return None
            for key in victims:
                self._evict_replica(key, node, now)
            offset = node.alloc.allocate(size)
            if offset is not None:
                return offset
        return None

    def _keep(self, key: str, now: float) -> bool:
        obj = self._objects.get(key)
        return obj is None or obj.pinned or _leased(obj, now)

    def _watermark(self, node: _Node, now: float) -> None:
        cap = node.alloc.capacity_bytes
        if node.alloc.used_bytes <= self.config.high_watermark * cap:
            return
        target = (self.config.high_watermark - self.config.evict_ratio) * cap
        need = int(node.alloc.used_bytes - target)
        for key in node.lru.victims(need, keep=lambda k: self._keep(k, now)):
            self._evict_replica(key, node, now)

    def _evict_replica(self, key: str, node: _Node, now: float) -> None:
        """Evict ``key``'s DRAM replica on ``node`` (write-back persists it first)."""
        node.lru.remove(key)
        obj = self._objects.get(key)
        if obj is None:
            return
        rep = next((r for r in obj.replicas if r.node_id == node.node_id), None)
        if rep is None:
            return
        self.evictions += 1
        if node.ssd_policy == "write-back" and node.node_id not in obj.ssd and (
                node.node_id not in obj.evicting) and not node.offload_paused(now):
            task = self._task(node, "persist", obj, rep.offset, free_after=True)
            obj.evicting[node.node_id] = task.task_id
            return
        self._free_replica(obj, rep, now)

    def _free_replica(self, obj: _Object, rep: _Replica, now: float) -> None:
        node = self._nodes.get(rep.node_id)
        obj.replicas.remove(rep)
        if node is not None:
            node.lru.remove(obj.key)
            self._free_space(node, rep.offset, rep.size, obj, now)
        if obj.replicas or obj.ssd:
            self.state.put_object(obj.record())
            return
        if self._objects.get(obj.key) is obj:
            del self._objects[obj.key]
            self._remember_evicted(obj.key, "evicted from DRAM with no SSD copy")
            self.state.delete_object(obj.key)

    def _free_space(self, node: _Node, offset: int, size: int, obj: _Object,
                    now: float) -> None:
        if _leased(obj, now):
            lease_until = obj.lease_until
            self._deferred.append((lease_until, node, offset, size))
        else:
            node.alloc.free(offset, size)

    def _remember_evicted(self, key: str, why: str) -> None:
        self._evicted[key] = why
        self._evicted.move_to_end(key)
        while len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)

    def _release(self, obj: _Object, now: float) -> None:
        """Free every replica and SSD copy of an object no longer in the tables (the caller
        has already removed its LRU entries)."""
        for rep in obj.replicas:
            node = self._nodes.get(rep.node_id)
            if node is None:
                continue
            if rep.node_id in obj.evicting:
                continue  # freed when the persist task reports
            self._free_space(node, rep.offset, rep.size, obj, now)
        obj.replicas = []
        for nid in obj.ssd:
            node = self._nodes.get(nid)
            if node is not None:
                node.ssd_lru.remove(obj.key)
                self._task(node, "drop", obj, 0)
        obj.ssd = set()

    def commit(self, msg: p.Commit) -> None:
        """Make written puts visible (or release abandoned ones)."""
        with self._cond:
            now = self._clock()
            for key, version in zip(msg.keys, msg.versions, strict=False):
                obj = self._pending.get(key)
                if obj is None or obj.version != version:
                    continue
                del self._pending[key]
                if not msg.ok:
                    self._release(obj, now)
                    continue
                obj.pending_until = 0.0
                self._install(obj, now)

    def _install(self, obj: _Object, now: float) -> None:
        """Make a written object the current value of its key (lock held)."""
        key = obj.key
        old = self._objects.get(key)
        self._objects[key] = obj
        self._evicted.pop(key, None)
        if old is not None:
            for rep in old.replicas:
                self._nodes[rep.node_id].lru.remove(key)
            self._release(old, now)
        for rep in obj.replicas:
            node = self._nodes[rep.node_id]
            node.lru.add(key, node.alloc.rounded(rep.size))
            if node.ssd_policy == "write-through" and not node.offload_paused(now):
                self._task(node, "persist", obj, rep.offset)
        self.state.put_object(obj.record())

    # ------------------------------------------------------------------ reservations

    def reserve(self, msg: p.Reserve, namespace: str = "") -> p.Reservation | p.ErrorInfo:
        """Set aside up to ``msg.size`` bytes on ``msg.replicas`` distinct live nodes for a
        client to place puts in (evicting as a put would); capped at ``reservation_share``
        of the smallest chosen node."""
        replicas = msg.replicas or self.config.default_replicas
        with self._cond:
            now = self._clock()
            live = [n for n in self._nodes.values() if n.alive]
            if msg.size <= 0 or replicas < 1:
                return _err("bad_request", f"reservation of {msg.size} bytes on {replicas} "
                            "replica(s)", "ask for a positive size and 1 or more replicas")
            if replicas > len(live):
                return _err("unavailable", f"{replicas} replica(s) asked for a reservation, "
                            f"{len(live)} live node(s)",
                            "start more storage nodes or ask for fewer replicas")
            live.sort(key=lambda n: n.alloc.free_bytes, reverse=True)
            chosen = live[:replicas]
            held: dict[str, int] = {}
            for res in self._reservations.values():
                for nid in res.starts:
                    held[nid] = held.get(nid, 0) + res.free.free_bytes
            cap = min(min(int(n.alloc.capacity_bytes * self.config.reservation_share),
                          int(n.alloc.capacity_bytes * self.config.reservations_share)
                          - held.get(n.node_id, 0)) for n in chosen)
            align = chosen[0].alloc.alignment_bytes
            size = min(msg.size, cap) // align * align
            if size < min(msg.size, MIN_RESERVATION_BYTES):
                return _err("full", "no room for a reservation (nodes too small, or their "
                            "share for reservations is taken)",
                            "put through the master (StoreClient does when this fails)")
            placed = self._place(chosen, size, replicas, now)
            if placed is None:
                return _err("full", f"no room for a reservation of {size} bytes",
                            "put through the master (StoreClient does when this fails)")
            rid = secrets.randbits(63)  # not guessable, never reused across restarts
            while rid in self._reservations:
                rid = secrets.randbits(63)
            self._reservations[rid] = _Reservation(
                rid, namespace, size, {n.node_id: off for n, off in placed},
                ExtentAllocator(size, alignment_bytes=align), now + self.config.pending_ttl_s)
            for node, _ in placed:
                self._watermark(node, now)
            return p.Reservation(
                reservation=rid, alignment=align, ttl_s=self.config.pending_ttl_s,
                locations=[p.Location(n.node_id, n.segment, off, size) for n, off in placed])

    def put_at(self, msg: p.PutAt, namespace: str = "") -> None:
        """Install objects a client wrote inside its reservation (see :class:`p.PutAt`).
        An item outside the reservation's unused parts, or for a reservation that is gone
        (ended, expired, its nodes dead) or another namespace's, is dropped and logged:
        nothing of it becomes visible."""
        with self._cond:
            now = self._clock()
            res = self._reservations.get(msg.reservation)
            if res is None or res.namespace != namespace:
                if msg.keys:
                    _log.warning("%d put(s) for reservation %x dropped: it is gone (ended, "
                                 "unused past its TTL, or its nodes died)", len(msg.keys),
                                 msg.reservation)
                return
            res.expires = now + self.config.pending_ttl_s
            res.seen += 1
            if msg.end:
                res.expected = max(1, msg.count)
            n = len(msg.keys)
            if not len(msg.sizes) == len(msg.checksums) == len(msg.offsets) == n:
                _log.warning("malformed put_at for reservation %x dropped", res.rid)
                n = 0
            for i in range(n):
                key, size, csum, rel = msg.keys[i], msg.sizes[i], msg.checksums[i], msg.offsets[i]
                if p.check_key(key) is not None or size < 0 or not 0 <= csum < 1 << 64:
                    _log.warning("put_at of a bad key, size or checksum dropped")
                    continue
                try:
                    res.free.reserve(rel, size)  # inside the unused parts, aligned
                except (AllocatorInvariantError, ValueError):
                    _log.warning("put_at of %r at %d (+%d) is outside reservation %x's unused "
                                 "space; dropped", key, rel, size, res.rid)
                    continue
                self._install(_Object(key, size, csum, next(self._versions), [
                    _Replica(nid, start + rel, size) for nid, start in res.starts.items()],
                    set(), now), now)
            if res.expected and res.seen >= res.expected:
                self._end_reservation(res)

    def _end_reservation(self, res: _Reservation) -> None:
        """Give the unused parts of ``res`` back to its nodes (lock held)."""
        del self._reservations[res.rid]
        for nid, start in res.starts.items():
            node = self._nodes.get(nid)
            if node is None:
                continue
            for off, length in res.free.extents():
                node.alloc.free(start + off, length)

    # ------------------------------------------------------------------ get

    def get(self, msg: p.Get) -> p.GetReply:
        """Locations (and a lease) for each key; SSD-only objects are loaded into DRAM."""
        with self._cond:
            if msg.release_keys:
                self.release(p.Release(keys=msg.release_keys, versions=msg.release_versions))
            return p.GetReply(slots=[self._get_one(key, msg.lease) for key in msg.keys])

    def _get_one(self, key: str, lease: bool) -> p.GetSlot | p.ErrorInfo:
        obj = self._objects.get(key)
        if obj is None:
            bad = p.check_key(key)
            if bad is not None:
                return bad
        now = self._clock()
        if obj is not None and not obj.replicas and obj.ssd:
            loaded = self._load_from_ssd(obj)
            if isinstance(loaded, p.ErrorInfo):
                return loaded
            now = self._clock()
        if obj is None or not obj.replicas:
            pend = self._pending.get(key)
            if pend is not None:
                return p.GetSlot(key=key, size=pend.size, checksum=pend.checksum,
                                 version=pend.version, pending=True,
                                 locations=self._locations(pend))
            return self._missing(key)
        if lease:
            obj.lease_until = max(obj.lease_until, now + self.config.lease_ttl_s)
            obj.readers += 1
        for rep in obj.replicas:
            self._nodes[rep.node_id].lru.touch(key)
        return p.GetSlot(key=key, size=obj.size, checksum=obj.checksum, version=obj.version,
                         locations=self._locations(obj))

    def _missing(self, key: str) -> p.ErrorInfo:
        why = self._evicted.get(key)
        if why is not None:
            return _err("evicted", f"key {key!r} was evicted ({why})", "put it again")
        return _err("not_found", f"key {key!r} is not in the store")

    def _locations(self, obj: _Object) -> list[p.Location]:
        return [p.Location(r.node_id, self._nodes[r.node_id].segment, r.offset, r.size)
                for r in obj.replicas if r.node_id in self._nodes]

    def _load_from_ssd(self, obj: _Object) -> p.ErrorInfo | None:
        """Bring an SSD-only object back into DRAM on one of its SSD nodes (lock held)."""
        deadline = self._clock() + self.config.load_timeout_s
        for nid in sorted(obj.ssd):
            node = self._nodes.get(nid)
            if node is None or not node.alive:
                continue
            now = self._clock()
            task_id = obj.loading.get(nid)
            if task_id is None:
                offset = self._allocate(node, obj.size, now)
                # Write-back evictions in flight free DRAM once their persist lands: wait
                # for them (the condition releases the lock) rather than fail the get.
                while offset is None and self._freeing_bytes(node) and self._clock() < deadline:
                    self._cond.wait(timeout=min(0.05, max(0.0, deadline - self._clock())))
                    offset = self._allocate(node, obj.size, self._clock())
                if offset is None:
                    return _err("full", f"no DRAM on {nid} to load {obj.key!r} from SSD",
                                "add DRAM capacity or unpin objects")
                task = self._task(node, "load", obj, offset)
                task_id = task.task_id
                obj.loading[nid] = task_id
            ok = self._cond.wait_for(
                lambda tid=task_id, n=node: tid in self._reports or not n.alive,  # type: ignore[misc]
                timeout=max(0.0, deadline - self._clock()))
            if not node.alive:
                continue
            if not ok:
                return _err("unavailable", f"node {nid} did not load {obj.key!r} from SSD in "
                            f"{self.config.load_timeout_s:.1f} s", "check the node's SSD")
            self._reports.pop(task_id, None)
            if obj.replicas:
                return None
            if self._objects.get(obj.key) is not obj:
                return self._missing(obj.key)
        if obj.replicas:
            return None
        return self._missing(obj.key)

    def _task(self, node: _Node, op: str, obj: _Object, offset: int, *,
              free_after: bool = False) -> p.Task:
        task = p.Task(task_id=next(self._task_ids), op=op, key=obj.key, version=obj.version,
                      offset=offset, size=obj.size, checksum=obj.checksum,
                      free_after=free_after)
        node.tasks.append(task)
        self._cond.notify_all()
        return task

    def _apply_report(self, node: _Node, report: p.TaskReport) -> None:
        task = node.inflight.pop(report.task_id, None)
        if task is None:
            return
        now = self._clock()
        obj = self._objects.get(task.key)
        if obj is not None and obj.version != task.version:
            obj = None
        if task.op == "persist":
            self._ssd_health(node, report, now)
            if obj is None:
                if task.free_after:  # removed while its write-back ran: free the DRAM now
                    node.alloc.free(task.offset, task.size)
                if report.ok:  # object gone meanwhile: drop the file just written
                    node.tasks.append(msgspec.structs.replace(
                        task, task_id=next(self._task_ids), op="drop"))
                return
            if report.ok:
                obj.ssd.add(node.node_id)
                node.ssd_lru.add(obj.key, obj.size)
                self._ssd_watermark(node, obj.key)
            else:
                _log.warning("node %s could not persist %r: %s", node.node_id, obj.key,
                             report.error)
            if task.free_after and obj.evicting.pop(node.node_id, None) is not None:
                rep = next((r for r in obj.replicas if r.node_id == node.node_id), None)
                if rep is not None:
                    if _leased(obj, now):  # read meanwhile: keep it, evictable again
                        node.lru.add(obj.key, node.alloc.rounded(rep.size))
                    else:
                        self._free_replica(obj, rep, now)
            if obj.key in self._objects:
                self.state.put_object(obj.record())
        elif task.op == "load":
            self._reports[task.task_id] = report
            if obj is None or obj.loading.get(node.node_id) != task.task_id:
                node.alloc.free(task.offset, task.size)
                return
            del obj.loading[node.node_id]
            if report.ok:
                obj.replicas.append(_Replica(node.node_id, task.offset, task.size))
                node.lru.add(obj.key, node.alloc.rounded(task.size))
                node.ssd_lru.touch(obj.key)
                self.state.put_object(obj.record())
            else:
                node.alloc.free(task.offset, task.size)
                if report.corrupt:
                    _log.warning("SSD copy of %r on %s failed its checksum: dropped",
                                 obj.key, node.node_id)
                    obj.ssd.discard(node.node_id)
                    node.ssd_lru.remove(obj.key)
                    if not obj.replicas and not obj.ssd:
                        del self._objects[obj.key]
                        self.lost += 1
                        self._remember_evicted(obj.key, "its SSD copy was corrupt")
                        self.state.delete_object(obj.key)
                    else:
                        self.state.put_object(obj.record())
            self._cond.notify_all()

    def _ssd_health(self, node: _Node, report: p.TaskReport, now: float) -> None:
        """Track a node's SSD filling up (pause offload) and recovering."""
        if report.full:
            if not node.ssd_full:
                _log.warning("node %s: SSD tier full (%s); offload paused, DRAM keeps serving",
                             node.node_id, report.error)
            node.ssd_full = True
            node.ssd_retry_at = now + self.config.ssd_full_retry_s
            node.ssd_error = report.error
        elif report.ok and node.ssd_full:
            _log.info("node %s: SSD tier has room again; offload resumed", node.node_id)
            node.ssd_full = False
            node.ssd_error = ""

    def _ssd_watermark(self, node: _Node, newest: str) -> None:
        over = node.ssd_lru.used_units - node.ssd_capacity_bytes
        if over <= 0:
            return
        for key in node.ssd_lru.victims(over, keep=lambda k: k == newest):
            node.ssd_lru.remove(key)
            obj = self._objects.get(key)
            if obj is None:
                continue
            self.ssd_evictions += 1
            self._task(node, "drop", obj, 0)
            obj.ssd.discard(node.node_id)
            if not obj.replicas and not obj.ssd:
                del self._objects[key]
                self._remember_evicted(key, "evicted from SSD")
                self.state.delete_object(key)
            else:
                self.state.put_object(obj.record())

    # ------------------------------------------------------------------ queries

    def release(self, msg: p.Release) -> None:
        """End leases taken by gets whose reads finished."""
        with self._lock:
            for key, version in zip(msg.keys, msg.versions, strict=False):
                obj = self._objects.get(key)
                if obj is None or obj.version != version or obj.readers <= 0:
                    continue
                obj.readers -= 1
                if obj.readers == 0:
                    obj.lease_until = 0.0

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored (in any tier)."""
        with self._lock:
            return [k in self._objects for k in keys]

    def remove(self, keys: list[str]) -> list[bool]:
        """Remove each key; ``True`` where it existed. Leased space is reused after the lease."""
        out = []
        with self._cond:
            now = self._clock()
            for key in keys:
                obj = self._objects.pop(key, None)
                out.append(obj is not None)
                if obj is None:
                    continue
                for rep in obj.replicas:
                    node = self._nodes.get(rep.node_id)
                    if node is not None:
                        node.lru.remove(key)
                self._release(obj, now)
                self._evicted.pop(key, None)
                self.state.delete_object(key)
        return out

    def pin(self, key: str, pinned: bool) -> p.ErrorInfo | None:
        """Pin (never evict) or unpin an object."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return self._missing(key)
            obj.pinned = pinned
            self.state.put_object(obj.record())
            return None

    def _info(self, obj: _Object, now: float) -> p.ObjectInfo:
        return p.ObjectInfo(key=obj.key, size=obj.size, checksum=obj.checksum,
                            version=obj.version, replicas=[r.node_id for r in obj.replicas],
                            ssd_replicas=sorted(obj.ssd), tier=obj.tier, pinned=obj.pinned,
                            lease_remaining_s=(max(0.0, obj.lease_until - now)
                                               if obj.readers else 0.0),
                            age_s=now - obj.created)

    def stat(self, key: str) -> p.ObjectInfo | p.ErrorInfo:
        """Metadata of one object (no lease, no recency change)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return self._missing(key)
            return self._info(obj, self._clock())

    def list_objects(self, prefix: str, limit: int) -> tuple[list[p.ObjectInfo], bool]:
        """Objects whose key starts with ``prefix``, sorted, at most ``limit``."""
        with self._lock:
            now = self._clock()
            keys = sorted(k for k in self._objects if k.startswith(prefix))
            return [self._info(self._objects[k], now) for k in keys[:limit]], len(keys) > limit

    def nodes(self) -> list[p.NodeAddress]:
        """Addresses of the live nodes."""
        with self._lock:
            return [n.address() for n in self._nodes.values() if n.alive]

    def status(self) -> p.StoreStatus:
        """Nodes, capacity, usage, evictions and objects per tier."""
        with self._lock:
            now = self._clock()
            tiers = {"dram": 0, "ssd": 0, "dram+ssd": 0}
            for obj in self._objects.values():
                tiers[obj.tier] += 1
            nodes = [p.NodeStatus(
                node_id=n.node_id, alive=n.alive, capacity_bytes=n.alloc.capacity_bytes,
                used_bytes=n.alloc.used_bytes, objects=len(n.lru),
                ssd_capacity_bytes=n.ssd_capacity_bytes, ssd_used_bytes=n.ssd_lru.used_units,
                ssd_objects=len(n.ssd_lru), ssd_policy=n.ssd_policy, endpoint=n.endpoint,
                last_heartbeat_s=now - n.last_seen, ssd_state=n.ssd_state,
                ssd_error=n.ssd_error) for n in self._nodes.values()]
            return p.StoreStatus(
                nodes=nodes, objects=len(self._objects),
                capacity_bytes=sum(n.capacity_bytes for n in nodes if n.alive),
                used_bytes=sum(n.used_bytes for n in nodes if n.alive),
                evictions=self.evictions, ssd_evictions=self.ssd_evictions, lost=self.lost,
                tiers=tiers, state=self.state.description,
                high_watermark=self.config.high_watermark, evict_ratio=self.config.evict_ratio,
                reserved_bytes=sum(res.free.free_bytes * len(res.starts)
                                   for res in self._reservations.values()))

    # ------------------------------------------------------------------ test hooks

    def live_allocations(self) -> dict[str, list[tuple[int, int]]]:
        """Per node, every allocated ``(offset, rounded_size)`` range: live, pending, deferred
        and loading (for invariant tests)."""
        with self._lock:
            out: dict[str, list[tuple[int, int]]] = {nid: [] for nid in self._nodes}
            for table in (self._objects, self._pending):
                for obj in table.values():
                    for r in obj.replicas:
                        if r.node_id in out:
                            out[r.node_id].append((r.offset, self._nodes[r.node_id]
                                                   .alloc.rounded(r.size)))
            for _, node, offset, size in self._deferred:
                if node.node_id in out:
                    out[node.node_id].append((offset, node.alloc.rounded(size)))
            for res in self._reservations.values():
                for nid, start in res.starts.items():
                    if nid in out:
                        out[nid].extend((start + off, length)
                                        for off, length in res.free.extents())
            return out

    def node_usage(self) -> dict[str, tuple[int, int]]:
        """Per node ``(used_bytes, capacity_bytes)``."""
        with self._lock:
            return {n.node_id: (n.alloc.used_bytes, n.alloc.capacity_bytes)
                    for n in self._nodes.values()}

    def close(self) -> None:
        """Close the state backend."""
        with self._lock:
            self.state.close()
