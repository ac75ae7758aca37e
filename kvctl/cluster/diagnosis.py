"""Which host (or NIC) drags the fabric down: a pure function over pairwise results.

Input: one :class:`PairValue` per measured pair of endpoints (a host, or a host's NIC when
each rail was measured on its own), in GB/s, ``None`` where the pair could not be measured.
Output: a :class:`Diagnosis`:

1. **Robust statistics** over the measured pairs: the median and the median absolute
   deviation (MAD); a pair is *slow* when it is below ``slow_fraction`` of the median
   (0.7 by default). Each slow pair carries its ratio to the median and its robust z-score
   ``(x - median) / (1.4826 x MAD)`` (``None`` when the MAD is 0).
2. **Culprits**: the subject (a host, or a host+NIC) that the most slow pairs share is named
   when at least ``min_slow_pairs`` (2) of them do and when more than ``own_share`` (half)
   of its own measured pairs are slow; its pairs are then explained, and the search repeats
   on what is left (a second bad host is named too; a noisy pair elsewhere is not). A
   host+NIC is named instead of its host when the host's other NICs are fine (its share of
   slow pairs is then higher than the host's). The evidence
   is the culprit's row (pairs it initiated) and column (pairs it served), each pair with
   its value and whether it was slow.

A median needs most pairs to be healthy: one bad host among N owns N-1 of the N(N-1)/2
pairs, a minority from N = 5 on; at N = 4 it owns half and the median sits between its pairs
and the others (it is found when its pairs are below about half of the others'); with N = 3
its two pairs are the median and nothing can be told apart (the diagnosis says so in
:attr:`Diagnosis.note`). More generally k bad hosts are
found while k(N-k) + k(k-1)/2 < N(N-1)/4, about k < 0.29 N.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence

#: A pair below this fraction of the cluster's median is slow.
DEFAULT_SLOW_FRACTION = 0.7
#: Fewest slow pairs a culprit must share (one slow pair cannot blame either end).
DEFAULT_MIN_SLOW_PAIRS = 2
#: A culprit's own pairs must be slow in more than this share.
DEFAULT_OWN_SHARE = 0.5
#: Scale that makes the MAD estimate a normal distribution's standard deviation.
MAD_SCALE = 1.4826
#: MAD over median above which the cluster's numbers are too noisy to trust a diagnosis.
NOISY_SPREAD = 0.25


@dataclasses.dataclass(frozen=True, order=True)
class Endpoint:
    """One end of a measured pair.

    Attributes:
        host: the host's name.
        nic: the NIC (rail) the pair used on this host, ``None`` for the host as a whole.
    """

    host: str
    nic: str | None = None

    def label(self) -> str:
        """``h3`` or ``h3/mlx5_1``."""
        return self.host if self.nic is None else f"{self.host}/{self.nic}"

    @property
    def host_only(self) -> Endpoint:
        """The host this endpoint belongs to."""
        return Endpoint(self.host)


@dataclasses.dataclass(frozen=True)
class PairValue:
    """One pair's throughput.

    Attributes:
        a: the initiator (its row in the matrix).
        b: the target (its column).
        gbps: GB/s (decimal), ``None`` when the pair was not measured.
    """

    a: Endpoint
    b: Endpoint
    gbps: float | None


@dataclasses.dataclass(frozen=True)
class SlowPair:
    """A pair below the threshold.

    Attributes:
        a / b: initiator and target.
        gbps: its throughput, GB/s.
        ratio: ``gbps`` over the cluster's median.
        robust_z: ``(gbps - median) / (1.4826 MAD)``; ``None`` when the MAD is 0.
    """

    a: Endpoint
    b: Endpoint
    gbps: float
    ratio: float
    robust_z: float | None


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One pair in a culprit's row or column.

    Attributes:
        peer: the other end.
        gbps: the pair's GB/s (``None``: not measured).
        slow: whether it is below the threshold.
    """

    peer: Endpoint
    gbps: float | None
    slow: bool


