"""The master's policy knobs and fixed limits."""

from __future__ import annotations

import dataclasses

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
        node_timeout_s: heartbeat silence after which a node is *suspect* (no new
            placements, reads go to other replicas, its objects are kept), seconds.
        node_grace_s: heartbeat silence after which a suspect node is dropped with its
            objects, seconds (never less than ``node_timeout_s``; a ``DropNode`` request
            drops one at once).
        max_observed_step_s: the most one gap between two of the master's own observations
            (its housekeeping runs every 0.1 s) counts toward a node's silence, seconds:
            a longer gap is the master's own pause (garbage collection, a stop, a busy
            lock), not the node's. Capped at half of ``node_timeout_s``.
        slice_objects: objects handled per hold of the lock by work that grows with the
            store (dropping a node, watermark eviction, snapshots); the lock is released
            between slices.
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
    node_grace_s: float = 60.0
    max_observed_step_s: float = 1.0
    slice_objects: int = 2048
    pending_ttl_s: float = 30.0
    load_timeout_s: float = 5.0
    default_replicas: int = 1
    ssd_full_retry_s: float = 5.0
    reservation_share: float = 1 / 16
    reservations_share: float = 1 / 4

    def check(self) -> None:
        """Raise ``ValueError`` naming the first knob out of range."""
        if not 0 < self.high_watermark <= 1 or not (
                0 <= self.evict_ratio < self.high_watermark):
            raise ValueError("need 0 < high_watermark <= 1 and 0 <= evict_ratio < high_watermark")
        if not (self.node_timeout_s > 0 and self.node_grace_s > 0):
            raise ValueError("need node_timeout_s > 0 and node_grace_s > 0")
        if self.max_observed_step_s <= 0 or self.slice_objects < 1:
            raise ValueError("need max_observed_step_s > 0 and slice_objects >= 1")

    @property
    def drop_after_s(self) -> float:
        """Silence after which a node is dropped: the grace, never less than the timeout."""
        return max(self.node_grace_s, self.node_timeout_s)

    @property
    def observed_step_s(self) -> float:
        """The most one observation gap counts toward a node's silence, seconds."""
        return min(self.max_observed_step_s, self.node_timeout_s / 2)
