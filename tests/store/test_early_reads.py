"""Gets of recently written keys read the last known replica while the master answers.

The guess must never change what a get returns: every case where the remembered location
is stale (overwritten by another client, removed, evicted and its space reused, corrupted)
must give the current value or the right error, exactly as without the guess.
"""

from __future__ import annotations

import os

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.master import MasterConfig
from tests.store.conftest import Cluster


@pytest.fixture
def tcp_pair(cluster: Cluster) -> tuple[StoreClient, StoreClient]:
    cluster.add_node("a", capacity_bytes=4 << 20)
    return (StoreClient(cluster.address, transport="tcp"),
            StoreClient(cluster.address, transport="tcp"))


def _spy(client: StoreClient) -> list[dict[int, object]]:
    """Record what each early read found (the real method runs)."""
    seen: list[dict[int, object]] = []
    real = client._read_guesses

    def spy(guesses: list[tuple[int, object]], dests: object = None) -> dict[int, object]:
        found = real(guesses, dests)  # type: ignore[arg-type]
        seen.append(dict(found))
        return found  # type: ignore[return-value]

    client._read_guesses = spy  # type: ignore[method-assign,assignment]
    return seen


def test_guess_is_used_for_own_writes(cluster: Cluster,
                                      tcp_pair: tuple[StoreClient, StoreClient]) -> None:
    mine, _ = tcp_pair
    with mine:
        value = os.urandom(10_000)
        mine.put("k", value)
        assert mine.exists("k")  # its commit landed (same connection, in order)
        seen = _spy(mine)
        assert mine.get("k") == value
        assert list(seen[-1]) == [0]  # read before the master answered, and accepted
        assert mine.batch_get(["nope", "k"])[1] == value
        assert list(seen[-1]) == [1]


def test_overwrite_by_another_client_is_never_served_stale(
        cluster: Cluster, tcp_pair: tuple[StoreClient, StoreClient]) -> None:
    mine, other = tcp_pair
    with mine, other:
        old, new = os.urandom(8192), os.urandom(8192)
        mine.put("k", old)
        assert mine.exists("k")  # its commit landed (same connection, in order)
        other.put("k", new)  # new version elsewhere; the old bytes still sit at the guess
        assert other.exists("k")  # its commit landed
        seen = _spy(mine)
        assert mine.get("k") == new
        assert list(seen[-1]) == [0]  # the stale guess read intact old bytes: rejected
        # the get learned the new location: the next guess is right
        assert mine.get("k") == new


def test_removed_key_is_absent_even_if_its_bytes_remain(
        cluster: Cluster, tcp_pair: tuple[StoreClient, StoreClient]) -> None:
    mine, other = tcp_pair
    with mine, other:
        mine.put("k", os.urandom(4096))
        assert mine.exists("k")  # its commit landed (same connection, in order)
        assert other.remove("k")  # removed by someone else: our guess still points at it
        seen = _spy(mine)
        with pytest.raises(ObjectNotFoundError):
            mine.get("k")
        assert seen  # the guess was tried


def test_reused_space_with_other_bytes_falls_back(
        cluster: Cluster, tcp_pair: tuple[StoreClient, StoreClient]) -> None:
    mine, other = tcp_pair
    with mine, other:
        first = os.urandom(4096)
        mine.put("k", first)
        assert mine.exists("k")  # its commit landed (same connection, in order)
        slot = cluster.server.core.get(p.Get(keys=["k"], lease=False)).slots[0]
        assert isinstance(slot, p.GetSlot)
        loc = slot.locations[0]
        # Another client replaces the value with one of the same size; then the old range
        # is scribbled over (as a reuse of freed space would): the guess reads garbage.
        second = os.urandom(4096)
        other.put("k", second)
        assert other.exists("k")
        node = cluster.nodes["a"]
        node._buffer.view[loc.offset:loc.offset + 4096] = os.urandom(4096)
        assert mine.get("k") == second


def test_same_bytes_rewritten_is_a_new_version(
        cluster: Cluster, tcp_pair: tuple[StoreClient, StoreClient]) -> None:
    """The guess counts only for the version the master names: a remove followed by a put
    of the same bytes must be read from the master's location, not the stale one."""
    mine, other = tcp_pair
    with mine, other:
        value = os.urandom(4096)
        mine.put("k", value)
        assert mine.exists("k")  # its commit landed (same connection, in order)
        assert other.remove("k")
        other.put("k", value)
        assert other.exists("k")
        assert mine.get("k") == value
        current = cluster.server.core.get(p.Get(keys=["k"], lease=False)).slots[0]
        assert isinstance(current, p.GetSlot)
        with mine._recall.lock:
            assert mine._recall.where["k"].version == current.version


@pytest.mark.parametrize("registered", [True, False])
def test_guesses_land_in_caller_buffers(cluster: Cluster,
                                        tcp_pair: tuple[StoreClient, StoreClient],
                                        registered: bool) -> None:
    """batch_get_into reads guesses straight into the caller's buffers (registered: zero
    copy; otherwise through staging); a stale guess there is overwritten by the current
    value, a removed key is an error, a too-small buffer is never guessed into."""
    mine, other = tcp_pair
    with mine, other:
        values = {f"k{i}": os.urandom(8192) for i in range(4)}
        mine.batch_put(list(values.items()))
        assert mine.exists("k0")  # the commits landed (same connection, in order)
        new = os.urandom(8192)
        other.put("k1", new)  # overwritten elsewhere: the guess reads old, intact bytes
        assert other.remove("k2")  # removed elsewhere
        arena = bytearray(4 * 8192)
        if registered:
            mine.register_buffer(arena)
        view = memoryview(arena)
        bufs = [view[i * 8192:(i + 1) * 8192] for i in range(3)] + [bytearray(100)]
        seen = _spy(mine)
        got = mine.batch_get_into(list(values), bufs)
        assert sorted(seen[-1]) == [0, 1, 2]  # read early; k3's buffer is too small
        assert got[0] == 8192
        assert bytes(bufs[0]) == values["k0"]
        assert got[1] == 8192
        assert bytes(bufs[1]) == new
        assert isinstance(got[2], ObjectNotFoundError)
        assert not isinstance(got[3], int)  # too small: an error, not a guess
        bufs[0][:] = bytes(8192)
        assert mine.batch_get_into(["k0"], [bufs[0]]) == [8192]
        assert list(seen[-1]) == [0]
        assert bytes(bufs[0]) == values["k0"]


def test_eviction_is_reported_not_guessed(cluster: Cluster) -> None:
    small = Cluster(MasterConfig(node_timeout_s=2.0))
    try:
        small.add_node("a", capacity_bytes=1 << 20)
        with StoreClient(small.address, transport="tcp") as c:
            values = {f"k{i}": os.urandom(256 << 10) for i in range(8)}
            for key, value in values.items():
                c.put(key, value)  # 2 MiB into 1 MiB: the first ones are evicted
            got = c.batch_get(list(values))
            evicted = [g for g in got if isinstance(g, ObjectNotFoundError)]
            assert evicted  # some were evicted ...
            assert all(g.evicted for g in evicted)  # ... and reported as such
            for key, g in zip(values, got, strict=True):  # the rest read back intact
                assert isinstance(g, ObjectNotFoundError) or g == values[key]
    finally:
        small.close()
