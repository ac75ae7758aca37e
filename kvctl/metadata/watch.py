"""Watching prefixes: changes pushed by the service where it can, polled where it cannot.

A watch delivers *changes* in the order they happened: a :class:`Snapshot` (every live key
under one prefix, at one moment) and then :class:`WatchEvent` s (a key put, or gone: deleted
or expired). The first changes of every watch are a snapshot of each prefix, taken after the
watch was set up, so nothing falls between reading and watching; a watch that lost events
(its stream broke and the service's history no longer reaches back) sends a fresh snapshot.
A reader therefore keeps a dict up to date with :func:`apply_changes` and never lists::

    with client.watch(["kvctl/cluster/jobs/h1/"]) as watch:
        entries: dict[str, bytes] = {}
        while running:
            if apply_changes(entries, watch.wait(1.0)):
                ...  # entries changed

Backends: etcd pushes (its watch stream), ``memory://`` pushes (in-process), Redis pushes
writes (pub/sub) and finds lease expiries by polling, and ``file://`` and kvctl's HTTP
server are polled (:class:`PollingWatch`: one ``list`` per prefix every ``poll_s``, diffed).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from kvctl.metadata.base import MetadataClient, MetadataError

_log = logging.getLogger(__name__)

#: Default seconds between polls of a polled watch (and the most a pushed one may lag
#: behind a change its service cannot push, such as a Redis lease expiring).
DEFAULT_POLL_S = 1.0


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One key changed: ``value`` is its new value, ``None`` when it is gone."""

    key: str
    value: bytes | None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every live key under ``prefix`` at one moment: replaces what a reader held there."""

    prefix: str
    entries: Mapping[str, bytes]


Change = WatchEvent | Snapshot


def apply_changes(state: dict[str, bytes], changes: Iterable[Change]) -> bool:
    """Bring ``state`` up to date with ``changes`` (in order); ``True`` if any came."""
    seen = False
    for change in changes:
        seen = True
        if isinstance(change, Snapshot):
            for key in [k for k in state if k.startswith(change.prefix)]:
                del state[key]
            state.update(change.entries)
        elif change.value is None:
            state.pop(change.key, None)
        else:
            state[change.key] = change.value
    return seen


def check_prefixes(prefixes: str | Sequence[str]) -> tuple[str, ...]:
    """``prefixes`` as a tuple (one string is one prefix).

    Raises:
        ValueError: no prefix, or two that overlap (one starts with the other).
    """
    found = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
    if not found:
        raise ValueError("a watch needs at least one prefix")
    for a in found:
        for b in found:
            if a is not b and b.startswith(a):
                raise ValueError(f"watched prefixes {a!r} and {b!r} overlap")
    return found


class Watch(abc.ABC):
    """Changes under some prefixes, from when the watch was opened. ``close()`` is
    idempotent; a closed watch returns no more changes.

    Attributes:
        prefixes: what is watched.
        pushed: whether the service pushes changes (``False``: they are polled).
    """

    prefixes: tuple[str, ...]
    pushed: bool

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> list[Change]:
        """The changes since the last call, waiting up to ``timeout_s`` for the first;
        ``[]`` when none came.

        Raises:
            MetadataError: the service could not be read (the watch keeps trying: call
                ``wait`` again; when it is back, a snapshot or the missed events follow).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class PollingWatch(Watch):
    """A watch by polling: one ``list`` per prefix every ``poll_s`` (or at once when
    :meth:`nudge` d), diffed against the previous listing.

    Args:
        client: the service.
        prefixes: what to watch.
        poll_s: seconds between listings.
    """

    pushed = False

    def __init__(self, client: MetadataClient, prefixes: str | Sequence[str], *,
                 poll_s: float = DEFAULT_POLL_S) -> None:
        if not poll_s > 0:
            raise ValueError(f"watch poll interval {poll_s} s is not positive")
        self.client = client
        self.prefixes = check_prefixes(prefixes)
        self.poll_s = poll_s
        self._last: dict[str, dict[str, bytes]] = {}  # prefix -> its last listing
        self._wake = threading.Event()
        self._closed = False
        self._due = 0.0  # monotonic time of the next listing
        self.listings = 0

    def nudge(self) -> None:
        """List at the next :meth:`wait` (a push said something changed)."""
        self._wake.set()

    def wait(self, timeout_s: float) -> list[Change]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self._closed:
            now = time.monotonic()
            if now >= self._due or self._wake.is_set():
                self._wake.clear()
                self._due = now + self.poll_s
                changes = self._poll()
                if changes:
                    return changes
            wait_s = min(self._due, deadline) - time.monotonic()
            if time.monotonic() >= deadline:
                return []
            self._wake.wait(max(0.0, wait_s))
        return []

    def _poll(self) -> list[Change]:
        changes: list[Change] = []
        for prefix in self.prefixes:
            self.listings += 1
            listing = self.client.list(prefix)  # MetadataError: the caller retries
            before = self._last.get(prefix)
            self._last[prefix] = listing
            if before is None:
                changes.append(Snapshot(prefix, dict(listing)))
                continue
            for key, value in listing.items():
                if before.get(key) != value:
                    changes.append(WatchEvent(key, value))
            changes.extend(WatchEvent(key, None) for key in before if key not in listing)
        return changes

    def close(self) -> None:
        self._closed = True
        self._wake.set()


class QueueWatch(Watch):
    """A pushed watch's reader side: producers (stream threads, a store's writers) call
    :meth:`push` and :meth:`fail`; :meth:`wait` hands their changes over in order."""

    pushed = True

    def __init__(self, prefixes: str | Sequence[str],
                 on_close: Callable[[], None] | None = None) -> None:
        self.prefixes = check_prefixes(prefixes)
        self._cond = threading.Condition()
        self._changes: list[Change] = []
        self._error: MetadataError | None = None
        self._closed = False
        self._on_close = on_close

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def matches(self, key: str) -> bool:
        """Whether ``key`` is under a watched prefix."""
        return key.startswith(self.prefixes)

    def push(self, changes: Iterable[Change]) -> None:
        """Hand changes to the reader (in order)."""
        with self._cond:
            if self._closed:
                return
            self._changes.extend(changes)
            self._error = None
            self._cond.notify_all()

    def fail(self, error: MetadataError) -> None:
        """Report that the service cannot be read now (raised once by :meth:`wait`)."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> list[Change]:
        with self._cond:
            if not self._changes and self._error is None and not self._closed:
                self._cond.wait(max(0.0, timeout_s))
            changes, self._changes = self._changes, []
            error, self._error = self._error, None
        if not changes and error is not None:
            raise error
        return changes

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._changes = []
            self._cond.notify_all()
        if self._on_close is not None:
            try:
                self._on_close()
            except Exception:  # noqa: BLE001 - closing must not raise
                _log.debug("closing a watch failed", exc_info=True)
