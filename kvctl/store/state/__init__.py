"""Where the master keeps its state so a restarted (or standby) master keeps the objects.

- ``none`` (:class:`NoState`): nothing is kept (tests, throwaway stores).
- ``DIR`` / ``file:///DIR`` (:class:`~kvctl.store.state.journal.JournalState`): journal
  segments plus snapshots written in the background from the master's live view.
- ``etcd://HOST:PORT`` (or any :func:`~kvctl.metadata.open_metadata` URL):
  :class:`~kvctl.store.state.writebehind.MetadataState`, written behind the master's lock in
  ordered batches, each one etcd key of a log over background snapshots under
  ``kvctl/store/`` (:mod:`kvctl.store.state.etcdlog`), so a standby master on another host
  can load them and take over. Masters on etcd elect one leader
  (:mod:`kvctl.store.master.election`) and the leader's writes are fenced by its term.

Backends register by URL scheme (:func:`~kvctl.store.state.base.register_state`): the
journal takes ``file://``, the metadata state every other scheme the metadata layer knows.
Every backend follows the rules of :mod:`kvctl.store.state.base`: nothing waits for I/O with
the master's lock held, and a request is acknowledged only once its changes are durable.
"""

from __future__ import annotations

from pathlib import Path

from kvctl.errors import UsageError
from kvctl.store.state.base import (
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
    registered_schemes,
    state_factory,
)
from kvctl.store.state.journal import JournalState
from kvctl.store.state.writebehind import MetadataState, register_metadata_schemes

__all__ = ["DeleteNode", "DeleteObject", "JournalEntry", "JournalState", "LoadedState",
           "MetadataState", "NoState", "NodeRecord", "ObjectRecord", "ReplicaRecord",
           "Snapshot", "StateBackend", "elects_leader", "known_schemes", "open_state"]


def known_schemes() -> list[str]:
    """The URL schemes a state spec may name (``file`` and the metadata layer's)."""
    register_metadata_schemes()  # the journal registered file:// on import, first
    return registered_schemes()


def open_state(spec: str, *, cluster_id: str = "", token: str | None = None) -> StateBackend:
    """The backend named by ``spec``: ``none``, a directory, ``file:///DIR`` or a metadata
    URL (``etcd://127.0.0.1:2379``).

    Raises:
        UsageError: the URL's scheme is unknown (the hint lists the known ones), or the
            backend refuses the spec.
    """
    if spec in ("", "none"):
        return NoState()
    if "://" not in spec:
        return JournalState(Path(spec).expanduser())
    known = known_schemes()
    scheme = spec.partition("://")[0].lower()  # as the metadata layer reads a URL's scheme
    factory = state_factory(scheme)
    if factory is None:
        raise UsageError(f"unknown metadata scheme {scheme!r} in {spec!r}",
                         f"known schemes: {', '.join(known)}")
    return factory(spec, cluster_id, token)


def elects_leader(spec: str) -> bool:
    """Whether masters on this state elect a leader (etcd: several may share it)."""
    return spec.startswith("etcd://")
