"""Where the master keeps its state so a restarted (or standby) master keeps the objects.

- ``none``: nothing is kept (tests, throwaway stores).
- ``DIR`` / ``file:///DIR`` (:class:`JournalState`): an append-only journal of msgpack
  records plus a snapshot, compacted when the journal outgrows the live state. Records are
  written to the OS on every change (they survive the master process being killed) and
  fsync'ed only at snapshots: a host crash can lose the last moments of changes, which a
  cache tolerates. A torn last record is detected and ignored.
- ``etcd://HOST:PORT`` (or any :func:`~kvctl.transfer.metadata.open_metadata` URL):
  :class:`MetadataState` writes one key per object under ``kvctl/store/``, so a standby
  master on another host can load them and take over. While the service is unreachable
  (an etcd restart) changes are kept in order in memory and written when it answers again
  (the master keeps serving meanwhile; a master killed during the outage loses them).
"""

from __future__ import annotations

import abc
import logging
import os
import struct
import time
from pathlib import Path

import msgspec

from kvctl.errors import UsageError
from kvctl.store.errors import StoreUnavailableError

_log = logging.getLogger("kvctl.store.state")


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


class StateBackend(abc.ABC):
    """Persistence of master state; called with the master's lock held."""

    description: str = "none"

    @abc.abstractmethod
    def load(self) -> LoadedState:
        """Everything saved so far."""

    @abc.abstractmethod
    def put_object(self, record: ObjectRecord) -> None:
        """Create or replace an object record."""

    @abc.abstractmethod
    def delete_object(self, key: str) -> None:
        """Forget an object."""

    @abc.abstractmethod
    def put_node(self, record: NodeRecord) -> None:
        """Create or replace a node record."""

    @abc.abstractmethod
    def delete_node(self, node_id: str) -> None:
        """Forget a node."""

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Write what could not be written earlier (called periodically by the master)."""

    def refusal(self) -> str | None:
        """Why the master should take no new writes now (its state cannot record them), or
        ``None`` when it can."""
        return None

    def wait_for_key(self, key: str) -> None:  # noqa: B027 - optional hook
        """The calling thread acknowledges ``key``'s current value (a put of the same bytes):
        its durability wait covers that key's record still being written, if any."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release files or connections. Safe to call twice."""


class NoState(StateBackend):
    """Keeps nothing: a restarted master starts empty."""

    def load(self) -> LoadedState:
        return LoadedState([], [])

    def put_object(self, record: ObjectRecord) -> None:
        pass

    def delete_object(self, key: str) -> None:
        pass

    def put_node(self, record: NodeRecord) -> None:
        pass

    def delete_node(self, node_id: str) -> None:
        pass


_LEN = struct.Struct("<I")


