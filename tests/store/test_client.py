"""Client semantics on a live in-process cluster: batches, zero-copy, checksum failover."""

from __future__ import annotations

import os

import pytest

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.arena import DEFAULT_RESERVE_BYTES
from kvctl.store.client import StoreClient
from kvctl.store.errors import ChecksumMismatchError, ObjectNotFoundError
from tests.store.conftest import Cluster

#: puts placed by the client in its reservation (the default), or all through the master
PUT_PATHS = pytest.mark.parametrize("reserve_bytes", [DEFAULT_RESERVE_BYTES, 0],
                                    ids=["reserved", "via-master"])


@PUT_PATHS
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_batches_and_zero_copy(cluster: Cluster, transport: str, reserve_bytes: int) -> None:
    cluster.add_node("a")
    with StoreClient(cluster.address, transport=transport, reserve_bytes=reserve_bytes) as c:
        items = [(f"k{i}", os.urandom(1000 * (i + 1))) for i in range(10)]
        assert c.batch_put(items) == [None] * 10
        got = c.batch_get(["k3", "missing", "k9", ""])
        assert got[0] == items[3][1]
        assert isinstance(got[1], ObjectNotFoundError)
        assert got[2] == items[9][1]
        assert isinstance(got[3], KvctlError)
        assert not isinstance(got[3], ObjectNotFoundError)  # a bad key is not "absent"

        region = bytearray(1 << 20)
        c.register_buffer(region)
        view = memoryview(region)
        assert c.get_into("k4", view[4096:]) == 5000
        assert bytes(view[4096:9096]) == items[4][1]
        plain = bytearray(5000)  # not registered: staged, same result
        assert c.get_into("k4", plain) == 5000
        assert plain == items[4][1]
        view[:7000] = os.urandom(7000)
        c.put_from("zc", view[:7000])
        assert c.get("zc") == bytes(view[:7000])
        too_small = c.batch_get_into(["k9"], [bytearray(10)])
        assert isinstance(too_small[0], KvctlError)
        c.put("empty", b"")
        assert c.get("empty") == b""
        c.put("k0", b"new value")  # overwrite replaces
        assert c.get("k0") == b"new value"
        assert [o.key for o in c.list("k")[0]] == [f"k{i}" for i in range(10)]


@PUT_PATHS
def test_checksum_mismatch_fails_over_then_errors(cluster: Cluster, reserve_bytes: int) -> None:
    a = cluster.add_node("a")
    b = cluster.add_node("b")
    with StoreClient(cluster.address, replicas=2, reserve_bytes=reserve_bytes) as c:
        value = os.urandom(64 * 1024)
        c.put("k", value)
        assert sorted(c.stat("k").replicas) == ["a", "b"]
        slot = cluster.server.core.get(p.Get(keys=["k"], lease=False)).slots[0]
        assert isinstance(slot, p.GetSlot)
        where = {loc.node_id: loc.offset for loc in slot.locations}
        first = slot.locations[0].node_id
        node = {"a": a, "b": b}[first]
        node._buffer.view[where[first] + 100] ^= 0xFF  # corrupt the replica read first
        assert c.get("k") == value  # served from the other replica, verified
        other = b if node is a else a
        other._buffer.view[where[other.node_id] + 100] ^= 0xFF
        with pytest.raises(ChecksumMismatchError):
            c.get("k")  # never returns corrupted bytes


def test_exists_and_remove_split_batches_above_the_master_limit(cluster: Cluster) -> None:
    cluster.add_node("a")
    with StoreClient(cluster.address) as c:
        assert c.batch_put([("present", b"x")]) == [None]
        # More keys than one request may carry, and more key bytes than one frame holds.
        keys = [f"absent-{i:05d}-" + "k" * 1100 for i in range(p.MAX_BATCH + 10)] + ["present"]
        found = c.batch_exists(keys)
        assert len(found) == len(keys)
        assert found[-1] is True
        assert not any(found[:-1])
        removed = c.batch_remove(keys)
        assert removed == found
        assert c.batch_exists(["present"]) == [False]


def test_failed_direct_moves_fall_back_to_batches(cluster: Cluster) -> None:
    """A single value moves without a batch (TransferEngine.move_direct); when that fails
    (a cut connection, say), the put or get runs as a batch, which retries."""
    from kvctl.errors import TransferError
    from kvctl.transfer.batch import OpCode

    cluster.add_node("a")
    with StoreClient(cluster.address, transport="tcp") as c:
        tried: list[OpCode] = []
        real = c.engine.move_direct

        def cut(op: OpCode, *args: object) -> None:
            tried.append(op)
            raise TransferError("connection cut (injected)", "retry")

        value = os.urandom(50_000)
        c.put("warm", value)  # direct path works: no fallback needed
        assert c.get("warm") == value
        c.engine.move_direct = cut  # type: ignore[method-assign,assignment]
        c.put("k", value)
        assert c.get("k") == value
        assert c.get("warm") == value
        assert OpCode.WRITE in tried
        assert OpCode.READ in tried
        c.engine.move_direct = real  # type: ignore[method-assign]
