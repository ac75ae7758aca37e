"""Where the master keeps its state so a restarted (or standby) master keeps the objects.

- ``none`` (:class:`NoState`): nothing is kept (tests, throwaway stores).
- ``DIR`` / ``file:///DIR`` (:class:`~kvctl.store.journal.JournalState`): journal segments
  plus snapshots written in the background from the master's live view.
- ``etcd://HOST:PORT`` (or any :func:`~kvctl.metadata.open_metadata` URL):
  :class:`~kvctl.store.writebehind.MetadataState`, written behind the master's lock in
  ordered batches, each one etcd key of a log over background snapshots under
  ``kvctl/store/`` (:mod:`kvctl.store.etcdlog`), so a standby master on another host can
  load them and take over. Masters on etcd elect one leader
  (:mod:`kvctl.store.master.election`) and the leader's writes are fenced by its term.

Every backend follows the rules of :mod:`kvctl.store.statebase`: nothing waits for I/O with
the master's lock held, and a request is acknowledged only once its changes are durable.
"""

from __future__ import annotations

from pathlib import Path

from kvctl.store.journal import JournalState
from kvctl.store.statebase import (
    DeleteNode,
    DeleteObject,
    JournalEntry,
    LoadedState,
    NodeRecord,
    NoState,
    ObjectRecord,
    ReplicaRecord,
    Snapshot,
    StateBackend,
)
from kvctl.store.writebehind import MetadataState

__all__ = ["DeleteNode", "DeleteObject", "JournalEntry", "JournalState", "LoadedState",
           "MetadataState", "NoState", "NodeRecord", "ObjectRecord", "ReplicaRecord",
           "Snapshot", "StateBackend", "elects_leader", "open_state"]


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


def elects_leader(spec: str) -> bool:
    """Whether masters on this state elect a leader (etcd: several may share it)."""
    return spec.startswith("etcd://")
