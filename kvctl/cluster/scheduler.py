"""Which pairs of hosts are tested when, and what a plan costs at 1,000 or 10,000 hosts.

A cluster bench tests host pairs; a pair ``(a, b)`` has ``a`` initiate READs and WRITEs into a
target on ``b``, so both directions of both links are crossed. Three plans:

- **sequential**: one pair at a time, every pair: N(N-1)/2 steps. The cleanest numbers (no
  two pairs share anything), the plan for small clusters (``auto`` up to
  :data:`SEQUENTIAL_MAX_HOSTS` hosts) or oversubscribed fabrics.
- **rounds**: a round-robin tournament (the circle method): N-1 rounds for even N, N for
  odd N, each a set of disjoint pairs (every host in at most one), covering every pair once.
  On a non-blocking fabric disjoint pairs do not share a link, so a round takes as long as
  one pair: O(N) wall time instead of O(N^2).
- **sampled** (``pairs=K``): the first rounds of a tournament over a shuffled host order,
  cut at K pairs, so every host is in about 2K/N pairs (the same number, +-1) and every pair
  is equally likely.

:func:`plan_figures` computes a plan's cost without building it (a 10,000-host tournament
has 50 million pairs): rounds, wall time at a per-pair duration, and the load on the
metadata service from the protocol in :mod:`kvctl.cluster.protocol` (keys alive at once,
writes per pair and per second, lease renewals, reads and pushed watch events per second).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from kvctl.errors import UsageError

#: ``auto`` runs pairs one at a time up to this many hosts, in rounds above.
SEQUENTIAL_MAX_HOSTS = 4
#: Plans by name.
MODES = ("auto", "sequential", "rounds")

#: Metadata writes one pair costs (see :mod:`kvctl.cluster.protocol`): the client puts the
#: target's job and the initiator's job and deletes both; each agent publishes one status
#: (target ready; bench result) and deletes it once the job is gone.
WRITES_PER_PAIR = 8
#: Keys one pair holds while it runs: two jobs, two statuses.
KEYS_PER_PAIR = 4
#: Keys per registered host: its record and its small liveness key.
KEYS_PER_HOST = 2
#: Seconds a target takes to come up (engine, segment, metadata server), an estimate.
TARGET_START_S = 0.5
#: Seconds from a write to its watcher acting on it, where the service pushes changes
#: (etcd): a job posted to its agent's status seen by the client took 5 ms median, 15 ms
#: p90 on namespaced hosts (``python -m tests.cluster.dispatch``); 10 ms per hop here.
PUSH_S = 0.01
#: Watch events one pair costs: each write reaches exactly one watcher (a job its agent,
#: a status the client).
EVENTS_PER_PAIR = WRITES_PER_PAIR

Pair = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A plan: rounds of pairs, run one round after another.

    Attributes:
        hosts: the hosts planned over, in the order given.
        mode: ``sequential`` (one pair per round) or ``rounds``.
        rounds: pairs ``(initiator, target)`` per round; no host twice in a round.
        sampled: whether only a subset of all pairs is planned (``pairs=K``).
    """

    hosts: tuple[str, ...]
    mode: str
    rounds: tuple[tuple[Pair, ...], ...]
    sampled: bool = False

    @property
    def pairs(self) -> tuple[Pair, ...]:
        """Every planned pair, in run order."""
        return tuple(p for r in self.rounds for p in r)

    @property
    def max_concurrency(self) -> int:
        """The most pairs running at once."""
        return max((len(r) for r in self.rounds), default=0)


def all_pairs(hosts: Sequence[str]) -> list[Pair]:
    """Every unordered pair once, as ``(earlier, later)`` in ``hosts`` order."""
    return [(hosts[i], hosts[j]) for i in range(len(hosts)) for j in range(i + 1, len(hosts))]


