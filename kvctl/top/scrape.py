"""Read a Prometheus text endpoint, and compare two readings (rates, quantiles)."""

from __future__ import annotations

import dataclasses
import http.client
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping

from kvctl.errors import UnavailableError

#: Largest exposition read, bytes (a master with thousands of nodes stays far below).
MAX_SCRAPE_BYTES = 16 << 20

Labels = tuple[tuple[str, str], ...]


class ScrapeError(UnavailableError):
    """A metrics endpoint cannot be read or is not Prometheus text."""


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One reading of an endpoint.

    Attributes:
        at: when it was read (``time.monotonic()``, seconds).
        samples: sample name → {sorted label pairs → value}.
    """

    at: float
    samples: Mapping[str, Mapping[Labels, float]]

    def series(self, name: str) -> Iterator[tuple[dict[str, str], float]]:
        """Every sample of ``name``, as (labels, value)."""
        for labels, value in self.samples.get(name, {}).items():
            yield dict(labels), value

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of ``name``'s samples whose labels include ``labels`` (``None``: no such
        sample)."""
        found = [v for got, v in self.series(name) if labels.items() <= got.items()]
        return sum(found) if found else None

    def has(self, name: str) -> bool:
        """Whether the endpoint exported ``name`` at all."""
        return name in self.samples


def parse(text: str, at: float) -> Scrape:
    """Prometheus text exposition → :class:`Scrape`.

    Raises:
        ScrapeError: the text is not the exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, dict[Labels, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    except ValueError as exc:
        raise ScrapeError(f"not Prometheus metrics: {str(exc)[:120]!r}",
                          "point --metrics at a /metrics endpoint") from None
    return Scrape(at=at, samples=samples)


def fetch(url: str, *, timeout_s: float = 3.0) -> Scrape:
    """Read ``url`` (an ``http://.../metrics`` URL).

    Raises:
        ScrapeError: refused, timed out, not HTTP 200, or not the exposition format.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (http only)
            body: bytes = reply.read(MAX_SCRAPE_BYTES)
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"{url} answered HTTP {exc.code}",
                          "point --metrics at the server's /metrics endpoint") from None
    except http.client.HTTPException:  # its text may be the peer's binary greeting
        raise ScrapeError(f"{url} did not answer in HTTP: not a metrics endpoint",
                          "point --metrics at the server's --metrics-port, not its "
                          "service port") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ScrapeError(f"cannot read metrics at {url}: {getattr(exc, 'reason', exc)}",
                          "check the address and that the server runs with --metrics-port"
                          ) from None
    return parse(body.decode("utf-8", "replace"), time.monotonic())


def metrics_url(address: str) -> str:
    """``HOST:PORT`` or a URL → the ``http://HOST:PORT/metrics`` URL to scrape."""
    url = address if "://" in address else f"http://{address}"
    base, _, path = url.partition("://")[2].partition("/")
    return f"{url.partition('://')[0]}://{base}/{path or 'metrics'}"


def rate(prev: Scrape, cur: Scrape, name: str, **labels: str) -> float | None:
    """Per-second increase of a counter between two readings (``None``: absent, or no time
    passed). A counter that went down (the server restarted) counts from zero."""
    before, after = prev.value(name, **labels), cur.value(name, **labels)
    elapsed = cur.at - prev.at
    if after is None or elapsed <= 0:
        return None
    grown = after - (before or 0.0)
    return (after if grown < 0 else grown) / elapsed


def increase(prev: Scrape, cur: Scrape, name: str, **labels: str) -> float:
    """Increase of a counter between two readings (a reset counts from zero)."""
    before, after = prev.value(name, **labels) or 0.0, cur.value(name, **labels) or 0.0
    return after if after < before else after - before


def quantile(q: float, prev: Scrape, cur: Scrape, histogram: str, **labels: str
             ) -> float | None:
    """The ``q`` quantile (0..1) of what a histogram observed between two readings, by
    linear interpolation inside the bucket (as PromQL's ``histogram_quantile``); ``None``
    when nothing was observed. Above the largest finite bucket: that bucket's bound."""
    buckets: dict[float, float] = {}
    for got, value in cur.series(f"{histogram}_bucket"):
        if labels.items() <= got.items():
            le = float(got["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    for got, value in prev.series(f"{histogram}_bucket"):
        if labels.items() <= got.items() and float(got["le"]) in buckets:
            buckets[float(got["le"])] -= value
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower
