"""Reservations: space a client places its own puts in (one round trip per put).

Rules (tests/store/test_reservations.py):

- At most ``reservation_share`` of a node, on ``replicas`` distinct alive nodes, and all
  unused reservation space of a node at most ``reservations_share`` of it; never evicted.
- Objects the client reports inside it (:class:`~kvctl.store.protocol.PutAt`) must lie in
  still-unused parts of it, for the namespace that asked for it; anything else is dropped
  and logged.
- The rest is given back when the client ends it or after ``pending_ttl_s`` without use.
- A suspect node stays in the reservations it is part of (puts reported there are kept
  with its objects, read from the other nodes), but puts reported while no node of the
  reservation is alive are refused (they would be unreadable: the client puts them
  through the master, on live nodes); a dropped node leaves them.
"""

from __future__ import annotations

import logging
import secrets

from kvctl.store import protocol as p
from kvctl.store.allocator import AllocatorInvariantError, ExtentAllocator
from kvctl.store.master.base import MasterBase, err
from kvctl.store.master.config import MIN_RESERVATION_BYTES
from kvctl.store.master.records import Node, Obj, Replica, Reservation

_log = logging.getLogger("kvctl.store.master")


class ReservationsMixin(MasterBase):
    """Grant, fill and end reservations."""

    def reserve(self, msg: p.Reserve, namespace: str = "") -> p.Reservation | p.ErrorInfo:
        """Set aside up to ``msg.size`` bytes on ``msg.replicas`` distinct live nodes for a
        client to place puts in (evicting as a put would); capped at ``reservation_share``
        of the smallest chosen node."""
        replicas = msg.replicas or self.config.default_replicas
        with self._cond:
            now = self._clock()
            live = [n for n in self._nodes.values() if n.alive]
            if msg.size <= 0 or replicas < 1:
                return err("bad_request", f"reservation of {msg.size} bytes on {replicas} "
                           "replica(s)", "ask for a positive size and 1 or more replicas")
            unsure = self._nodes_refused("puts")
            if unsure is not None:
                return unsure
            refused = self.state.refusal()
            if refused is not None:
                return err("unavailable", refused, "put through the master later")
            if replicas > len(live):
                return err("unavailable", f"{replicas} replica(s) asked for a reservation, "
                           f"{len(live)} live node(s)",
                           "start more storage nodes or ask for fewer replicas")
            live.sort(key=lambda n: n.alloc.free_bytes, reverse=True)
            chosen = live[:replicas]
            held: dict[Node, int] = {}
            for res in self._reservations.values():
                for node in res.starts:
                    held[node] = held.get(node, 0) + res.free.free_bytes
            cap = min(min(int(n.alloc.capacity_bytes * self.config.reservation_share),
                          int(n.alloc.capacity_bytes * self.config.reservations_share)
                          - held.get(n, 0)) for n in chosen)
            align = chosen[0].alloc.alignment_bytes
            size = min(msg.size, cap) // align * align
            if size < min(msg.size, MIN_RESERVATION_BYTES):
                return err("full", "no room for a reservation (nodes too small, or their "
                           "share for reservations is taken)",
                           "put through the master (StoreClient does when this fails)")
            placed = self._place(chosen, size, replicas, now)
            if placed is None:
                return err("full", f"no room for a reservation of {size} bytes",
                           "put through the master (StoreClient does when this fails)")
            rid = secrets.randbits(63)  # not guessable, never reused across restarts
            while rid in self._reservations:
                rid = secrets.randbits(63)
            self._reservations[rid] = Reservation(
                rid, namespace, size, dict(placed),
                ExtentAllocator(size, alignment_bytes=align), now + self.config.pending_ttl_s)
            for node, _ in placed:
                self._watermark(node, now)
            return p.Reservation(
                reservation=rid, alignment=align, ttl_s=self.config.pending_ttl_s,
                locations=[p.Location(n.node_id, n.segment, off, size) for n, off in placed])

    def put_at(self, msg: p.PutAt, namespace: str = "") -> list[tuple[int, p.ErrorInfo]]:
        """Install objects a client wrote inside its reservation (see :class:`p.PutAt`); the
        index and reason of each item not installed (logged too when the client asked for
        no answer). Refused, and nothing of them visible: items for a reservation that is
        gone (ended, expired, its nodes dropped) or another namespace's, outside its
        unused parts, or while none of its nodes is alive (a suspect node's bytes are
        unreadable: the client puts them again through the master, on live nodes)."""
        keys = msg.keys
        with self._cond:
            now = self._clock()
            res = self._reservations.get(msg.reservation)
            if res is None or res.namespace != namespace:
                if keys and not msg.ack:
                    _log.warning("%d put(s) for reservation %x dropped: it is gone (ended, "
                                 "unused past its TTL, or its nodes were dropped)",
                                 len(keys), msg.reservation)
                return _all(keys, err("unavailable", f"reservation {msg.reservation:x} is "
                                      "gone (ended, unused past its TTL, or its nodes were "
                                      "dropped)", "put through the master"))
            res.expires = now + self.config.pending_ttl_s
            res.seen += 1
            if msg.end:
                res.expected = max(1, msg.count)
            refused: list[tuple[int, p.ErrorInfo]] = []
            down = [n for n in res.starts if not n.alive]
            n = len(keys)
            if len(down) == len(res.starts) and n:  # readable from none of its nodes
                _log.warning("%d put(s) in reservation %x refused: node(s) %s not alive", n,
                             res.rid, ", ".join(f"{d.node_id} ({d.state})" for d in down))
                refused = _all(keys, err(
                    "unavailable", f"reservation {res.rid:x} is on node(s) not answering "
                    "heartbeats: " + ", ".join(f"{d.node_id} ({d.state})" for d in down),
                    "put through the master (StoreClient does), on live nodes"))
                n = 0
            elif not len(msg.sizes) == len(msg.checksums) == len(msg.offsets) == n:
                _log.warning("malformed put_at for reservation %x dropped", res.rid)
                refused = _all(keys, err("bad_request", "put_at with lists of unequal length"))
                n = 0
            for i in range(n):
                key, size, csum, rel = keys[i], msg.sizes[i], msg.checksums[i], msg.offsets[i]
                if p.check_key(key) is not None or size < 0 or not 0 <= csum < 1 << 64:
                    _log.warning("put_at of a bad key, size or checksum dropped")
                    refused.append((i, err("bad_request", "bad key, size or checksum")))
                    continue
                try:
                    res.free.reserve(rel, size)  # inside the unused parts, aligned
                except (AllocatorInvariantError, ValueError):
                    _log.warning("put_at of %r at %d (+%d) is outside reservation %x's unused "
                                 "space; dropped", key, rel, size, res.rid)
                    refused.append((i, err("bad_request", f"{key!r} at {rel} (+{size}) is "
                                           f"outside reservation {res.rid:x}'s unused space",
                                           "put through the master")))
                    continue
                self._install(Obj(key, size, csum, next(self._versions), tuple(
                    Replica(node, start + rel) for node, start in res.starts.items()),
                    created=now), now)
            if res.expected and res.seen >= res.expected:
                self._end_reservation(res)
            return refused

    def _end_reservation(self, res: Reservation) -> None:
        """Give the unused parts of ``res`` back to its nodes (lock held)."""
        del self._reservations[res.rid]
        for node, start in res.starts.items():
            if node.dropped:
                continue
            for off, length in res.free.extents():
                node.alloc.free(start + off, length)

    def _leave_reservations(self, node: Node) -> None:
        """``node`` was dropped: reservations go on without it (or end, if it was alone)."""
        for res in list(self._reservations.values()):
            res.starts.pop(node, None)
            if not res.starts:
                del self._reservations[res.rid]

    def _expire_reservations(self, now: float) -> None:
        for res in [r for r in self._reservations.values() if r.expires <= now]:
            _log.info("reservation %x unused for %.0f s; giving its space back", res.rid,
                      self.config.pending_ttl_s)
            self._end_reservation(res)


def _all(keys: list[str], why: p.ErrorInfo) -> list[tuple[int, p.ErrorInfo]]:
    """Every key of a report refused for the same reason."""
    return [(i, why) for i in range(len(keys))]
