"""The metadata service at 10^4 engines: a keepalive costs the same with 100 leases or
entries as with 10,000 (lease expiry by a heap in kvctl's own service; a Redis keepalive
that touches the lease, not every entry)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import kvctl.metadata.redis_backend as redis_backend
from kvctl.metadata import LeaseId, MetadataClient, open_metadata
from kvctl.metadata.memory import MemoryMetadata


def _best(fn: Callable[[], object], rounds: int = 200) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


class _Clocked(MemoryMetadata):
    now = 1000.0

    def _now(self) -> float:
        return self.now


def _leased_store(n: int) -> tuple[_Clocked, list[LeaseId]]:
    store = _Clocked.private()
    assert isinstance(store, _Clocked)
    leases = []
    for i in range(n):
        lease = store.grant_lease(10.0)
        store.put(f"kvctl/segments/engine-{i}", b"descriptor", lease=lease)
        leases.append(lease)
    return store, leases


def test_memory_keepalive_does_not_grow_with_leases() -> None:
    """10,000 engines with a lease each: a keepalive (and any call) costs what it costs
    with 100 (the old store scanned every lease on every call: 1.06 ms at 10^4)."""
    small, small_leases = _leased_store(100)
    big, big_leases = _leased_store(10_000)
    t_small = _best(lambda: small.keepalive(small_leases[7]))
    t_big = _best(lambda: big.keepalive(big_leases[7]))
    assert t_big < 3 * t_small + 20e-6, (t_small, t_big)
    # Expiry is still exact: renewed leases live on, the others go with their entries.
    big.now += 6.0
    for lease in big_leases[:5000]:
        big.keepalive(lease)
    big.now += 6.0
    assert big.get("kvctl/segments/engine-0") == b"descriptor"
    assert big.get("kvctl/segments/engine-9999") is None
    assert len(big.list("kvctl/segments/")) == 5000
    big.revoke(big_leases[0])
    assert big.get("kvctl/segments/engine-0") is None


@pytest.mark.integration
def test_redis_keepalive_touches_the_lease_not_every_entry(redis_url: str) -> None:
    """One lease shared by 10,000 entries: a keepalive costs about what it costs with 100
    (the old script reset every entry's expiry: 72 ms with Redis blocked)."""
    client = open_metadata(redis_url)
    try:
        timings = {}
        for n in (100, 10_000):
            lease = client.grant_lease(30.0)
            prefix = f"kvctl/scale-{n}/"
            for i in range(n):
                client.put(f"{prefix}{i}", b"v", lease=lease)
            timings[n] = _best(lambda lease=lease: client.keepalive(lease), rounds=50)
            assert len(client.list(prefix)) == n
            client.revoke(lease)
            assert client.list(prefix) == {}
        assert timings[10_000] < 3 * timings[100] + 0.001, timings
    finally:
        client.close()


@pytest.mark.integration
def test_redis_entries_live_with_their_lease_and_go_with_it(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a backstop of 4 TTLs, entries of a lease kept alive for 10 TTLs are all still
    there (each keepalive pushes the backstop of a slice of them); once the keepalives
    stop, get and list stop returning them after the TTL."""
    monkeypatch.setattr(redis_backend, "BACKSTOP", 4)
    monkeypatch.setattr(redis_backend, "REFRESH_SLICE", 8)
    client: MetadataClient = open_metadata(redis_url)
    try:
        lease = client.grant_lease(0.3)
        for i in range(100):
            client.put(f"kvctl/backstop/{i}", b"v", lease=lease)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            client.keepalive(lease)
            time.sleep(0.08)
        assert len(client.list("kvctl/backstop/")) == 100
        assert client.get("kvctl/backstop/42") == b"v"
        time.sleep(0.5)  # no keepalive: the lease expires
        assert client.get("kvctl/backstop/42") is None
        assert client.list("kvctl/backstop/") == {}
    finally:
        client.close()
