"""Client-side reservations: space a client places its own puts in.

A put through the master costs two round trips: the allocation, then the write to each
replica (the commit is sent without waiting). With a *reservation* the client asks the
master once for a range on ``replicas`` nodes (:class:`~kvctl.store.protocol.Reserve`),
places each small put inside it itself, writes, and reports the objects with
:class:`~kvctl.store.protocol.PutAt` (no reply): one round trip per put. The master keeps
the policy: it checks that each reported object lies in unused parts of the reservation,
takes unused parts back when the client ends it or after its TTL without use, and a
reservation is only good on connections to the master run (``instance``) that granted it.

:class:`Arenas` is the bookkeeping of one client: the current reservation, carving, and
ending a retired reservation only after its last put in flight has reported (a put still
writing must not find its reservation given back).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvctl.store import protocol as p

#: Default bytes a client asks to reserve (the master grants at most a share of a node).
DEFAULT_RESERVE_BYTES = 16 << 20
#: After a reservation is refused (full, too few nodes), puts go through the master for
#: this long before the client asks again.
RETRY_S = 1.0
#: A put placed in a reservation must have written and be reporting this long before the
#: master could give the reservation back (its TTL runs from the last report it took).
SAFETY_S = 2.0


class Arena:
    """One granted reservation: where its replicas are and how much is carved."""

    __slots__ = ("alignment", "ended", "inflight", "instance", "locations", "messages",
                 "retired", "rid", "safe_until", "size", "ttl_s", "use_by", "used")

    def __init__(self, grant: p.Reservation, instance: str, now: float) -> None:
        self.rid = grant.reservation
        self.locations = grant.locations
        self.size = min(loc.size for loc in grant.locations)
        self.alignment = max(1, grant.alignment)
        self.instance = instance
        self.ttl_s = grant.ttl_s
        self.use_by = self.safe_until = 0.0
        self.reported(now)
        self.used = 0
        self.inflight = 0
        #: PutAt messages sent for this reservation (the end names the total).
        self.messages = 0
        self.retired = False
        self.ended = False

    def reported(self, now: float) -> None:
        """The grant came, or a report is sent: the master keeps the reservation at least
        ``ttl_s`` from now. Carve nothing after half of that (leaving a put as long again
        to write and report), and count a put whose write ends after ``ttl_s - SAFETY_S``
        as failed (the space may be someone else's by the time its report arrives)."""
        self.use_by = now + self.ttl_s / 2
        self.safe_until = now + self.ttl_s - min(SAFETY_S, self.ttl_s / 4)

    def _aligned(self, size: int) -> int:
        a = self.alignment
        return max(a, -(-size // a) * a)

    def fits(self, sizes: Sequence[int]) -> bool:
        return self.used + sum(self._aligned(s) for s in sizes) <= self.size

    def carve(self, sizes: Sequence[int]) -> list[int]:
        """Offsets (from the start of each replica's range) for objects of ``sizes``."""
        offsets = []
        for size in sizes:
            offsets.append(self.used)
            self.used += self._aligned(size)
        return offsets


#: ``reserve(size, replicas)``: a grant and the master instance it came from, or ``None``.
Reserver = Callable[[int, int], "tuple[p.Reservation, str] | None"]


class Arenas:
    """The current reservation of one client (thread-safe).

    Args:
        reserve_bytes: size to ask for (0: never reserve; every put goes through the master).
        replicas: replicas per object.
        reserve: asks the master for a reservation.
        end: ``end(arena, count)`` tells the master a reservation is no longer used once it
            has taken ``count`` PutAt messages for it, this end included (best effort).
        clock: monotonic seconds.
    """

    def __init__(self, reserve_bytes: int, replicas: int, reserve: Reserver,
                 end: Callable[[Arena, int], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reserve_bytes = max(0, reserve_bytes)
        self.replicas = replicas
        self._reserve = reserve
        self._end = end
        self._clock = clock
        self._lock = threading.Lock()
        self._current: Arena | None = None
        self._retry_at = 0.0
        #: a Reserve is on its way (other threads put through the master meanwhile)
        self._reserving = False
        #: size of the last grant: a batch larger than that never waits for one
        self._granted = self.reserve_bytes
        self._closed = False

    def place(self, sizes: Sequence[int]) -> tuple[Arena, list[int]] | None:
        """Carve room for objects of ``sizes`` (all or none), or ``None``: put through the
        master (reservations off or refused, or the batch is over half a reservation).
        Every placement must be followed by exactly one :meth:`done`."""
        if not self.reserve_bytes or not sizes or sum(sizes) > self.reserve_bytes // 2:
            return None
        to_end: tuple[Arena, int] | None = None
        with self._lock:
            now = self._clock()
            arena = self._current
            if arena is not None and now <= arena.use_by and arena.fits(sizes):
                arena.inflight += 1
                return arena, arena.carve(sizes)
            if sum(sizes) > self._granted // 2 or self._reserving or now < self._retry_at \
                    or self._closed:
                return None  # would never fit / another thread is reserving / refused lately
            if arena is not None:
                to_end = self._retire(arena)
            self._reserving = True
        try:
            if to_end is not None:
                self._end(*to_end)
            got = self._reserve(self.reserve_bytes, self.replicas)  # not under the lock
        finally:
            with self._lock:
                self._reserving = False
        with self._lock:
            now = self._clock()
            if got is None:
                self._retry_at = now + RETRY_S
                return None
            arena = Arena(got[0], got[1], now)
            self._granted = arena.size
            placed = None
            if self._closed:  # the client closed meanwhile: give it straight back
                to_end = self._retire(arena)
            elif arena.fits(sizes):
                self._current = arena
                arena.inflight += 1
                placed = arena, arena.carve(sizes)
            else:
                self._current = arena
                to_end = None
        if to_end is not None:
            self._end(*to_end)
        return placed

    def done(self, arena: Arena, *, report: bool) -> int | None:
        """A put placed in ``arena`` is about to send its PutAt (``report``) or gave up.
        When it was the last one of a retired arena, the count of PutAt messages to end it
        with: the caller marks its report as the end, or (not reporting) sends an end of
        its own, counted in. Otherwise ``None``."""
        with self._lock:
            arena.inflight -= 1
            if report:
                arena.messages += 1
                arena.reported(self._clock())
            if not self._should_end(arena):
                return None
            if not report:
                arena.messages += 1
            return arena.messages

    def late(self, arena: Arena) -> bool:
        """Whether a put placed in ``arena`` that wrote until now must count as failed."""
        return self._clock() > arena.safe_until

    def retire(self, arena: Arena) -> None:
        """Place nothing more in ``arena`` (a write to it failed, or ended late); it ends
        with the report of its last put in flight."""
        with self._lock:
            to_end = self._retire(arena)
        if to_end is not None:
            self._end(*to_end)

    def drop(self, arena: Arena) -> None:
        """Forget ``arena`` without ending it (the master that granted it is gone)."""
        with self._lock:
            arena.retired = arena.ended = True
            if self._current is arena:
                self._current = None

    def close(self) -> None:
        """Retire the current reservation (ended now, or by its last put in flight)."""
        with self._lock:
            self._closed = True
            arena, self._current = self._current, None
            to_end = self._retire(arena) if arena is not None else None
        if to_end is not None:
            self._end(*to_end)

    def _retire(self, arena: Arena) -> tuple[Arena, int] | None:
        """Use ``arena`` no more; with no put in flight, the end to send (lock held)."""
        arena.retired = True
        if self._current is arena:
            self._current = None
        if not self._should_end(arena):
            return None
        arena.messages += 1
        return arena, arena.messages

    @staticmethod
    def _should_end(arena: Arena) -> bool:
        if arena.retired and arena.inflight == 0 and not arena.ended:
            arena.ended = True
            return True
        return False
