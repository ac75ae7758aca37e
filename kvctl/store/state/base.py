"""What a master's state backend keeps, and the rules every backend follows.

Records are msgspec Structs (array-like msgpack). The master calls the ``put_*`` and
``delete_*`` methods with its lock held: a backend never waits for I/O there (the journal
appends to a buffer, etcd state to a write-behind queue). Durability is the connection's
business: after a request, its thread calls :meth:`StateBackend.ack` (without the lock)
and the reply goes out only once every change the request made is durable, or as a
failure saying why not. A backend that cannot record changes says so through
:meth:`StateBackend.refusal`, and the master then takes no new puts.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence

import msgspec

from kvctl.store.errors import StoreUnavailableError

#: Loads of a state that changed under them (:class:`StateMovedError`) before giving up.
LOAD_ATTEMPTS = 3


class StateMovedError(StoreUnavailableError):
    """The state moved under a load in a way a load from the start reads whole (etcd
    compacted the revision everything was being read at): the caller loads again."""


class ReplicaRecord(msgspec.Struct, array_like=True, frozen=True):
    node_id: str
    offset: int
    size: int
    #: the node's epoch when this copy was placed (a copy of an older epoch is gone).
    epoch: str = ""


class ObjectRecord(msgspec.Struct, array_like=True, frozen=True, tag="obj"):
    key: str
    size: int
    checksum: int
    version: int
    replicas: list[ReplicaRecord]
    ssd_replicas: list[str]
    pinned: bool = False
    #: per SSD copy, the node's epoch when it was written (same order as ``ssd_replicas``).
    ssd_epochs: list[str] = msgspec.field(default_factory=list)
    #: a shared-tier copy (``Obj.shared``: 0 none, else its own file and its use stamp).
    shared: int = 0
    #: that copy is a record in a pack file (``Obj.pack``: pack id << 24 | offset; 0: not).
    pack: int = 0


class NodeRecord(msgspec.Struct, array_like=True, frozen=True, tag="node"):
    node_id: str
    epoch: str
    segment: str
    endpoint: str
    host_id: str
    capacity_bytes: int
    ssd_capacity_bytes: int
    ssd_policy: str


class DeleteObject(msgspec.Struct, array_like=True, frozen=True, tag="del"):
    key: str


class DeleteNode(msgspec.Struct, array_like=True, frozen=True, tag="delnode"):
    node_id: str


JournalEntry = ObjectRecord | NodeRecord | DeleteObject | DeleteNode


class LoadedState(msgspec.Struct, frozen=True):
    objects: list[ObjectRecord]
    nodes: list[NodeRecord]


class Snapshot(abc.ABC):
    """A snapshot being written from the master's live view, a slice at a time.

    :meth:`add` runs with the master's lock held (it only encodes); :meth:`write` and
    :meth:`finish` run without it (file I/O, fsync)."""

    @abc.abstractmethod
    def add(self, records: Sequence[ObjectRecord]) -> None:
        """Take the records of the next slice of keys (lock held)."""

    @abc.abstractmethod
    def write(self) -> None:
        """Write what :meth:`add` took (lock not held)."""

    @abc.abstractmethod
    def finish(self) -> bool:
        """Make the snapshot the base of the state (lock not held); ``False`` when it
        failed (nothing changed: the previous snapshot and journals still hold)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up (lock not held)."""


class StateBackend(abc.ABC):
    """Persistence of master state (see the module docstring for the rules)."""

    description: str = "none"

    @abc.abstractmethod
    def replay(self) -> Iterator[JournalEntry]:
        """Everything saved so far, as changes to apply in order (a node's record always
        comes before objects placed on it)."""

    def load(self) -> LoadedState:
        """Everything saved so far, materialised (tests and tools; a restore streams
        :meth:`replay` instead)."""
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                return self._load()
            except StateMovedError:
                if attempt == LOAD_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _load(self) -> LoadedState:
        objects: dict[str, ObjectRecord] = {}
        nodes: dict[str, NodeRecord] = {}
        for entry in self.replay():
            if isinstance(entry, ObjectRecord):
                objects[entry.key] = entry
            elif isinstance(entry, NodeRecord):
                nodes[entry.node_id] = entry
            elif isinstance(entry, DeleteObject):
                objects.pop(entry.key, None)
            else:
                nodes.pop(entry.node_id, None)
        return LoadedState(list(objects.values()), list(nodes.values()))

    @abc.abstractmethod
    def put_object(self, record: ObjectRecord) -> None:
        """Create or replace an object record (lock held; no waiting for I/O)."""

    @abc.abstractmethod
    def delete_object(self, key: str) -> None:
        """Forget an object (lock held; no waiting for I/O)."""

    @abc.abstractmethod
    def put_node(self, record: NodeRecord) -> None:
        """Create or replace a node record (lock held; no waiting for I/O)."""

    @abc.abstractmethod
    def delete_node(self, node_id: str) -> None:
        """Forget a node (lock held; no waiting for I/O)."""

    def ack(self, timeout_s: float | None = None) -> str | None:
        """Wait (without the master's lock) until every change the calling thread made
        is durable; ``None`` when it is, else why it is not (the change stays in the
        master's memory and is written when the backend can)."""
        return None

    def wait_for_key(self, key: str) -> None:  # noqa: B027 - optional hook
        """The calling thread acknowledges ``key``'s current value (a put of the same
        bytes): its :meth:`ack` then also covers that key's change still being written."""

    def refusal(self) -> str | None:
        """Why the master should take no new puts now (changes cannot be recorded), or
        ``None`` when it can."""
        return None

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Periodic housekeeping (called by the master's tick, lock held; no waiting)."""

    def snapshot_wanted(self, live_objects: int) -> bool:
        """Whether a snapshot is due (the journal outgrew ``live_objects``, or the backend
        must rebuild after a failed write)."""
        return False

    def start_snapshot(self, nodes: Sequence[NodeRecord]) -> Snapshot | None:
        """Begin a snapshot with the master's current ``nodes`` (lock held: from here on
        changes go to a new journal); ``None`` when this backend keeps none."""
        return None

    @property
    def backlog(self) -> int:
        """Changes taken but not yet durable."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release files or connections. Safe to call twice."""


class NoState(StateBackend):
    """Keeps nothing: a restarted master starts empty."""

    def replay(self) -> Iterator[JournalEntry]:
        return iter(())

    def put_object(self, record: ObjectRecord) -> None:
        pass

    def delete_object(self, key: str) -> None:
        pass

    def put_node(self, record: NodeRecord) -> None:
        pass

    def delete_node(self, node_id: str) -> None:
        pass


#: ``factory(spec, cluster_id, token)``: the backend a ``scheme://...`` state spec names.
StateFactory = Callable[[str, str, str | None], StateBackend]

_SCHEMES: dict[str, StateFactory] = {}


def register_state(scheme: str) -> Callable[[StateFactory], StateFactory]:
    """Decorator: make ``factory`` the backend of ``scheme://`` state specs (the first
    backend to register a scheme keeps it)."""

    def decorate(factory: StateFactory) -> StateFactory:
        _SCHEMES.setdefault(scheme, factory)
        return factory

    return decorate


def state_factory(scheme: str) -> StateFactory | None:
    """The backend registered for ``scheme``, or ``None``."""
    return _SCHEMES.get(scheme)


def registered_schemes() -> list[str]:
    """The schemes registered so far, sorted."""
    return sorted(_SCHEMES)