class JournalState(StateBackend):
    """Append-only journal + snapshot in ``directory`` (one master at a time).

    Args:
        directory: created if missing; holds ``snapshot.msgpack`` and ``journal.log``.
        compact_min_records: compact once the journal has this many records and more than
            twice as many as there are live objects.
    """

    def __init__(self, directory: Path, *, compact_min_records: int = 50_000) -> None:
        self.directory = directory
        self.description = f"journal {directory}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create master state directory {directory}: {exc}",
                             "pick a writable --state directory") from exc
        self._snapshot = directory / "snapshot.msgpack"
        self._journal_path = directory / "journal.log"
        self._compact_min = compact_min_records
        self._encoder = msgspec.msgpack.Encoder()
        self._objects: dict[str, ObjectRecord] = {}
        self._nodes: dict[str, NodeRecord] = {}
        self._records = 0
        self._journal: object = None
        self._replay()
        self._compact()

    def _replay(self) -> None:
        if self._snapshot.exists():
            try:
                loaded = msgspec.msgpack.decode(self._snapshot.read_bytes(), type=LoadedState)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise UsageError(f"master state snapshot {self._snapshot} is unreadable: {exc}",
                                 "restore it from a backup or start with an empty --state") from exc
            self._objects = {o.key: o for o in loaded.objects}
            self._nodes = {n.node_id: n for n in loaded.nodes}
        if not self._journal_path.exists():
            return
        data = self._journal_path.read_bytes()
        decoder = msgspec.msgpack.Decoder(JournalEntry)
        pos = 0
        while pos + _LEN.size <= len(data):
            (length,) = _LEN.unpack_from(data, pos)
            end = pos + _LEN.size + length
            if end > len(data):
                break
            try:
                entry = decoder.decode(data[pos + _LEN.size:end])
            except (msgspec.DecodeError, msgspec.ValidationError):
                break
            self._apply(entry)
            pos = end
        if pos != len(data):
            _log.warning("master journal %s: ignoring a torn record at byte %d",
                         self._journal_path, pos)

    def _apply(self, entry: JournalEntry) -> None:
        if isinstance(entry, ObjectRecord):
            self._objects[entry.key] = entry
        elif isinstance(entry, NodeRecord):
            self._nodes[entry.node_id] = entry
        elif isinstance(entry, DeleteObject):
            self._objects.pop(entry.key, None)
        else:
            self._nodes.pop(entry.node_id, None)

    def _compact(self) -> None:
        if self._journal is not None:
            self._journal.close()  # type: ignore[attr-defined]
        tmp = self._snapshot.with_suffix(".tmp")
        body = self._encoder.encode(
            LoadedState(list(self._objects.values()), list(self._nodes.values())))
        with tmp.open("wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(self._snapshot)
        self._journal = self._journal_path.open("wb")
        self._records = 0

    def _append(self, entry: JournalEntry) -> None:
        self._apply(entry)
        payload = self._encoder.encode(entry)
        fh = self._journal
        fh.write(_LEN.pack(len(payload)) + payload)  # type: ignore[attr-defined]
        fh.flush()  # type: ignore[attr-defined]
        self._records += 1
        if self._records >= self._compact_min and self._records > 2 * len(self._objects):
            self._compact()

    def load(self) -> LoadedState:
        return LoadedState(list(self._objects.values()), list(self._nodes.values()))

    def put_object(self, record: ObjectRecord) -> None:
        self._append(record)

    def delete_object(self, key: str) -> None:
        self._append(DeleteObject(key))

    def put_node(self, record: NodeRecord) -> None:
        self._append(record)

    def delete_node(self, node_id: str) -> None:
        self._append(DeleteNode(node_id))

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()  # type: ignore[attr-defined]
            self._journal = None


class MetadataState(StateBackend):
    """Objects and nodes as keys of a metadata service (etcd in production).

    Keys: ``kvctl/[cluster/]store/objects/<key>`` and ``.../store/nodes/<node_id>``, values
    msgpack records. Each change is one request to the service, on the master's lock: the
    price of a master that can be replaced by a standby.

    A change the service cannot take (it is restarting, unreachable) is kept as the latest
    value of its key, in order, and written by the next change or :meth:`sync` once the
    service answers; until then each change costs one quick failed attempt at most per
    second. ``backlog`` counts the keys waiting.
    """

    #: Seconds between attempts to reach the service while changes are waiting.
    RETRY_S = 1.0

    def __init__(self, url: str, *, cluster_id: str = "", token: str | None = None,
                 timeout_s: float = 2.0) -> None:
        from kvctl.transfer.metadata import key_prefix, open_metadata

        self.description = f"metadata {url}"
        self._client = open_metadata(url, token=token, timeout_s=timeout_s)
        self._prefix = key_prefix(cluster_id) + "store/"
        self._encoder = msgspec.msgpack.Encoder()
        #: full key -> value to write (``None``: delete), oldest first.
        self._waiting: dict[str, bytes | None] = {}
        self._retry_at = 0.0

    @property
    def backlog(self) -> int:
        """Changes not yet written to the service."""
        return len(self._waiting)

    def _change(self, key: str, value: bytes | None) -> None:
        """Write one change, or keep it (after any older waiting ones) for later."""
        self._waiting.pop(key, None)
        self._waiting[key] = value
        self._flush()

    def _flush(self) -> None:
        from kvctl.transfer.metadata import MetadataError

        if not self._waiting or time.monotonic() < self._retry_at:
            return
        try:
            while self._waiting:
                key, value = next(iter(self._waiting.items()))
                if value is None:
                    self._client.delete(key)
                else:
                    self._client.put(key, value)
                del self._waiting[key]
        except MetadataError as exc:
            if self._retry_at == 0.0:
                _log.warning("master state %s: %s; keeping %d change(s) until it answers",
                             self.description, exc.cause, len(self._waiting))
            self._retry_at = time.monotonic() + self.RETRY_S
            return
        if self._retry_at:
            _log.info("master state %s: reachable again; backlog written", self.description)
        self._retry_at = 0.0

    def sync(self) -> None:
        self._flush()

    def _call(self, what: str, fn: object) -> object:
        from kvctl.transfer.metadata import MetadataError

        try:
            return fn()  # type: ignore[operator]
        except MetadataError as exc:
            raise StoreUnavailableError(
                f"master state {self.description}: {what} failed: {exc.cause}",
                exc.hint or "check that the metadata service is running") from exc

    def load(self) -> LoadedState:
        entries = self._call("list", lambda: self._client.list(self._prefix))
        objects: list[ObjectRecord] = []
        nodes: list[NodeRecord] = []
        for key, value in entries.items():  # type: ignore[attr-defined]
            try:
                if key.startswith(self._prefix + "objects/"):
                    objects.append(msgspec.msgpack.decode(value, type=ObjectRecord))
                elif key.startswith(self._prefix + "nodes/"):
                    nodes.append(msgspec.msgpack.decode(value, type=NodeRecord))
            except (msgspec.DecodeError, msgspec.ValidationError):
                _log.warning("master state: skipping unreadable record %s", key)
        return LoadedState(objects, nodes)

    def put_object(self, record: ObjectRecord) -> None:
        self._change(self._prefix + "objects/" + record.key, self._encoder.encode(record))

    def delete_object(self, key: str) -> None:
        self._change(self._prefix + "objects/" + key, None)

    def put_node(self, record: NodeRecord) -> None:
        self._change(self._prefix + "nodes/" + record.node_id, self._encoder.encode(record))

    def delete_node(self, node_id: str) -> None:
        self._change(self._prefix + "nodes/" + node_id, None)

    def close(self) -> None:
        self._retry_at = 0.0
        self._flush()
        if self._waiting:
            _log.warning("master state %s: %d change(s) could not be written before close",
                         self.description, len(self._waiting))
        self._client.close()


def open_state(spec: str, *, cluster_id: str = "", token: str | None = None) -> StateBackend:
    """The backend named by ``spec``: ``none``, a directory, ``file:///DIR`` or a metadata
    URL (``etcd://127.0.0.1:2379``)."""
    if spec in ("", "none"):
        return NoState()
    if spec.startswith("file://"):
        return JournalState(Path(spec[len("file://"):]))
    if "://" in spec:
        return MetadataState(spec, cluster_id=cluster_id, token=token)
    return JournalState(Path(spec).expanduser())
