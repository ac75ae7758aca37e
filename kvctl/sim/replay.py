"""Replay a chat workload against N instances with local LRU prefix caches and a shared pool.

Semantics of one turn (the reference model behind the published table):

1. The turn's *prompt* is the whole conversation so far plus the new user message; all of it
   counts as prefill tokens.
2. The instance (chosen by the routing) looks up the prompt's block keys in its local cache
   and takes the longest cached prefix, in whole blocks; from there it continues in the pool
   (``contains_many``) and reads that run back (``read_many``). The rest is recomputed.
3. After the turn the instance caches the full blocks of the prompt (with ``AnswerKv.CACHED``,
   of prompt + answer), evicting least recent blocks; the pool receives every block the
   instance computed (it was not a hit).

With ``AnswerKv.RECOMPUTED`` (the default and the published model) the answer's KV, made by
decode, is never offered to a cache, so the next turn prefills it again: each turn's new user
message and previous answer can never hit. See :func:`floor`.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Callable, Sequence

from kvctl.cache import LruCache
from kvctl.errors import UsageError
from kvctl.sim.pool import PoolBackend
from kvctl.sim.workload import Segment, Session, Workload


class Routing(enum.StrEnum):
    """How a turn picks its instance."""

    RANDOM = "random"
    #: A session always goes to the same instance (session index modulo instances).
    CACHE_AWARE = "cache-aware"


class AnswerKv(enum.StrEnum):
    """What happens to the KV of a decoded answer."""

    #: Not offered to any cache: the next turn prefills the answer again (published model).
    RECOMPUTED = "recomputed"
    #: Cached with the prompt: the next turn can hit it.
    CACHED = "cached"


@dataclasses.dataclass(frozen=True)
class CellResult:
    """Outcome of one routing x pool x local-capacity replay (token counts over all turns).

    ``recompute_fraction`` = recomputed_tokens / prefill_tokens.
    """

    routing: Routing
    local_blocks: int
    pool_blocks: int
    prefill_tokens: int
    local_hit_tokens: int
    pool_hit_tokens: int
    recomputed_tokens: int
    recompute_fraction: float

    @property
    def label(self) -> str:
        """``random``, ``random + shared pool``, ..."""
        return f"{self.routing.value}{' + shared pool' if self.pool_blocks else ''}"


@dataclasses.dataclass(frozen=True)
class Floor:
    """Tokens no cache can ever supply: the replay with one unbounded cache shared by all.

    Attributes:
        new_user_message_tokens: each turn's user message, never seen before.
        previous_answer_tokens: the answer of the turn before, when its KV is not cached.
        system_prompt_tokens: first use of each system prompt.
        partial_block_tokens: tokens of earlier turns left in a partial (uncached) block.
        recomputed_tokens: their sum.
        prefill_tokens: Σ prompt tokens.
        fraction: recomputed_tokens / prefill_tokens.
    """

    new_user_message_tokens: int
    previous_answer_tokens: int
    system_prompt_tokens: int
    partial_block_tokens: int
    recomputed_tokens: int
    prefill_tokens: int
    fraction: float


PoolFactory = Callable[[int], PoolBackend]


def _cached_end(session: Session, turn: int, answer_kv: AnswerKv) -> int:
    if answer_kv is AnswerKv.CACHED:
        return session.answer_ends[turn]
    return session.prompt_ends[turn]


def replay(
    workload: Workload,
    *,
    routing: Routing,
    instances: int,
    local_blocks: int,
    pool: PoolBackend | None,
    pool_blocks: int = 0,
    answer_kv: AnswerKv = AnswerKv.RECOMPUTED,
) -> CellResult:
    """Replay ``workload`` once and count hits and recomputed prefill tokens.

    Args:
        routing: random (seeded from the workload seed) or cache-aware.
        instances: number of inference instances.
        local_blocks: each instance's prefix-cache capacity in blocks (0: none).
        pool: the shared pool, or ``None`` for none.
        pool_blocks: the pool's capacity, recorded in the result.
    """
    if instances <= 0:
        raise UsageError(f"--instances {instances} is not positive", "give --instances 1 or more")
    if local_blocks < 0:
        raise UsageError(
            f"local cache of {local_blocks} blocks is negative", "give --local-blocks 0 or more"
        )
    block = workload.spec.block_size
    caches: list[LruCache[bytes]] | None = (
        [LruCache(local_blocks) for _ in range(instances)] if local_blocks else None
    )
    route_rng = random.Random(f"route:{workload.spec.seed}")
    local_hit_blocks = pool_hit_blocks = recomputed = total = 0
    for arrival in workload.arrivals:
        session = workload.sessions[arrival.session]
        if routing is Routing.CACHE_AWARE:
            where = arrival.session % instances
        else:
            where = route_rng.randrange(instances)
        keys = session.keys
        prompt_tokens = session.prompt_ends[arrival.turn]
        prompt_blocks = prompt_tokens // block
        hit = 0
        if caches is not None:
            cache = caches[where]
            while hit < prompt_blocks and cache.lookup(keys[hit]):
                hit += 1
        local_hit = hit
        if pool is not None and hit < prompt_blocks:
            present = pool.contains_many(keys[hit:prompt_blocks])
            run = next((i for i, ok in enumerate(present) if not ok), len(present))
            if run:
                pool.read_many(keys[hit : hit + run])
                hit += run
        total += prompt_tokens
        recomputed += prompt_tokens - hit * block
        local_hit_blocks += local_hit
        pool_hit_blocks += hit - local_hit
        cached_blocks = _cached_end(session, arrival.turn, answer_kv) // block
        if caches is not None:
            cache = caches[where]
            for key in keys[:cached_blocks]:
                cache.insert(key)
        if pool is not None and hit < cached_blocks:
            pool.insert_many(keys[hit:cached_blocks])
    return CellResult(
        routing=routing,
        local_blocks=local_blocks,
        pool_blocks=pool_blocks if pool is not None else 0,
        prefill_tokens=total,
        local_hit_tokens=local_hit_blocks * block,
        pool_hit_tokens=pool_hit_blocks * block,
        recomputed_tokens=recomputed,
        recompute_fraction=recomputed / total if total else 0.0,
    )


def floor(workload: Workload, answer_kv: AnswerKv = AnswerKv.RECOMPUTED) -> Floor:
    """What every turn must recompute even with one unbounded cache shared by all instances."""
    block = workload.spec.block_size
    seen: set[bytes] = set()
    counts = dict.fromkeys(("user", "answer", "system", "partial"), 0)
    total = 0
    for arrival in workload.arrivals:
        session = workload.sessions[arrival.session]
        keys = session.keys
        prompt_tokens = session.prompt_ends[arrival.turn]
        prompt_blocks = prompt_tokens // block
        hit = 0
        while hit < prompt_blocks and keys[hit] in seen:
            hit += 1
        total += prompt_tokens
        new_user_start = prompt_tokens - workload.spec.user_tokens
        _classify(session, new_user_start, hit * block, prompt_tokens, counts)
        seen.update(keys[: _cached_end(session, arrival.turn, answer_kv) // block])
    missed = sum(counts.values())
    return Floor(
        new_user_message_tokens=counts["user"],
        previous_answer_tokens=counts["answer"],
        system_prompt_tokens=counts["system"],
        partial_block_tokens=counts["partial"],
        recomputed_tokens=missed,
        prefill_tokens=total,
        fraction=missed / total if total else 0.0,
    )


def _classify(
    session: Session, new_user_start: int, start: int, end: int, counts: dict[str, int]
) -> None:
    """Add the tokens of ``[start, end)`` of ``session`` to their category in ``counts``."""
    for seg_start, seg_end, kind in session.segments:
        if seg_start >= end:
            break
        overlap = min(seg_end, end) - max(seg_start, start)
        if overlap <= 0:
            continue
        if kind is Segment.SYSTEM:
            counts["system"] += overlap
        elif kind is Segment.USER and seg_end == end:
            counts["user"] += overlap
        elif kind is Segment.ANSWER and seg_end == new_user_start:
            counts["answer"] += overlap
        else:
            counts["partial"] += overlap


def run_grid(
    workload: Workload,
    *,
    instances: int,
    local_blocks: Sequence[int],
    pool_blocks: int,
    pool_factory: PoolFactory,
    answer_kv: AnswerKv = AnswerKv.RECOMPUTED,
    on_cell: Callable[[CellResult], None] | None = None,
) -> list[CellResult]:
    """Every routing x (no pool, pool) x local capacity, in that order."""
    cells: list[CellResult] = []
    for routing in Routing:
        for use_pool in (False, True):
            for capacity in local_blocks:
                pool = pool_factory(pool_blocks) if use_pool else None
                cell = replay(
                    workload, routing=routing, instances=instances, local_blocks=capacity,
                    pool=pool, pool_blocks=pool_blocks, answer_kv=answer_kv,
                )
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells
