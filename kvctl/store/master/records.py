"""What the master keeps per object, replica, node and reservation.

Per-object records are the master's memory at scale, so they are compact and invisible to
the cyclic garbage collector: :class:`Obj` and :class:`Replica` are msgspec Structs with
``gc=False`` (no GC header, never traversed; they hold no reference cycles: a replica
points at its node, a node never points back at objects except through its LRU maps, which
hold keys and objects but nothing that leads back to the node). Fields that only a few
objects use at a time (write-back evictions and SSD loads in flight) are ``None`` until
needed, and replicas and SSD copies are tuples (``()`` for none) rather than sets or lists.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import msgspec

from kvctl.store import protocol as p
from kvctl.store.allocator import ExtentAllocator
from kvctl.store.state import NodeRecord, ObjectRecord, ReplicaRecord

#: Node states. A node is *alive* while it heartbeats, *suspect* once silent past the node
#: timeout (kept, with its objects, but given no placements and no reads), *restored*
#: from state by a restarted master until it registers again, *dropped* for good.
ALIVE: Final = "alive"
SUSPECT: Final = "suspect"
RESTORED: Final = "restored"
DROPPED: Final = "dropped"


class Node:
    """One storage node's segment and the master's bookkeeping for it."""

    __slots__ = ("alloc", "capacity_bytes", "descriptor", "endpoint", "epoch",
                 "freeing_bytes", "host_id", "inflight", "last_seen", "lru", "node_id",
                 "segment", "ssd_capacity_bytes", "ssd_error", "ssd_full", "ssd_lru",
                 "ssd_policy", "ssd_retry_at", "ssd_used_bytes", "state", "tasks")

    def __init__(self, node_id: str, epoch: str, segment: str, endpoint: str, host_id: str,
                 capacity_bytes: int, ssd_capacity_bytes: int, ssd_policy: str, *,
                 last_seen: float, state: str = ALIVE, descriptor: bytes = b"",
                 alloc: ExtentAllocator | None = None) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.segment = segment
        self.endpoint = endpoint
        self.host_id = host_id
        self.capacity_bytes = capacity_bytes
        self.alloc = alloc if alloc is not None else ExtentAllocator(capacity_bytes)
        self.ssd_capacity_bytes = ssd_capacity_bytes
        self.ssd_policy = ssd_policy
        #: when the master last heard from it, in the master's observed seconds.
        self.last_seen = last_seen
        self.descriptor = descriptor
        self.state = state
        #: committed objects with a DRAM replica here, least recently used first (a plain
        #: dict in insertion order: it holds only strings and gc=False records, so the
        #: garbage collector does not walk it, as it would an OrderedDict).
        self.lru: dict[str, Obj] = {}
        #: objects with an SSD copy here, least recently used first.
        self.ssd_lru: dict[str, Obj] = {}
        self.ssd_used_bytes = 0
        self.tasks: deque[p.Task] = deque()
        self.inflight: dict[int, p.Task] = {}
        #: DRAM that running write-back persists will free, bytes.
        self.freeing_bytes = 0
        #: the SSD refused a write for lack of space (cleared by the next successful persist).
        self.ssd_full = False
        #: while ``ssd_full``: no offload before this time (then one more write is tried).
        self.ssd_retry_at = 0.0
        self.ssd_error = ""

    @property
    def alive(self) -> bool:
        """Heartbeating: takes placements and serves reads."""
        return self.state == ALIVE

    @property
    def dropped(self) -> bool:
        return self.state == DROPPED

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

    def __repr__(self) -> str:
        return f"Node({self.node_id!r}, epoch={self.epoch!r}, {self.state})"


class Replica(msgspec.Struct, gc=False):
    """A DRAM copy: ``offset`` in ``node``'s segment (its size is the object's)."""

    node: Node
    offset: int


class Obj(msgspec.Struct, gc=False):
    """One object (committed, or pending until its put commits)."""

    key: str
    size: int
    checksum: int
    version: int
    replicas: tuple[Replica, ...]
    ssd: tuple[Node, ...] = ()
    created: float = 0.0
    pinned: bool = False
    lease_until: float = 0.0
    #: gets whose bytes are being read (lease ends when it drops to 0 or at lease_until).
    readers: int = 0
    pending_until: float = 0.0
    #: node -> task id of a running write-back persist (DRAM freed when it finishes).
    evicting: dict[Node, int] | None = None
    #: node -> task id of a running SSD → DRAM load.
    loading: dict[Node, int] | None = None
    #: a copy in the shared tier: 0 none, else its own file (named by key and version, see
    #: kvctl.store.sharedtier.fileformat) and the value is the copy's use stamp (larger:
    #: used more recently; the restore's LRU order, see kvctl.store.sharedtier.mixin)
    shared: int = 0
    #: the shared copy is a record in a pack file: ``pack id << 24 | byte offset`` (0: its
    #: own file; see kvctl.store.sharedtier.packs)
    pack: int = 0

    def record(self) -> ObjectRecord:
        """What the state backend keeps (copies on dropped nodes left out)."""
        ssd = sorted((n for n in self.ssd if not n.dropped), key=_node_id)
        return ObjectRecord(
            self.key, self.size, self.checksum, self.version,
            [ReplicaRecord(r.node.node_id, r.offset, self.size, r.node.epoch)
             for r in self.replicas if not r.node.dropped],
            [n.node_id for n in ssd], self.pinned, [n.epoch for n in ssd], self.shared,
            self.pack)

    def replica_on(self, node: Node) -> Replica | None:
        for rep in self.replicas:
            if rep.node is node:
                return rep
        return None

    def leased(self, now: float) -> bool:
        return self.readers > 0 and self.lease_until > now

    @property
    def tier(self) -> str:
        """``dram``, ``ssd``, ``shared`` or their combination (``dram+ssd``, ``dram+shared``)."""
        parts = [name for name, held in (("dram", self.replicas), ("ssd", self.ssd),
                                          ("shared", self.shared)) if held]
        return "+".join(parts) or "ssd"


def _node_id(node: Node) -> str:
    return node.node_id


class Reservation:
    """Space a client places puts in; ``free`` tracks its unused parts (offsets relative to
    each replica's start; the same on every replica node)."""

    __slots__ = ("expected", "expires", "free", "namespace", "rid", "seen", "size", "starts")

    def __init__(self, rid: int, namespace: str, size: int, starts: dict[Node, int],
                 free: ExtentAllocator, expires: float) -> None:
        self.rid = rid
        self.namespace = namespace
        self.size = size
        #: node -> start offset of this reservation's range on that node
        self.starts = starts
        self.free = free
        self.expires = expires
        #: PutAt messages taken, and (once the client ended it) how many it sent in all.
        self.seen = 0
        self.expected = 0
