"""Time view of a pool simulation: prefill seconds saved, given compute and read bandwidth.

Model (stated in the output): recomputed tokens cost ``tokens / prefill_tokens_per_s``; pool
hits cost ``tokens x kv_bytes_per_token / (pool_read_gbytes_per_s x 10^9)`` (GB/s decimal), read
serially with no overlap with compute; local hits are free. The times are summed over the
whole workload (prefill-seconds, as if one instance did all the work).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvctl.errors import UsageError
from kvctl.models import ModelSpec
from kvctl.sim.replay import CellResult, Routing


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """Costs of recomputing and of reading back.

    Attributes:
        model: the model (for KV bytes per token).
        prefill_tokens_per_s: prefill throughput of one instance, tokens/s.
        pool_read_gbytes_per_s: pool read-back bandwidth into one instance, GB/s (10^9 bytes/s).
    """

    model: ModelSpec
    prefill_tokens_per_s: float
    pool_read_gbytes_per_s: float

    def __post_init__(self) -> None:
        for flag, value in (("--prefill-tps", self.prefill_tokens_per_s),
                            ("--pool-gbytes-per-s", self.pool_read_gbytes_per_s)):
            if not math.isfinite(value) or value <= 0:
                raise UsageError(f"{flag} {value} is not a positive number",
                                 f"give {flag} greater than 0")

    def recompute_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens."""
        return tokens / self.prefill_tokens_per_s

    def read_s(self, tokens: int) -> float:
        """Seconds to read the KV of ``tokens`` tokens from the pool."""
        return tokens * self.model.kv_bytes_per_token / (self.pool_read_gbytes_per_s * 1e9)


@dataclasses.dataclass(frozen=True)
class CellTime:
    """Prefill time of one cell, in seconds summed over the workload.

    Attributes:
        no_cache_s: every prompt token recomputed.
        recompute_s: the recomputed tokens.
        pool_read_s: reading the pool hits back.
        prefill_s: recompute_s + pool_read_s.
        saved_vs_no_cache_s: no_cache_s - prefill_s.
        saved_vs_no_pool_s: for pool cells, the same routing and local capacity without the
            pool minus this cell; ``None`` for cells without a pool.
    """

    routing: Routing
    local_blocks: int
    pool_blocks: int
    no_cache_s: float
    recompute_s: float
    pool_read_s: float
    prefill_s: float
    saved_vs_no_cache_s: float
    saved_vs_no_pool_s: float | None


def time_view(cells: Sequence[CellResult], costs: TimeModel) -> list[CellTime]:
    """Per cell prefill seconds and savings, in the order of ``cells``."""
    base: dict[tuple[Routing, int], float] = {}
    rows: list[CellTime] = []
    for cell in cells:
        recompute = costs.recompute_s(cell.recomputed_tokens)
        read = costs.read_s(cell.pool_hit_tokens)
        no_cache = costs.recompute_s(cell.prefill_tokens)
        prefill = recompute + read
        if not cell.pool_blocks:
            base[(cell.routing, cell.local_blocks)] = prefill
        no_pool = base.get((cell.routing, cell.local_blocks)) if cell.pool_blocks else None
        rows.append(CellTime(
            routing=cell.routing, local_blocks=cell.local_blocks, pool_blocks=cell.pool_blocks,
            no_cache_s=no_cache, recompute_s=recompute, pool_read_s=read, prefill_s=prefill,
            saved_vs_no_cache_s=no_cache - prefill,
            saved_vs_no_pool_s=None if no_pool is None else no_pool - prefill,
        ))
    return rows
