"""Replies that carry keys fit the master's 4 MiB frame (issue 27.12).

A batch within the 4,096-key limit could still make a frame too large: 1,100 keys of
4,000 bytes raised ``FrameError: frame of 4403316 bytes exceeds the limit of 4194304``
from ``batch_get`` with no per-key result (gets were split by count only; a get reply
repeats every key with its locations). Now the client cuts gets by bytes, the master
leaves out of a full reply what does not fit (``reply_full`` slots, their leases ended)
and the client asks for those keys again; leases to end and shared-tier reports travel
in bounded pieces too.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.rpc import MasterConnection
from kvctl.store.settings import StoreSettings

LIMIT = p.DEFAULT_MAX_FRAME_BYTES


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=64 << 20)) as running:
        yield running.address


def _long_keys(tag: str, n: int, length: int = p.MAX_KEY_BYTES) -> list[str]:
    return [f"{tag}/{i:05d}/".ljust(length, "k") for i in range(n)]


def _put_all(client: StoreClient, keys: list[str], size: int) -> None:
    for start in range(0, len(keys), 200):
        errors = client.batch_put([(k, bytes([i % 251]) * size)
                                   for i, k in enumerate(keys[start:start + 200], start)])
        assert not any(errors), errors[:3]


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_batch_get_of_max_length_keys_returns_every_value(store: str, transport: str
                                                           ) -> None:
    keys = _long_keys(f"g{transport}", 1100)  # 4.5 MB of keys in, more out
    with StoreClient(store, transport=transport) as client:
        _put_all(client, keys, 4096)
        got = client.batch_get(keys)
        assert [g if isinstance(g, bytes) else type(g).__name__ for g in got] == [
            bytes([i % 251]) * 4096 for i in range(len(keys))]
        buffers = [bytearray(4096) for _ in keys]
        assert client.batch_get_into(keys, buffers) == [4096] * len(keys)
        assert buffers[1099] == bytes([1099 % 251]) * 4096
        # twice 1,100 finished leases to end: sent in pieces, and the next get works
        assert client.get(keys[0]) == bytes(4096)
        assert client.batch_exists([*keys, "no-such"]) == [True] * len(keys) + [False]
        objects, _ = client.list(f"g{transport}/", limit=4096)
        assert [o.key for o in objects] == keys[:len(objects)]
        assert len(objects) > 900
        # the finished reads' leases were ended (a few wait for the next request)
        assert sum(o.lease_remaining_s > 0 for o in objects) < 300
        assert client.batch_remove(keys) == [True] * len(keys)


def test_missing_max_length_keys_answer_per_key(store: str) -> None:
    keys = _long_keys("miss", 1100)
    with StoreClient(store) as client:
        got = client.batch_get(keys)
    assert [type(g).__name__ for g in got] == ["ObjectNotFoundError"] * len(keys)


def test_the_master_leaves_out_what_does_not_fit_and_ends_those_leases(store: str) -> None:
    # a request just under the frame limit (1,020 x 4,093 bytes) whose reply is over it
    keys = _long_keys("raw", 1020, 4090)
    with StoreClient(store) as client:
        _put_all(client, keys, 64)
    conn = MasterConnection(store)
    try:
        reply = conn.call(p.Get(keys=keys))
        assert isinstance(reply, p.GetReply)
        full = [i for i, s in enumerate(reply.slots)
                if isinstance(s, p.ErrorInfo) and s.code == p.REPLY_FULL]
        assert full
        assert full == list(range(full[0], len(keys)))
        assert all(isinstance(s, p.GetSlot) and s.key == k
                   for s, k in zip(reply.slots[:full[0]], keys, strict=False))
        assert len(conn._codec.encode(reply)) <= LIMIT
        # the connection is still in step, and left-out keys hold no lease
        stat = conn.call(p.Stat(key=keys[full[0]]))
        assert isinstance(stat, p.StatReply)
        assert stat.info.lease_remaining_s == 0
        stat = conn.call(p.Stat(key=keys[0]))
        assert isinstance(stat, p.StatReply)
        assert stat.info.lease_remaining_s > 0
    finally:
        conn.close()


def _reply(n: int, key_bytes: int) -> p.GetReply:
    return p.GetReply(slots=[p.GetSlot(key=f"{i:05d}".ljust(key_bytes, "x"), size=4096,
                                       checksum=i, version=i + 1,
                                       locations=[p.Location("node-a", "seg", i << 12, 4096)])
                             for i in range(n)])


def _budget_for(reply: p.GetReply) -> int:
    """The smallest frame limit ``fit_get_reply`` sends ``reply`` whole in."""
    n = len(reply.slots)
    return sum(len(msgspec.msgpack.encode(s)) for s in reply.slots) + 1024 + 10 * n


def test_fit_at_the_boundary_just_under_and_just_over() -> None:
    n = 1100
    reply = _reply(n, 4000)
    exact = _budget_for(reply)
    assert exact > LIMIT  # the case of the issue: too large for one frame
    same, left = p.fit_get_reply(reply, exact)
    assert same is reply
    assert left == []
    cut, left = p.fit_get_reply(reply, exact - 1)  # one byte short: the last slot waits
    assert left == [n - 1]
    assert cut.slots[:n - 1] == reply.slots[:n - 1]
    assert isinstance(cut.slots[n - 1], p.ErrorInfo)
    assert cut.slots[n - 1].code == p.REPLY_FULL
    cut, left = p.fit_get_reply(reply, LIMIT)
    assert left
    assert left == list(range(left[0], n))
    assert len(msgspec.msgpack.encode(cut)) + 10 * n + 1024 <= LIMIT
    key_bytes = 4000 - (exact - LIMIT) // n
    for _ in range(50):  # the longest keys whose reply is just under the limit
        under = _reply(n, key_bytes)
        if _budget_for(under) <= LIMIT:
            break
        key_bytes -= 1
    assert _budget_for(_reply(n, key_bytes + 1)) > LIMIT >= _budget_for(under)
    assert p.fit_get_reply(under, LIMIT) == (under, [])  # just under: whole
    assert p.fit_get_reply(_reply(n, key_bytes + 1), LIMIT)[1] == [n - 1]  # just over


def test_small_replies_are_not_measured() -> None:
    reply = _reply(64, 4096)
    assert p.fit_get_reply(reply, 1)[0] is reply  # 64 slots always fit a real frame


def test_keys_left_out_of_a_full_reply_are_asked_again(store: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.store import client as client_mod

    keys = _long_keys("again", 1100)
    # A client that sends more than fits the answer (as one that under-estimates the
    # locations would): the master leaves some out, and they are asked for again.
    monkeypatch.setattr(client_mod, "_SLOT_BYTES", -2040)  # 1,020 keys a request
    with StoreClient(store, attached_bytes=0) as client:
        _put_all(client, keys, 1024)
        got = client.batch_get(keys)
    assert got == [bytes([i % 251]) * 1024 for i in range(len(keys))]


def test_a_master_with_smaller_frames_gets_requests_that_fit() -> None:
    from kvctl.store.master import MasterConfig, MasterCore
    from kvctl.store.node import StorageNode
    from kvctl.store.server import MasterServer

    server = MasterServer(MasterCore(MasterConfig()), max_frame_bytes=1 << 20)
    node = StorageNode(server.address, node_id="small-frames", capacity_bytes=16 << 20)
    try:
        keys = _long_keys("small", 600)  # 2.4 MB of keys against 1 MiB frames
        with StoreClient(server.address) as client:
            assert client.batch_put([(k, b"v") for k in keys]) == [None] * len(keys)
            assert client.batch_get(keys) == [b"v"] * len(keys)
            assert client.batch_exists(keys) == [True] * len(keys)
            assert client.batch_remove(keys) == [True] * len(keys)
    finally:
        node.close()
        server.close()


def test_a_heartbeat_hands_out_tasks_in_pieces_that_fit() -> None:
    from collections import deque

    from kvctl.store.master import liveness

    tasks = deque(p.Task(task_id=i, op="persist", key=f"{i:05d}".ljust(p.MAX_KEY_BYTES, "t"),
                         version=1, offset=0, size=1, checksum=0) for i in range(3000))
    pieces = []
    while tasks:
        pieces.append(liveness._take_tasks(tasks, liveness.TASK_REPLY_BYTES))
    assert sum(map(len, pieces)) == 3000
    assert [t.task_id for piece in pieces for t in piece] == list(range(3000))  # in order
    assert all(len(msgspec.msgpack.encode(p.Tasks(tasks=piece))) <= LIMIT // 2
               for piece in pieces)  # (one piece of all 3,000 would be 12 MB)
    one = deque([p.Task(task_id=0, op="pack", key="", version=1, offset=0, size=0, checksum=0,
                        entries=[p.PackEntry("k" * 4096, 1, 0, 1, 0, 0)] * 4096)])
    assert len(liveness._take_tasks(one, 1)) == 1  # at least one, however large
