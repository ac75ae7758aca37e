"""Gets answered with the object bytes attached, by a master that hosts the node's memory.

``kvctl store serve`` runs a master and a node in one process; the master then sends the
bytes of objects in that node's memory right behind its answer. What must hold: the bytes
are the object's (verified, never wrong bytes), the client never reads the node for them,
limits on both sides are kept, the connection stays in step whatever happens to a slot, and
the node's memory is handed back (it can still be unregistered).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import ChecksumMismatchError, ObjectNotFoundError
from kvctl.store.master import MasterConfig
from kvctl.store.rpc import MasterConnection
from tests.store.conftest import Cluster


@pytest.fixture
def hosted() -> Iterator[Cluster]:
    """A master serving its node's bytes (as ``kvctl store serve`` does)."""
    c = Cluster(MasterConfig(node_timeout_s=2.0))
    node = c.add_node("a", capacity_bytes=64 << 20)
    c.server.serve_local(node.hold)
    yield c
    c.close()


def _node_reads(cluster: Cluster) -> list[int]:
    """Count the bytes node "a" serves to reads over its data path (the real server
    runs)."""
    count = [0]
    server = cluster.nodes["a"].engine._server
    assert server is not None
    real = server._read

    def read(conn: Any, mac: Any, tag: int, parsed: list[tuple[int, int, int]]) -> Any:
        count[0] += sum(length for _, _, length in parsed)
        return real(conn, mac, tag, parsed)

    server._read = read  # type: ignore[method-assign]
    return count


def _inflight(cluster: Cluster) -> int:
    node = cluster.nodes["a"]
    return sum(seg.inflight for seg in node.engine._segments.values())


SIZES = [1, 4096, 65536, 1 << 20, 3 << 20]


def test_get_takes_the_bytes_with_the_answer(hosted: Cluster) -> None:
    with StoreClient(hosted.address, transport="tcp") as c:
        assert c._pool.call(p.Nodes()) is not None  # connected, told about attaching
        values = {f"k{n}": os.urandom(n) for n in SIZES}
        for key, value in values.items():
            c.put(key, value)
        assert c.get("k1") == values["k1"]  # learns which memory the master attaches from
        reads = _node_reads(hosted)
        for key, value in values.items():
            assert c.get(key) == value
        assert reads[0] == 0  # each came with the master's answer, none from the node
        # A batch over the limit (4 MiB): what fits comes attached, the rest is read.
        assert c.batch_get(list(values)) == list(values.values())
        assert reads[0] == 3 << 20  # the 3 MiB value, not the ones that fitted before it
        c.put("empty", b"")
        assert c.get("empty") == b""
        with pytest.raises(ObjectNotFoundError):
            c.get("missing")
    assert _inflight(hosted) == 0  # every view of the node's memory handed back


@pytest.mark.parametrize("registered", [True, False])
def test_bytes_land_in_caller_buffers(hosted: Cluster, registered: bool) -> None:
    with StoreClient(hosted.address, transport="tcp") as c:
        values = [os.urandom(65536) for _ in range(4)]
        c.batch_put([(f"b{i}", v) for i, v in enumerate(values)])
        arena = bytearray(3 * 65536)
        if registered:
            c.register_buffer(arena)
        view = memoryview(arena)
        bufs: list[Any] = [view[i * 65536:(i + 1) * 65536] for i in range(3)] + [
            bytearray(10)]
        assert c.get("b3") == values[3]  # learns which memory the master attaches from
        reads = _node_reads(hosted)
        got = c.batch_get_into([f"b{i}" for i in range(4)], bufs)
        assert got[:3] == [65536] * 3
        assert [bytes(b) for b in bufs[:3]] == values[:3]
        assert not isinstance(got[3], int)  # too small: an error ...
        assert reads[0] == 0  # ... and its attached bytes were consumed, not read again
        # the connection is still in step: the next exchanges work
        assert c.get("b3") == values[3]
        assert c.exists("b0")


def test_limits_of_both_sides(hosted: Cluster) -> None:
    values = {f"l{i}": os.urandom(4096) for i in range(6)}
    with StoreClient(hosted.address, transport="tcp", attached_bytes=2 * 4096) as c:
        c.batch_put(list(values.items()))
        real = c._recv_attached
        attached: list[list[int]] = []

        def spy(conn: Any, reply: p.GetReply, *args: Any) -> Any:
            attached.append(list(reply.attached))
            return real(conn, reply, *args)

        c._recv_attached = spy  # type: ignore[method-assign]
        assert c.batch_get(list(values)) == list(values.values())
        assert attached == [[0, 1]]  # only what fits the client's limit; the rest read
    hosted.server.attached_bytes = 4096
    with StoreClient(hosted.address, transport="tcp") as c:
        c.put("big", os.urandom(8192))
        reads = _node_reads(hosted)
        assert len(c.get("big")) == 8192  # over the master's limit: read from the node
        assert reads[0] == 8192
    with StoreClient(hosted.address, transport="tcp", attached_bytes=0) as c:
        reads = _node_reads(hosted)
        assert c.get("l0") == values["l0"]  # attaching turned off by the client
        assert reads[0] == 4096


def test_corrupt_bytes_are_never_returned(hosted: Cluster) -> None:
    with StoreClient(hosted.address, transport="tcp") as c:
        c.put("k", os.urandom(4096))
        assert c.exists("k")  # its report landed (same connection, in order)
        slot = hosted.server.core.get(p.Get(keys=["k"], lease=False)).slots[0]
        assert isinstance(slot, p.GetSlot)
        loc = slot.locations[0]
        hosted.nodes["a"]._buffer.view[loc.offset:loc.offset + 16] = bytes(16)
        c.put("w", b"w" * 100)
        assert c.get("w") == b"w" * 100  # learns which memory the master attaches from
        reads = _node_reads(hosted)
        with pytest.raises(ChecksumMismatchError):
            c.get("k")
        assert reads[0] == 4096  # the attached bytes failed: the node was read as well
        assert c.exists("k")  # in step after the failed get


def test_master_limits_what_a_request_asks(hosted: Cluster) -> None:
    """A raw request asking for more than the master's limit (or a negative amount) gets at
    most the master's limit behind the reply."""
    with StoreClient(hosted.address, transport="tcp") as c:
        for i in range(3):
            c.put(f"r{i}", os.urandom(1 << 20))
    hosted.server.attached_bytes = 1 << 20
    conn = MasterConnection(hosted.address)
    try:
        assert conn.attached_bytes == 1 << 20
        for asked, expect in ((1 << 40, [0]), (-5, []), (100, [])):
            conn.send(p.Get(keys=["r0", "r1", "r2"], lease=False, attached_bytes=asked))
            reply = conn.recv()
            assert isinstance(reply, p.GetReply)
            assert reply.attached == expect
            views = [memoryview(bytearray(1 << 20)) for _ in reply.attached]
            conn.recv_data(views)
        assert isinstance(conn.call(p.Exists(keys=["r0"])), p.Bools)  # still in step
    finally:
        conn.close()


def test_a_master_without_a_node_attaches_nothing(cluster: Cluster) -> None:
    cluster.add_node("a", capacity_bytes=4 << 20)
    conn = MasterConnection(cluster.address)
    try:
        assert conn.attached_bytes == 0
    finally:
        conn.close()
    with StoreClient(cluster.address, transport="tcp") as c:
        c.put("k", b"x" * 100)
        reads = _node_reads(cluster)
        assert c.get("k") == b"x" * 100
        assert reads[0] == 100


def test_node_memory_is_retired_only_after_attached_sends_end(hosted: Cluster) -> None:
    """A node declared dead renews its memory; the old segment is unregistered only once
    no attached send holds it any more, and is never lent again after that."""
    node = hosted.nodes["a"]
    with StoreClient(hosted.address, transport="tcp") as c:
        c.put("k", os.urandom(4096))
        assert c.get("k") is not None
        old = node.segment
        held = node.hold(old, 0, 4096)  # as a send in progress does
        assert held is not None
        node._renew()  # what a node declared dead does: new memory, old one retired
        assert old in node.engine._segments  # still lent: not unregistered yet
        held[1]()  # the send ends
        node._unregister_retired()  # the next heartbeat's retry
        assert old not in node.engine._segments
        assert node.hold(old, 0, 16) is None  # retired memory is not lent again


def test_same_host_client_copies_from_mapped_memory_instead(hosted: Cluster) -> None:
    """A client that can map the node's memory (same host) stops asking for attached
    bytes once it knows where the master's node memory is: a copy out of the mapping is
    cheaper than bytes over a socket."""
    with StoreClient(hosted.address, transport="auto") as c:
        value = os.urandom(65536)
        c.put("k", value)
        calls: list[int] = []
        real = c._recv_attached

        def spy(conn: Any, reply: p.GetReply, *args: Any) -> Any:
            calls.append(len(reply.attached))
            return real(conn, reply, *args)

        c._recv_attached = spy  # type: ignore[method-assign]
        for _ in range(3):
            assert c.get("k") == value
        assert len(calls) <= 1  # at most the first get, before the memory was known
        assert hosted.nodes["a"].segment in c._data.inline


def test_only_the_memory_bytes_came_from_is_learned(hosted: Cluster) -> None:
    """With replicas on the hosted node and on a node elsewhere, the client learns only the
    hosted node's memory as attached (reads of the other node keep their early reads)."""
    remote = hosted.add_node("b", capacity_bytes=16 << 20)
    with StoreClient(hosted.address, transport="tcp", replicas=2) as c:
        c.put("k", os.urandom(4096))
        assert c.exists("k")
        c.get("k")
        assert c._recall.attached == {hosted.nodes["a"].segment}
        assert remote.segment not in c._recall.attached


def test_a_client_that_stops_reading_is_dropped(hosted: Cluster) -> None:
    """A client that never reads a large attached reply must not hold the master's thread
    and the node's memory: the send times out, the connection closes, the hold ends."""
    hosted.server.send_timeout_s = 0.5
    hosted.server.attached_bytes = 32 << 20  # more than the socket buffers can take
    with StoreClient(hosted.address, transport="tcp") as c:
        c.put("big", os.urandom(24 << 20))
        assert c.exists("big")
    conn = MasterConnection(hosted.address)
    try:
        conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.send(p.Get(keys=["big"], lease=False, attached_bytes=32 << 20))
        deadline = time.monotonic() + 10
        while _inflight(hosted) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _inflight(hosted) == 1  # the send started and stalls, holding the memory
        while _inflight(hosted) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _inflight(hosted) == 0  # it gave up and released the memory
    finally:
        conn.close()
    with StoreClient(hosted.address, transport="tcp") as c:
        assert len(c.get("big")) == 24 << 20  # and the master serves others


def test_batch_into_buffers_learns_the_attached_memory(hosted: Cluster) -> None:
    """Reading into caller buffers also teaches the client which memory comes attached:
    the next batch starts no early reads of it (they would move the same bytes twice)."""
    with StoreClient(hosted.address, transport="tcp") as c:
        values = [os.urandom(65536) for _ in range(4)]
        keys = [f"m{i}" for i in range(4)]
        c.batch_put(list(zip(keys, values, strict=True)))
        arena = bytearray(4 * 65536)
        c.register_buffer(arena)
        bufs = [memoryview(arena)[i * 65536:(i + 1) * 65536] for i in range(4)]
        assert c.batch_get_into(keys, bufs) == [65536] * 4  # the first may read early
        assert c._recall.attached == {hosted.nodes["a"].segment}
        reads = _node_reads(hosted)
        assert c.batch_get_into(keys, bufs) == [65536] * 4
        assert [bytes(b) for b in bufs] == values
        assert reads[0] == 0


def test_spin_setting_reaches_master_and_node_waits(hosted: Cluster) -> None:
    """StoreClient(spin_us=...) sets how both the master's and the nodes' replies are
    waited for; 0 turns polling off everywhere."""
    with StoreClient(hosted.address, transport="tcp", spin_us=0) as off, \
            StoreClient(hosted.address, transport="tcp") as on:
        for c in (off, on):
            c.put("k", b"v" * 10)
            assert c.get("k") == b"v" * 10
        with off._pool.connection() as conn:
            assert conn._reader.poller.spin_s == 0
        assert off.engine._tcp.spin_s == 0
        with on._pool.connection() as conn:
            assert conn._reader.poller.spin_s > 0
        assert on.engine._tcp.spin_s > 0
