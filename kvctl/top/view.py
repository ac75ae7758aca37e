"""What ``kvctl store top`` shows, as plain data (rendered by
:mod:`kvctl.commands._top_screen`, printed by ``--once --json``)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class NodeRow:
    """One storage node (kvctl) or mounted segment (Mooncake).

    Attributes:
        name: node id, or Mooncake's segment name.
        state: ``alive``, ``suspect``, ``restored``, ``dead`` (kvctl); Mooncake's segment
            status (``OK`` when usable).
        dram_used_bytes / dram_capacity_bytes: memory used and offered, bytes.
        ssd_used_bytes / ssd_capacity_bytes: SSD tier used and offered, bytes (0: none).
        objects: objects with a replica on it (``None``: not reported).
        endpoint: where its data path is reached.
    """

    name: str
    state: str
    dram_used_bytes: int
    dram_capacity_bytes: int
    ssd_used_bytes: int = 0
    ssd_capacity_bytes: int = 0
    objects: int | None = None
    endpoint: str = ""


@dataclasses.dataclass(frozen=True)
class TierRow:
    """Capacity and usage of one tier over all nodes.

    Attributes:
        tier: ``dram``, ``ssd`` (kvctl); ``memory``, ``file``, ``nof`` (Mooncake).
        used_bytes / capacity_bytes: bytes.
        objects: objects with a copy in this tier (``None``: not reported).
    """

    tier: str
    used_bytes: int
    capacity_bytes: int
    objects: int | None = None


@dataclasses.dataclass(frozen=True)
class Lookups:
    """Gets over the interval, per second.

    Attributes:
        hits_per_s: keys found.
        misses_per_s: keys not found (never stored, or removed).
        evicted_per_s: keys not found because they were evicted, counted in the misses too
            (``None``: not known; Mooncake's misses include these).
        evictions_per_s: objects the store evicted.
        hit_ratio: hits / lookups (``None``: no lookups).
    """

    hits_per_s: float
    misses_per_s: float
    evicted_per_s: float | None
    evictions_per_s: float
    hit_ratio: float | None


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One operation over the interval.

    Attributes:
        op: the operation's name as the server counts it.
        ops_per_s: requests per second.
        p99_s: 99th percentile latency, seconds (``None``: not measured, or none served).
        errors_per_s: requests per second that ended in an error.
    """

    op: str
    ops_per_s: float
    p99_s: float | None
    errors_per_s: float


@dataclasses.dataclass(frozen=True)
class ErrorRow:
    """An error outcome the server counted.

    Attributes:
        op / outcome: the operation and its error (an error code, or ``failure``).
        recent: how many in the last interval.
        total: how many since the server started.
        age_s: seconds since one was last seen by this view (``None``: not seen while
            watching; the count is older).
    """

    op: str
    outcome: str
    recent: int
    total: int
    age_s: float | None = None


@dataclasses.dataclass(frozen=True)
class TopView:
    """Everything one frame of ``kvctl store top`` shows.

    Attributes:
        backend: ``kvctl`` or ``mooncake``.
        master: the master's ``HOST:PORT``.
        metrics_url: the endpoint the rates came from (``None``: none, so no rates).
        health: the master's own word on its state.
        interval_s: seconds the rates are measured over (0: a first reading, no rates yet).
        objects: objects (keys) stored.
        nodes / tiers / ops / errors: see the row types.
        lookups: hit, miss and eviction rates (``None``: no rates).
        problems: what needs attention now (a node down, an SSD full, a master not
            serving), one line each.
        notes: why something is missing (no metrics endpoint, a metric not exported).
    """

    backend: str
    master: str
    metrics_url: str | None
    health: str
    interval_s: float
    objects: int
    nodes: tuple[NodeRow, ...]
    tiers: tuple[TierRow, ...]
    lookups: Lookups | None
    ops: tuple[OpRow, ...]
    errors: tuple[ErrorRow, ...]
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping (the ``store.top`` document's payload)."""
        return dataclasses.asdict(self)