@dataclasses.dataclass(frozen=True)
class Culprit:
    """A host or host+NIC named as the likely cause.

    Attributes:
        subject: the host (``nic`` ``None``) or the host's NIC.
        slow_pairs: its slow pairs explained by it.
        measured_pairs: its measured pairs (not already explained by an earlier culprit).
        share_of_slow: ``slow_pairs`` over every slow pair of the run.
        median_gbps: the median of its measured pairs, GB/s.
        row: pairs it initiated, by peer.
        column: pairs it served as target, by peer.
    """

    subject: Endpoint
    slow_pairs: int
    measured_pairs: int
    share_of_slow: float
    median_gbps: float | None
    row: tuple[Evidence, ...]
    column: tuple[Evidence, ...]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What the pairwise results say.

    Attributes:
        pairs: pairs given; ``measured``: those with a value.
        median_gbps / mad_gbps: robust centre and spread of the measured pairs, GB/s.
        threshold_gbps: ``slow_fraction x median``; pairs below it are slow.
        slow_fraction: the fraction used.
        slow: slow pairs, slowest first.
        culprits: named hosts or NICs, most slow pairs first.
        unexplained: slow pairs no culprit accounts for.
        unmeasured: pairs without a value.
        note: why the verdict is weak, if it is (too few pairs, noisy numbers).
        unreachable: hosts or NICs that no pair reached (every one of their pairs, and at
            least ``min_slow_pairs`` of them, failed while other pairs were measured); a
            NIC is named instead of its host when the host's other NICs were measured.
    """

    pairs: int
    measured: int
    median_gbps: float | None
    mad_gbps: float | None
    threshold_gbps: float | None
    slow_fraction: float
    slow: tuple[SlowPair, ...]
    culprits: tuple[Culprit, ...]
    unexplained: tuple[SlowPair, ...]
    unmeasured: tuple[PairValue, ...]
    note: str | None = None
    unreachable: tuple[Endpoint, ...] = ()

    @property
    def healthy(self) -> bool:
        """No slow pair and every pair measured."""
        return not self.slow and not self.unmeasured

    def summary(self) -> str:
        """One line for people: the culprits, or that there are none."""
        if self.median_gbps is None:
            return "no pair was measured"
        head = (f"median {self.median_gbps:.3g} GB/s, MAD {self.mad_gbps or 0.0:.3g}; "
                f"{len(self.slow)} of {self.measured} pair(s) below "
                f"{self.slow_fraction:.0%} of the median")
        if self.culprits:
            named = ", ".join(f"{c.subject.label()} ({c.slow_pairs} of {c.measured_pairs} "
                              f"pairs slow, median {c.median_gbps or 0.0:.3g} GB/s)"
                              for c in self.culprits)
            head += f"; likely culprit: {named}"
        elif self.slow:
            head += "; no host or NIC is common to most of them"
        if self.unexplained and self.culprits:
            head += f"; {len(self.unexplained)} slow pair(s) unexplained"
        if self.unreachable:
            head += "; no pair reached " + ", ".join(e.label() for e in self.unreachable)
        return head


def _median_mad(values: Sequence[float]) -> tuple[float, float]:
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median, mad


def _subjects(pair: PairValue) -> list[Endpoint]:
    """What a pair can blame: both hosts, and both NICs when the pair names them."""
    found = [pair.a.host_only, pair.b.host_only]
    for end in (pair.a, pair.b):
        if end.nic is not None:
            found.append(end)
    return list(dict.fromkeys(found))


def _by_subject(pairs: Iterable[PairValue]) -> dict[Endpoint, list[PairValue]]:
    """Each subject a pair can blame, with its pairs."""
    found: dict[Endpoint, list[PairValue]] = {}
    for pair in pairs:
        for subject in _subjects(pair):
            found.setdefault(subject, []).append(pair)
    return found


def _key(pair: PairValue) -> tuple[Endpoint, Endpoint]:
    return (pair.a, pair.b)


def diagnose(values: Iterable[PairValue], *, slow_fraction: float = DEFAULT_SLOW_FRACTION,
             min_slow_pairs: int = DEFAULT_MIN_SLOW_PAIRS,
             own_share: float = DEFAULT_OWN_SHARE) -> Diagnosis:
    """Flag slow pairs and name the hosts or NICs they share (see the module docstring).

    Args:
        values: one entry per pair (initiator, target); the order does not matter.
        slow_fraction: pairs below this fraction of the median are slow (0 < f < 1).
        min_slow_pairs: fewest slow pairs a culprit must share.
        own_share: a culprit's own measured pairs must be slow in more than this share.

    Raises:
        ValueError: a fraction outside (0, 1) or a negative or non-finite value.
    """
    if not 0 < slow_fraction < 1:
        raise ValueError(f"slow_fraction {slow_fraction} is not between 0 and 1")
    if not 0 <= own_share < 1:
        raise ValueError(f"own_share {own_share} is not in [0, 1)")
    pairs = list(values)
    measured = [p for p in pairs if p.gbps is not None]
    unmeasured = tuple(p for p in pairs if p.gbps is None)
    for p in measured:
        if not (p.gbps is not None and p.gbps >= 0 and p.gbps != float("inf")):
            raise ValueError(f"pair {p.a.label()}-{p.b.label()} has a bad value {p.gbps}")
    if not measured:
        return Diagnosis(len(pairs), 0, None, None, None, slow_fraction, (), (), (),
                         unmeasured)
    gbps = [float(p.gbps) for p in measured if p.gbps is not None]
    median, mad = _median_mad(gbps)
    threshold = slow_fraction * median
    slow: dict[tuple[Endpoint, Endpoint], SlowPair] = {}
    for p in measured:
        if p.gbps is not None and p.gbps < threshold:
            z = (p.gbps - median) / (MAD_SCALE * mad) if mad > 0 else None
            slow[_key(p)] = SlowPair(p.a, p.b, p.gbps, p.gbps / median if median else 0.0, z)
    culprits = _culprits(measured, slow, min_slow_pairs=min_slow_pairs, own_share=own_share)
    explained = {k for c in culprits for k in _explained_keys(c, slow)}
    unexplained = tuple(sorted((s for k, s in slow.items() if k not in explained),
                               key=lambda s: (s.gbps, s.a, s.b)))
    hosts = {e.host for p in measured for e in (p.a, p.b)}
    note = None
    if len(hosts) < 4:
        note = (f"{len(hosts)} host(s): one bad host owns most pairs below 4 hosts, so the "
                "median may be its own")
    elif median > 0 and mad / median > NOISY_SPREAD:
        note = (f"noisy: the MAD is {mad / median:.0%} of the median; rerun with longer "
                "--duration or on a quieter fabric before trusting the verdict")
    return Diagnosis(
        pairs=len(pairs), measured=len(measured), median_gbps=median, mad_gbps=mad,
        threshold_gbps=threshold, slow_fraction=slow_fraction,
        slow=tuple(sorted(slow.values(), key=lambda s: (s.gbps, s.a, s.b))),
        culprits=tuple(culprits), unexplained=unexplained, unmeasured=unmeasured, note=note,
        unreachable=_unreachable(pairs, min_pairs=min_slow_pairs))


def _unreachable(pairs: list[PairValue], *, min_pairs: int) -> tuple[Endpoint, ...]:
    """Subjects all of whose pairs (at least ``min_pairs``) failed: a dead link or NIC is
    the slowest of all, but it has no value to be slow with. Only called with some pair
    measured, so "everything failed" names nobody."""
    dead = {s for s, own in _by_subject(pairs).items()
            if len(own) >= min_pairs and all(p.gbps is None for p in own)}
    # A host whose pairs all failed is named as the host, not NIC by NIC.
    return tuple(sorted(s for s in dead if s.nic is None or s.host_only not in dead))


def _explained_keys(culprit: Culprit, slow: dict[tuple[Endpoint, Endpoint], SlowPair]
                    ) -> list[tuple[Endpoint, Endpoint]]:
    subject = culprit.subject
    return [k for k in slow if subject in _subjects(PairValue(k[0], k[1], None))]


def _culprits(measured: list[PairValue], slow: dict[tuple[Endpoint, Endpoint], SlowPair], *,
              min_slow_pairs: int, own_share: float) -> list[Culprit]:
    by_subject = _by_subject(measured)
    remaining = set(slow)
    named: list[Endpoint] = []
    found: list[Culprit] = []
    total_slow = len(slow)
    while remaining:
        best: tuple[tuple[int, float, int], Endpoint, int, int] | None = None
        for subject, own in by_subject.items():
            if subject in named:
                continue
            base = [p for p in own if not any(n in _subjects(p) for n in named)]
            cover = sum(1 for p in base if _key(p) in remaining)
            if not base or cover == 0:
                continue
            # most slow pairs first; then the larger share of its own pairs (a bad NIC beats
            # its host, whose other NICs are fine); then the host over a NIC that carries
            # all of its pairs (nothing tells them apart).
            rank = (cover, cover / len(base), 1 if subject.nic is None else 0)
            if best is None or rank > best[0] or (rank == best[0] and subject < best[1]):
                best = (rank, subject, cover, len(base))
        if best is None:
            break
        _, subject, cover, base_count = best
        if cover < min_slow_pairs or cover / base_count <= own_share:
            break
        own = [p for p in by_subject[subject] if not any(n in _subjects(p) for n in named)]
        cover_keys = {_key(p) for p in own if _key(p) in remaining}
        found.append(_culprit(subject, own, slow, len(cover_keys), total_slow))
        named.append(subject)
        remaining -= cover_keys
    return found


def _culprit(subject: Endpoint, own: list[PairValue],
             slow: dict[tuple[Endpoint, Endpoint], SlowPair], cover: int,
             total_slow: int) -> Culprit:
    values = [p.gbps for p in own if p.gbps is not None]
    row: list[Evidence] = []
    column: list[Evidence] = []

    def mine(end: Endpoint) -> bool:
        return end == subject or (subject.nic is None and end.host == subject.host)

    for p in sorted(own, key=lambda p: (p.a, p.b)):
        is_slow = _key(p) in slow
        if mine(p.a):
            row.append(Evidence(p.b, p.gbps, is_slow))
        if mine(p.b):
            column.append(Evidence(p.a, p.gbps, is_slow))
    return Culprit(subject=subject, slow_pairs=cover, measured_pairs=len(own),
                   share_of_slow=cover / total_slow if total_slow else 0.0,
                   median_gbps=statistics.median(values) if values else None,
                   row=tuple(row), column=tuple(column))
