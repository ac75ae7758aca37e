"""Listener bounds shared by every kvctl server: accepts that survive running out of file
descriptors, and connections that have not proved anything yet kept few and short.

- :func:`accept` retries ``EMFILE``/``ENFILE``/``ENOBUFS``/``ENOMEM`` with a growing pause
  (a listener that stops accepting for good turns a burst of connections into an outage);
  it returns ``None`` only when the listener itself is closed.
- :class:`PendingLimit` bounds connections that have not authenticated (or, without a
  token, not finished their first request): one peer address may hold at most half of them
  (past that its own oldest is cut), past the total bound the *oldest* is cut, so a flood
  of idle or slow-drip sockets from one host neither locks out a peer on another nor one
  that logs in at once from the same host; each gets a deadline for the whole handshake,
  not per ``recv``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

_log = logging.getLogger("kvctl.net")

#: Errors that mean "out of a resource for now", not "the listener is gone".
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Errors a single failed accept may raise while the listener is fine.
TRANSIENT_ERRNOS = frozenset({errno.EINTR, errno.ECONNABORTED, errno.EPROTO, errno.EAGAIN})
PAUSE_MIN_S = 0.01
PAUSE_MAX_S = 1.0


def accept(listener: socket.socket, what: str, *,
           closed: threading.Event | None = None) -> tuple[socket.socket, Any] | None:
    """The next connection of ``listener``; ``None`` once it is closed (or ``closed`` set).

    Out of descriptors or memory, it waits (10 ms doubling to 1 s) and tries again, logging
    once per episode; the connections already open keep being served meanwhile.
    """
    pause = PAUSE_MIN_S
    warned = False
    while closed is None or not closed.is_set():
        try:
            return listener.accept()
        except OSError as exc:
            if exc.errno in TRANSIENT_ERRNOS:
                continue
            if exc.errno not in RESOURCE_ERRNOS:
                return None  # closed or shut down: the listener is gone
            if not warned:
                _log.warning("%s: cannot accept (%s); retrying while connections close",
                             what, exc.strerror)
                warned = True
            time.sleep(pause)
            pause = min(pause * 2, PAUSE_MAX_S)
    return None


class PendingLimit:
    """At most ``max_pending`` connections not yet trusted, each for at most ``deadline_s``;
    the oldest is cut for a new one. :meth:`close` stops the deadline sweeper.

    Args:
        max_pending: unauthenticated connections allowed at once.
        what: the listener, for log lines.
        deadline_s: how long a connection may take to become trusted, in total.
    """

    def __init__(self, max_pending: int, what: str, *, deadline_s: float = 10.0) -> None:
        if max_pending < 1 or deadline_s <= 0:
            raise ValueError("max_pending must be at least 1 and deadline_s positive")
        self.max_pending = max_pending
        self.what = what
        self.deadline_s = deadline_s
        self.max_per_peer = max(1, max_pending // 2)
        self._pending: OrderedDict[socket.socket, float] = OrderedDict()
        self._peer_of: dict[socket.socket, str] = {}
        self._per_peer: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.cut = 0

    def _sweep(self) -> None:
        while not self._stop.wait(min(0.5, self.deadline_s / 4)):
            limit = time.monotonic() - self.deadline_s
            with self._lock:
                late = [c for c, since in self._pending.items() if since < limit]
                for conn in late:
                    self._forget(conn)
                self.cut += len(late)
            for conn in late:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            if late:
                _log.warning("%s: cut %d connection(s) that did not log in within %g s",
                             self.what, len(late), self.deadline_s)

    def close(self) -> None:
        """Stop the sweeper (pending connections are left to their listener). Idempotent."""
        self._stop.set()

    def _forget(self, conn: socket.socket) -> None:
        """Drop ``conn`` from the books (lock held)."""
        self._pending.pop(conn, None)
        peer = self._peer_of.pop(conn, None)
        if peer is not None:
            left = self._per_peer.get(peer, 1) - 1
            if left > 0:
                self._per_peer[peer] = left
            else:
                self._per_peer.pop(peer, None)

    def admit(self, conn: socket.socket, peer: str = "") -> None:
        """Count ``conn`` (from address ``peer``) as pending. If ``peer`` then holds more
        than its share, its own oldest pending connection is cut; if all peers together
        hold too many, the oldest of all is."""
        victims: list[socket.socket] = []
        with self._lock:
            if conn in self._pending:  # pending again (between requests): keep its books
                self._pending.move_to_end(conn)
                self._pending[conn] = time.monotonic()
                return
            if peer and self._per_peer.get(peer, 0) >= self.max_per_peer:
                # that address alone holds half the room: it gives way, not everyone else
                own = next(c for c in self._pending if self._peer_of.get(c) == peer)
                self._forget(own)
                victims.append(own)
                self.cut += 1
            if self._sweeper is None and not self._stop.is_set():
                self._sweeper = threading.Thread(target=self._sweep, daemon=True,
                                                 name="kvctl-pending-sweep")
                self._sweeper.start()
            self._pending[conn] = time.monotonic()
            if peer:
                self._peer_of[conn] = peer
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            while len(self._pending) > self.max_pending:
                oldest = next(iter(self._pending))
                self._forget(oldest)
                victims.append(oldest)
                self.cut += 1
        for victim in victims:
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and closes it
        if victims:
            _log.warning("%s: %d connections waiting to log in; cut the oldest",
                         self.what, self.max_pending)

    def trusted(self, conn: socket.socket) -> None:
        """``conn`` authenticated (or finished its first request): no longer pending."""
        with self._lock:
            self._forget(conn)

    def pending(self) -> int:
        """Connections pending right now."""
        with self._lock:
            return len(self._pending)