def round_robin(hosts: Sequence[str]) -> list[list[Pair]]:
    """A round-robin tournament (circle method): rounds of disjoint pairs covering every pair
    exactly once; N-1 rounds for even N, N for odd N (one host sits each round out).

    Each host initiates in half of its pairs (``(N-1)/2``, or ``N/2`` and ``N/2 - 1`` for
    even N): host ``i`` initiates toward ``j`` when ``(j - i) mod N`` is in the first half.
    """
    if len(hosts) < 2:
        return []
    index = {h: i for i, h in enumerate(hosts)}
    n_hosts = len(hosts)
    ring: list[str | None] = list(hosts)
    if len(ring) % 2:
        ring.append(None)  # the bye
    n = len(ring)
    rounds: list[list[Pair]] = []
    for _ in range(n - 1):
        pairs: list[Pair] = []
        for i in range(n // 2):
            a, b = ring[i], ring[n - 1 - i]
            if a is None or b is None:
                continue
            pairs.append(_orient(a, b, index, n_hosts))
        rounds.append(pairs)
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def _orient(a: str, b: str, index: dict[str, int], n: int) -> Pair:
    gap = (index[b] - index[a]) % n
    if gap < n - gap or (gap == n - gap and index[a] < index[b]):
        return (a, b)
    return (b, a)


def _check_hosts(hosts: Sequence[str]) -> None:
    if len(set(hosts)) != len(hosts):
        raise UsageError("a host is listed twice", "give each host once")


def plan_schedule(hosts: Sequence[str], *, mode: str = "auto", pairs: int | None = None,
                  seed: int = 0) -> Schedule:
    """The plan for ``hosts``.

    Args:
        mode: ``auto`` (sequential up to :data:`SEQUENTIAL_MAX_HOSTS` hosts, else rounds),
            ``sequential`` or ``rounds``.
        pairs: test only this many pairs, sampled from a shuffled tournament; ``None``: all.
        seed: the shuffle's seed (the same seed, the same sample).

    Raises:
        UsageError: an unknown mode, a host twice, or ``pairs`` below 1.
    """
    if mode not in MODES:
        raise UsageError(f"schedule {mode!r} is unknown", f"use one of {', '.join(MODES)}")
    _check_hosts(hosts)
    if pairs is not None and pairs < 1:
        raise UsageError(f"--pairs {pairs} is below 1", "give 1 or more, or leave it out")
    order = list(hosts)
    total = len(order) * (len(order) - 1) // 2
    sampled = pairs is not None and pairs < total
    if sampled:
        random.Random(seed).shuffle(order)
    chosen = mode if mode != "auto" else (
        "sequential" if len(order) <= SEQUENTIAL_MAX_HOSTS else "rounds")
    rounds = round_robin(order)
    if sampled and pairs is not None:
        kept: list[list[Pair]] = []
        left = pairs
        for r in rounds:
            if left <= 0:
                break
            kept.append(r[:left])
            left -= len(kept[-1])
        rounds = kept
    if chosen == "sequential":
        rounds = [[p] for r in rounds for p in r]
    return Schedule(tuple(hosts), chosen, tuple(tuple(r) for r in rounds if r), sampled)


@dataclasses.dataclass(frozen=True)
class PlanFigures:
    """What a plan costs, computed from its shape alone.

    Attributes:
        hosts / pairs / rounds: the plan's size.
        pairs_per_round: the most pairs in one round.
        rails: NIC rails measured per pair (each rail a bench of its own, concurrently).
        pair_duration_s: seconds one pair's bench takes (given).
        round_overhead_s: coordination per round: a target start (:data:`TARGET_START_S`)
            and four hand-offs (job to agent, status to client, twice), each a push
            (:data:`PUSH_S`) with watches, a poll interval without.
        wall_time_s: ``rounds x (pair_duration_s + round_overhead_s)``.
        metadata_keys_peak: keys alive at once: per host its record and liveness key, the
            cluster policy, and per running pair two jobs and two statuses.
        writes_per_pair: metadata writes (puts and deletes) one pair costs, per rail.
        writes_per_s: writes per second while a full round runs.
        lease_renewals_per_s: keepalives of every agent's and the client's lease (each renews
            three times per TTL).
        reads_per_s: reads per second. With watches (etcd), the watch streams reopened
            after :data:`~kvctl.metadata.etcd.WATCH_IDLE_S` of silence, at most
            (``(hosts + 2) / 30``); without (file, http, Redis), polls: every agent lists
            its jobs once per ``agent_poll_s``, the client its statuses and the liveness
            keys once per ``client_poll_s``.
        watch: whether the service pushes changes (watches) or is polled.
        watch_streams: watch streams open at once (an agent's, the client's two).
        events_per_s: changes the service pushes per second (0 when polled).
    """

    hosts: int
    pairs: int
    rounds: int
    pairs_per_round: int
    rails: int
    pair_duration_s: float
    round_overhead_s: float
    wall_time_s: float
    metadata_keys_peak: int
    writes_per_pair: int
    writes_per_s: float
    lease_renewals_per_s: float
    reads_per_s: float
    watch: bool = True
    watch_streams: int = 0
    events_per_s: float = 0.0


def plan_figures(hosts: int, *, pair_duration_s: float, mode: str = "rounds",
                 pairs: int | None = None, rails: int = 1, lease_ttl_s: float = 10.0,
                 agent_poll_s: float = 0.5, client_poll_s: float = 0.2,
                 watch: bool = True) -> PlanFigures:
    """The cost of planning ``hosts`` hosts (the numbers :func:`plan_schedule` would give,
    without building the plan).

    Args:
        watch: the service pushes changes (etcd); ``False``: agents and the client poll
            (``file://``, kvctl's HTTP server, Redis).

    Raises:
        UsageError: fewer than 2 hosts, a mode other than sequential/rounds/auto, or a
            duration, TTL or poll interval that is not positive.
    """
    if hosts < 2:
        raise UsageError(f"{hosts} host(s) make no pair", "plan 2 hosts or more")
    for name, value in (("pair duration", pair_duration_s), ("lease TTL", lease_ttl_s),
                        ("agent poll", agent_poll_s), ("client poll", client_poll_s),
                        ("rails", rails)):
        if not value > 0:
            raise UsageError(f"{name} {value} is not positive", f"give a positive {name}")
    if mode not in MODES:
        raise UsageError(f"schedule {mode!r} is unknown", f"use one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "sequential" if hosts <= SEQUENTIAL_MAX_HOSTS else "rounds"
    total = hosts * (hosts - 1) // 2
    count = total if pairs is None else max(1, min(pairs, total))
    per_round = 1 if mode == "sequential" else hosts // 2
    if mode == "sequential":
        rounds = count
    elif count == total:
        rounds = hosts - 1 if hosts % 2 == 0 else hosts
    else:
        rounds = math.ceil(count / per_round)
    per_round = min(per_round, count)
    from kvctl.metadata.etcd import WATCH_IDLE_S

    overhead = TARGET_START_S + (4 * PUSH_S if watch else 2 * agent_poll_s + 2 * client_poll_s)
    step = pair_duration_s + overhead
    return PlanFigures(
        hosts=hosts, pairs=count, rounds=rounds, pairs_per_round=per_round, rails=rails,
        pair_duration_s=pair_duration_s, round_overhead_s=overhead,
        wall_time_s=rounds * step,
        metadata_keys_peak=KEYS_PER_HOST * hosts + 1 + KEYS_PER_PAIR * per_round * rails,
        writes_per_pair=WRITES_PER_PAIR * rails,
        writes_per_s=per_round * rails * WRITES_PER_PAIR / step,
        lease_renewals_per_s=(hosts + 1) * 3 / lease_ttl_s,
        reads_per_s=((hosts + 2) / WATCH_IDLE_S if watch
                     else hosts / agent_poll_s + 2 / client_poll_s),
        watch=watch, watch_streams=hosts + 2 if watch else 0,
        events_per_s=per_round * rails * EVENTS_PER_PAIR / step if watch else 0.0,
    )
