"""Replay a trace of prefix-chained block ids against LRU caches (``kvctl sim trace``).

Semantics, the same as ``kvctl sim pool`` (:mod:`kvctl.sim.replay`), stated in
docs/traffic.md:

1. Requests are replayed in file (arrival) order; timestamps must not decrease.
2. A request's hit is the longest prefix of its ``hash_ids`` found in its instance's local
   cache, continued in the shared pool (when there is one). In tokens: ``min(hits x
   block_tokens, input_length)`` (a trace's last id may stand for a partial block).
3. Afterwards every id of the request is inserted into (or touched in) the local cache, in
   order; least recent ids go first. The pool is offered the ids that were not hits; a pool
   hit counts as a use.
4. The *ideal* is one cache of unbounded size that sees every request.

Every configuration is replayed in one pass over the file: memory grows with the caches'
state and one count per distinct id (the ideal's and the reuse table's), never with the
number of requests. The caches here are :class:`_IdLru`, an LRU over ``int`` ids on one
``OrderedDict``: the same eviction order as :class:`kvctl.cache.LruCache` (a test checks the
two agree), several times faster per id.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal

from kvctl.errors import UsageError
from kvctl.sim.traceformat import bad_record, trace_format

Unlimited = Literal["unlimited"]
UNLIMITED: Unlimited = "unlimited"


class TraceRouting(enum.StrEnum):
    """How a request picks its instance."""

    #: One instance: nothing to route.
    SINGLE = "single"
    #: Any instance, uniformly (seeded by ``--seed``).
    RANDOM = "random"
    #: Request i goes to instance i mod K.
    ROUND_ROBIN = "round-robin"
    #: The instance whose local cache holds the longest prefix of the request; ties go to
    #: the instance given the fewest input tokens so far, then to the lowest index.
    PREFIX_AWARE = "prefix-aware"


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """One cluster to replay.

    Attributes:
        capacity_tokens: local prefix cache per instance, tokens (0: none).
        instances: inference instances.
        routing: how requests pick an instance.
        pool_tokens: shared pool, tokens; ``None``: no pool; ``"unlimited"``: never evicts.
    """

    capacity_tokens: int
    instances: int = 1
    routing: TraceRouting = TraceRouting.SINGLE
    pool_tokens: int | Unlimited | None = None

    @property
    def label(self) -> str:
        """``1 x 3,000,000``, ``8 x 3,000,000 prefix-aware + pool 24,000,000``, ..."""
        head = f"{self.instances} x {self.capacity_tokens:,}"
        if self.routing is not TraceRouting.SINGLE:
            head += f" {self.routing.value}"
        if self.pool_tokens is None:
            return head
        pool = self.pool_tokens if isinstance(self.pool_tokens, str) else f"{self.pool_tokens:,}"
        return f"{head} + pool {pool}"


@dataclasses.dataclass(frozen=True)
class ReuseBucket:
    """Distinct block ids used ``min_uses`` to ``max_uses`` times (``None``: no upper bound).

    Attributes:
        ids: how many distinct ids; id_share: of all distinct ids.
        uses: block uses of those ids (occurrences in ``hash_ids``: an id in n requests is
            n uses, an id twice in one request 2); use_share: of all uses.
    """

    label: str
    min_uses: int
    max_uses: int | None
    ids: int
    id_share: float
    uses: int
    use_share: float


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    """The trace itself.

    Attributes:
        duration_s: last timestamp minus first, seconds.
        arrival_rate_per_s: requests / duration_s (0 when the duration is 0).
        ideal_hit_tokens / ideal_hit_ratio: prefix hits of one unbounded cache, tokens and
            share of input tokens.
        distinct_ids / block_uses: distinct block ids, and ids over all requests.
        any_position_id_ratio: share of block uses whose id was seen before, prefix or not.
        reuse: distinct ids by how often they are used.
    """

    path: str
    format: str
    block_tokens: int
    requests: int
    duration_s: float
    arrival_rate_per_s: float
    input_tokens: int
    output_tokens: int
    input_tokens_mean: float
    output_tokens_mean: float
    ideal_hit_tokens: int
    ideal_hit_ratio: float
    distinct_ids: int
    block_uses: int
    any_position_id_ratio: float
    reuse: list[ReuseBucket]


@dataclasses.dataclass(frozen=True)
class InstanceResult:
    """One instance of a configuration (tokens summed over its requests)."""

    index: int
    requests: int
    input_tokens: int
    local_hit_tokens: int
    pool_hit_tokens: int
    recompute_tokens: int
    hit_ratio: float


@dataclasses.dataclass(frozen=True)
class TimePoint:
    """Hit ratio of the requests arriving in ``[start_s, start_s + width_s)`` from the first."""

    start_s: float
    width_s: float
    requests: int
    hit_ratio: float


@dataclasses.dataclass(frozen=True)
class TraceResult:
    """Outcome of one configuration.

    Attributes:
        hit_ratio: (local + pool hit tokens) / input tokens.
        pool_hit_tokens: tokens read back from the pool (the *read-back* tokens).
        recompute_tokens: input tokens that were not hits (prefilled).
        timeline: hit ratio over time, in equal windows (at most 256).
    """

    label: str
    capacity_tokens: int
    instances: int
    routing: TraceRouting
    pool_tokens: int | Unlimited | None
    input_tokens: int
    local_hit_tokens: int
    pool_hit_tokens: int
    recompute_tokens: int
    hit_ratio: float
    per_instance: list[InstanceResult]
    timeline: list[TimePoint]


@dataclasses.dataclass(frozen=True)
class TraceReplay:
    """Everything the replay measured."""

    summary: TraceSummary
    results: list[TraceResult]
    ideal_timeline: list[TimePoint]


class _IdLru:
    """LRU set of int ids with a capacity in ids (the order of :class:`LruCache`)."""

    __slots__ = ("capacity", "ids")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ids: collections.OrderedDict[int, None] = collections.OrderedDict()

    def hit_run(self, keys: Sequence[int], start: int) -> int:
        """How many of ``keys[start:]`` are held, from ``start`` on; they become most recent."""
        ids = self.ids
        touch = ids.move_to_end
        run = 0
        for key in keys[start:] if start else keys:
            if key not in ids:
                break
            touch(key)
            run += 1
        return run

    def insert_from(self, keys: Sequence[int], start: int) -> None:
        """Insert (or touch) ``keys[start:]`` in order, then evict least recent past capacity.

        Evicting once at the end leaves the same ids in the same order as evicting after
        every insert: both keep the ``capacity`` most recently used.
        """
        ids = self.ids
        touch = ids.move_to_end
        for key in keys[start:] if start else keys:
            if key in ids:
                touch(key)
            else:
                ids[key] = None
        excess = len(ids) - self.capacity
        if excess > 0:
            drop = ids.popitem
            for _ in range(excess):
                drop(False)


class _Timeline:
    """Hit and input tokens in time windows whose width doubles to stay at most 256."""

    __slots__ = ("hits", "inputs", "origin", "requests", "width_ms")
    LIMIT = 256

    def __init__(self) -> None:
        self.width_ms = 1000.0
        self.origin: float | None = None
        self.hits: list[int] = []
        self.inputs: list[int] = []
        self.requests: list[int] = []

    def add(self, timestamp_ms: float, hit: int, tokens: int) -> None:
        if self.origin is None:
            self.origin = timestamp_ms
        slot = int((timestamp_ms - self.origin) // self.width_ms)
        while slot >= self.LIMIT:
            self._halve()
            slot = int((timestamp_ms - self.origin) // self.width_ms)
        grow = slot + 1 - len(self.hits)
        if grow > 0:
            self.hits.extend([0] * grow)
            self.inputs.extend([0] * grow)
            self.requests.extend([0] * grow)
        self.hits[slot] += hit
        self.inputs[slot] += tokens
        self.requests[slot] += 1

    def _halve(self) -> None:
        def pairs(values: list[int]) -> list[int]:
            return [sum(values[i:i + 2]) for i in range(0, len(values), 2)]

        self.hits, self.inputs = pairs(self.hits), pairs(self.inputs)
        self.requests = pairs(self.requests)
        self.width_ms *= 2

    def points(self) -> list[TimePoint]:
        width = self.width_ms / 1000
        return [TimePoint(i * width, width, n, h / t if t else 0.0)
                for i, (h, t, n) in enumerate(zip(self.hits, self.inputs, self.requests,
                                                  strict=True))]


class _Cluster:
    """The state of one configuration during the replay."""

    def __init__(self, config: TraceConfig, block_tokens: int, seed: int) -> None:
        self.config = config
        k = config.instances
        capacity = config.capacity_tokens // block_tokens
        self.caches = [_IdLru(capacity) for _ in range(k)] if capacity else None
        pool = config.pool_tokens
        self.pool_set: set[int] | None = set() if pool == UNLIMITED else None
        self.pool_lru = (_IdLru(pool // block_tokens) if isinstance(pool, int) and pool > 0
                         else None)
        self.rng = random.Random(f"route:{seed}")
        self.count = 0
        self.requests = [0] * k
        self.inputs = [0] * k
        self.local = [0] * k
        self.pooled = [0] * k
        self.timeline = _Timeline()

    def _route(self, keys: Sequence[int]) -> int:
        routing, k = self.config.routing, self.config.instances
        if k == 1:
            return 0
        if routing is TraceRouting.ROUND_ROBIN:
            return self.count % k
        if routing is TraceRouting.PREFIX_AWARE and self.caches is not None:
            best, best_run = 0, -1
            for index, cache in enumerate(self.caches):
                ids = cache.ids
                run = 0
                for key in keys:
                    if key not in ids:
                        break
                    run += 1
                if run > best_run or (run == best_run and self.inputs[index] < self.inputs[best]):
                    best, best_run = index, run
            return best
        if routing is TraceRouting.PREFIX_AWARE:  # no local caches: least loaded
            return min(range(k), key=self.inputs.__getitem__)
        return self.rng.randrange(k)

    def feed(self, timestamp_ms: float, tokens: int, keys: Sequence[int], block: int) -> None:
        where = self._route(keys)
        self.count += 1
        n = len(keys)
        local = 0
        if self.caches is not None:
            local = self.caches[where].hit_run(keys, 0)
        hit = local
        if hit < n:
            if self.pool_lru is not None:
                hit += self.pool_lru.hit_run(keys, hit)
                self.pool_lru.insert_from(keys, hit)
            elif self.pool_set is not None:
                pool = self.pool_set
                for key in keys[hit:]:
                    if key not in pool:
                        break
                    hit += 1
                pool.update(keys[hit:])
        if self.caches is not None and local < n:
            self.caches[where].insert_from(keys, local)
        local_tokens = min(local * block, tokens)
        hit_tokens = min(hit * block, tokens)
        self.requests[where] += 1
        self.inputs[where] += tokens
        self.local[where] += local_tokens
        self.pooled[where] += hit_tokens - local_tokens
        self.timeline.add(timestamp_ms, hit_tokens, tokens)

    def result(self) -> TraceResult:
        c = self.config
        per = [InstanceResult(i, self.requests[i], self.inputs[i], self.local[i],
                              self.pooled[i], self.inputs[i] - self.local[i] - self.pooled[i],
                              _ratio(self.local[i] + self.pooled[i], self.inputs[i]))
               for i in range(c.instances)]
        total, local, pooled = sum(self.inputs), sum(self.local), sum(self.pooled)
        return TraceResult(
            label=c.label, capacity_tokens=c.capacity_tokens, instances=c.instances,
            routing=c.routing, pool_tokens=c.pool_tokens, input_tokens=total,
            local_hit_tokens=local, pool_hit_tokens=pooled,
            recompute_tokens=total - local - pooled, hit_ratio=_ratio(local + pooled, total),
            per_instance=per, timeline=self.timeline.points(),
        )


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


#: Reuse buckets: (label, fewest uses, most uses or None).
_REUSE = (("1", 1, 1), ("2-10", 2, 10), ("11-100", 11, 100), ("101-1,000", 101, 1000),
          ("1,001-10,000", 1001, 10_000), ("over 10,000", 10_001, None))


def _reuse(counts: collections.Counter[int]) -> list[ReuseBucket]:
    ids = [0] * len(_REUSE)
    uses = [0] * len(_REUSE)
    for n in counts.values():
        slot = 0 if n <= 1 else 1 if n <= 10 else 2 if n <= 100 else 3 if n <= 1000 \
            else 4 if n <= 10_000 else 5
        ids[slot] += 1
        uses[slot] += n
    total_ids, total_uses = sum(ids), sum(uses)
    return [ReuseBucket(label, low, high, ids[i], _ratio(ids[i], total_ids), uses[i],
                        _ratio(uses[i], total_uses))
            for i, (label, low, high) in enumerate(_REUSE)]


#: Most instances a configuration may have: each is a cache and a row of every result, so
#: 10^6 of them took 2.4 GB and 49 s on a 2-request trace before a single request counted.
MAX_INSTANCES = 10_000


def check_configs(configs: Sequence[TraceConfig]) -> None:
    """Refuse impossible configurations before reading the trace.

    Raises:
        UsageError: a negative capacity, no instances or more than :data:`MAX_INSTANCES`, a
            non-positive pool, or none at all.
    """
    if not configs:
        raise UsageError("nothing to replay", "give --capacity-tokens N (e.g. 3000000)")
    for c in configs:
        if c.capacity_tokens < 0:
            raise UsageError(f"--capacity-tokens {c.capacity_tokens} is negative",
                             "give 0 (no local cache) or more tokens")
        if c.instances <= 0:
            raise UsageError(f"--instances {c.instances} is not positive",
                             "give --instances 1 or more")
        if c.instances > MAX_INSTANCES:
            raise UsageError(f"--instances {c.instances:,} is more than {MAX_INSTANCES:,}",
                             f"give --instances {MAX_INSTANCES:,} or fewer (a cluster's "
                             "instances share one trace: more leaves most of them idle)")
        if isinstance(c.pool_tokens, int) and c.pool_tokens <= 0:
            raise UsageError(f"--pool-tokens {c.pool_tokens} is not positive",
                             "give the pool's size in tokens, or 'unlimited'")


ProgressFn = Callable[[int], None]


def replay_trace(
    path: Path,
    configs: Sequence[TraceConfig],
    *,
    format_name: str = "mooncake",
    block_tokens: int | None = None,
    seed: int = 0,
    on_progress: ProgressFn | None = None,
    progress_every: int = 10_000,
) -> TraceReplay:
    """Replay the trace at ``path`` once against every configuration.

    Args:
        block_tokens: tokens per id; ``None``: the format's default (or the records' own).
        seed: seeds random routing.
        on_progress: called with the requests replayed so far, every ``progress_every``.

    Raises:
        UsageError: unknown format, bad configuration, or no block size known.
        TraceInputError: a malformed record (named by file and line).
    """
    fmt = trace_format(format_name)
    check_configs(configs)
    if block_tokens is not None and block_tokens <= 0:
        raise UsageError(f"--block-tokens {block_tokens} is not positive",
                         "give the tokens per block id (512 for Mooncake's traces)")
    default_block = block_tokens if block_tokens is not None else fmt.block_tokens
    clusters: list[_Cluster] | None = None
    block = default_block or 0
    counts: collections.Counter[int] = collections.Counter()
    ideal_timeline = _Timeline()
    requests = inputs = outputs = ideal_hits = seen_uses = uses = 0
    first_ts: float | None = None
    last_ts = -math.inf
    for req in fmt.reader(path):
        if clusters is None:
            block = default_block or req.block_tokens or 0
            if block <= 0:
                raise UsageError(f"{path}: no block size: the records do not carry one",
                                 "give --block-tokens N")
            clusters = [_Cluster(c, block, seed) for c in configs]
        elif req.block_tokens is not None and block_tokens is None and req.block_tokens != block:
            raise bad_record(path, req.line, f"block size {req.block_tokens} differs from "
                             f"the {block} of the first record",
                             "replay one block size at a time (split the file)")
        ts = req.timestamp_ms
        if ts < last_ts:
            raise bad_record(path, req.line,
                             f"timestamp {ts:g} ms is before the previous one ({last_ts:g} ms)",
                             "a trace must be in arrival order: sort it by timestamp")
        if not math.isfinite(ts):
            raise bad_record(path, req.line, f"timestamp {ts} is not a finite number",
                             "give timestamps in milliseconds")
        last_ts = ts
        if first_ts is None:
            first_ts = ts
        elif not math.isfinite(ts - first_ts):  # e.g. -1e308 then 1e308: no finite span
            raise bad_record(path, req.line,
                             f"timestamp {ts:g} ms is too far from the first ({first_ts:g} ms)",
                             "give timestamps in milliseconds from one origin")
        tokens = req.input_length
        keys = req.hash_ids
        n = len(keys)
        if n * block - block >= tokens and n:
            allowed = -(-tokens // block)
            raise bad_record(
                path, req.line,
                f"{n} hash_ids for input_length {tokens}: at {block} tokens per id it allows "
                f"at most {allowed}",
                "check --block-tokens (the trace's tokens per id) and the record",
            )
        requests += 1
        inputs += tokens
        outputs += req.output_length
        run = 0
        for key in keys:
            if key not in counts:
                break
            run += 1
        hit = min(run * block, tokens)
        ideal_hits += hit
        ideal_timeline.add(ts, hit, tokens)
        before = len(counts)
        counts.update(keys)
        uses += n
        seen_uses += n - (len(counts) - before)
        for cluster in clusters:
            cluster.feed(ts, tokens, keys, block)
        if on_progress is not None and requests % progress_every == 0:
            on_progress(requests)
    if on_progress is not None:
        on_progress(requests)
    if clusters is None:
        raise UsageError(f"{path} holds no requests", "give a trace with at least one record")
    duration = (last_ts - (first_ts or 0.0)) / 1000
    summary = TraceSummary(
        path=str(path), format=fmt.name, block_tokens=block, requests=requests,
        duration_s=duration, arrival_rate_per_s=requests / duration if duration > 0 else 0.0,
        input_tokens=inputs, output_tokens=outputs, input_tokens_mean=inputs / requests,
        output_tokens_mean=outputs / requests, ideal_hit_tokens=ideal_hits,
        ideal_hit_ratio=_ratio(ideal_hits, inputs), distinct_ids=len(counts),
        block_uses=uses, any_position_id_ratio=_ratio(seen_uses, uses), reuse=_reuse(counts),
    )
    return TraceReplay(summary, [c.result() for c in clusters], ideal_timeline.points())


def grid(
    capacities: Iterable[int],
    *,
    instances: int = 1,
    routings: Iterable[TraceRouting] = (),
    pool_tokens: int | Unlimited | None = None,
) -> list[TraceConfig]:
    """The configurations ``kvctl sim trace`` replays: one single instance per capacity;
    with ``instances`` > 1, per routing and capacity, local-only and (with a pool) local +
    pool."""
    capacities = list(capacities)
    configs = [TraceConfig(c) for c in capacities]
    if pool_tokens is not None and instances == 1:
        configs += [TraceConfig(c, pool_tokens=pool_tokens) for c in capacities]
    if instances > 1:
        for routing in routings or (TraceRouting.RANDOM,):
            for c in capacities:
                configs.append(TraceConfig(c, instances, routing))
                if pool_tokens is not None:
                    configs.append(TraceConfig(c, instances, routing, pool_tokens))
    return configs
