"""Reservations: clients place small puts in space the master set aside for them.

The master keeps the rules (objects only in unused parts of a live reservation of the same
namespace, unused space given back on end, expiry or node death, a cap per node); the client
makes one master round trip per put and falls back to the master when it cannot reserve or
the master that granted the reservation is gone.
"""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store import protocol as p
from kvctl.store.arena import Arena, Arenas
from kvctl.store.client import StoreClient
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.server import MasterServer
from tests.fixtures.threads import run_threads
from tests.store.conftest import Cluster, wait_for
from tests.store.test_master import Clock, assert_no_overlap, node, put

CFG = MasterConfig(reservation_share=0.25, reservations_share=0.5)


def reserve(core: MasterCore, size: int, replicas: int = 1, namespace: str = ""
            ) -> p.Reservation:
    grant = core.reserve(p.Reserve(size=size, replicas=replicas), namespace)
    assert isinstance(grant, p.Reservation), grant
    return grant


def put_at(core: MasterCore, grant: p.Reservation, items: list[tuple[str, int, int]], *,
           end: bool = False, namespace: str = "") -> None:
    """``items``: (key, size, offset) with checksum = size."""
    core.put_at(p.PutAt(reservation=grant.reservation, keys=[k for k, _, _ in items],
                        sizes=[s for _, s, _ in items], checksums=[s for _, s, _ in items],
                        offsets=[o for _, _, o in items], end=end), namespace)


def located(core: MasterCore, key: str) -> p.GetSlot:
    slot = core.get(p.Get(keys=[key], lease=False)).slots[0]
    assert isinstance(slot, p.GetSlot), slot
    return slot


# ---------------------------------------------------------------- master


def test_objects_land_where_the_client_placed_them_on_every_replica() -> None:
    core = MasterCore(CFG)
    node(core, "a", 1 << 20)
    node(core, "b", 1 << 20)
    grant = reserve(core, 128 << 10, replicas=2)
    assert {loc.node_id for loc in grant.locations} == {"a", "b"}
    assert all(loc.size == 128 << 10 for loc in grant.locations)
    assert core.status().reserved_bytes == 2 * (128 << 10)
    put_at(core, grant, [("x", 1000, 0), ("y", 5000, 4096)])
    starts = {loc.node_id: loc.offset for loc in grant.locations}
    for key, rel in (("x", 0), ("y", 4096)):
        slot = located(core, key)
        assert {(loc.node_id, loc.offset) for loc in slot.locations} == {
            (nid, start + rel) for nid, start in starts.items()}
    assert core.exists(["x", "y"]) == [True, True]
    assert_no_overlap(core)
    put_at(core, grant, [], end=True)  # the rest goes back to the nodes
    assert core.status().reserved_bytes == 0
    used = {nid: u for nid, (u, _) in core.node_usage().items()}
    assert used == {"a": 1024 + 5056, "b": 1024 + 5056}  # just the two objects (rounded)
    assert_no_overlap(core)


def test_items_outside_unused_space_are_dropped_and_the_rest_kept() -> None:
    core = MasterCore(CFG)
    node(core, "a", 1 << 20)
    grant = reserve(core, 64 << 10)
    put_at(core, grant, [("ok1", 100, 0),
                         ("overlap", 100, 0),          # on top of ok1
                         ("misaligned", 100, 100),     # not on the 64-byte grid
                         ("past-end", 4096, 62 << 10),  # runs out of the reservation
                         ("negative", 10, -64),
                         ("ok2", 100, 1024)])
    assert core.exists(["ok1", "overlap", "misaligned", "past-end", "negative", "ok2"]) == [
        True, False, False, False, False, True]
    assert located(core, "ok1").size == 100
    assert_no_overlap(core)


def test_wrong_reservation_or_namespace_installs_nothing() -> None:
    core = MasterCore(CFG)
    node(core, "a", 1 << 20)
    grant = reserve(core, 64 << 10, namespace="team-a/")
    core.put_at(p.PutAt(reservation=grant.reservation + 1, keys=["team-a/k"], sizes=[10],
                        checksums=[1], offsets=[0]), "team-a/")
    put_at(core, grant, [("team-b/k", 10, 0)], namespace="team-b/")
    put_at(core, grant, [("k", 10, 0)])  # admin connection: not this reservation's namespace
    assert core.exists(["team-a/k", "team-b/k", "k"]) == [False, False, False]
    put_at(core, grant, [("team-a/k", 10, 0)], namespace="team-a/")
    assert core.exists(["team-a/k"]) == [True]


def test_unused_reservation_expires_and_late_puts_are_dropped() -> None:
    clock = Clock()
    core = MasterCore(MasterConfig(reservation_share=0.25, pending_ttl_s=30.0), clock=clock)
    node(core, "a", 1 << 20)
    grant = reserve(core, 64 << 10)
    clock.now += 20
    put_at(core, grant, [("k1", 10, 0)])  # use extends the TTL
    clock.now += 20
    core.heartbeat(p.Heartbeat(node_id="a", epoch="e1"))
    core.tick()
    assert core.status().reserved_bytes > 0  # 20 s since its last use: still held
    clock.now += 11
    core.heartbeat(p.Heartbeat(node_id="a", epoch="e1"))
    core.tick()
    assert core.status().reserved_bytes == 0
    put_at(core, grant, [("k2", 10, 64)])
    assert core.exists(["k1", "k2"]) == [True, False]
    assert core.node_usage()["a"][0] == 64  # only k1 left
    assert_no_overlap(core)


def test_dead_node_leaves_the_reservation_on_the_others() -> None:
    """A suspect node keeps its part of a reservation (puts reported there are kept with
    its objects, read from the others); a dropped one leaves it."""
    clock = Clock()
    core = MasterCore(MasterConfig(reservation_share=0.25, node_timeout_s=3.0,
                                   node_grace_s=10.0), clock=clock)
    node(core, "a", 1 << 20)
    node(core, "b", 1 << 20)
    grant = reserve(core, 64 << 10, replicas=2)

    def silence_b(seconds: float) -> None:
        for _ in range(int(seconds / 0.5)):
            clock.now += 0.5
            core.heartbeat(p.Heartbeat(node_id="a", epoch="e1"))
            core.tick()

    silence_b(5)  # b is suspect
    put_at(core, grant, [("k", 100, 0)])
    assert [loc.node_id for loc in located(core, "k").locations] == ["a"]
    assert sorted(core.stat("k").replicas) == ["a", "b"]  # type: ignore[union-attr]
    silence_b(10)  # b is dropped
    put_at(core, grant, [("k2", 100, 128)])
    assert [loc.node_id for loc in located(core, "k2").locations] == ["a"]
    assert core.stat("k").replicas == ["a"]  # type: ignore[union-attr]
    assert_no_overlap(core)


def test_reservations_are_capped_per_node_and_evict_like_puts() -> None:
    core = MasterCore(MasterConfig(reservation_share=0.25, reservations_share=0.5))
    node(core, "a", 1 << 20)
    big = reserve(core, 1 << 20)
    assert big.locations[0].size == 256 << 10  # one reservation: a quarter of the node
    reserve(core, 1 << 20)
    refused = core.reserve(p.Reserve(size=1 << 20))  # all reservations: half the node
    assert isinstance(refused, p.ErrorInfo)
    assert refused.code == "full"
    assert isinstance(core.reserve(p.Reserve(size=1 << 20, replicas=2)), p.ErrorInfo)
    # A node full of objects makes room for a reservation by evicting the oldest.
    core2 = MasterCore(MasterConfig(reservation_share=0.25, high_watermark=1.0,
                                    evict_ratio=0.0))
    node(core2, "a", 1 << 20)
    for i in range(16):
        assert isinstance(put(core2, f"k{i}", 64 << 10), p.PutSlot)
    reserve(core2, 128 << 10)
    assert core2.exists(["k0", "k1", "k2"]) == [False, False, True]
    assert_no_overlap(core2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "rm", "tick", "reserve", "put_at", "end"]),
                          st.integers(0, 30), st.integers(1, 20_000)), max_size=80))
def test_invariants_with_reservations(ops: list[tuple[str, int, int]]) -> None:
    """No two allocations overlap, usage equals what is allocated, and an object reported
    in a reservation always lies inside it."""
    clock = Clock()
    core = MasterCore(MasterConfig(high_watermark=0.9, evict_ratio=0.2,
                                   reservation_share=0.5, reservations_share=0.75,
                                   pending_ttl_s=3.0), clock=clock)
    node(core, "a", 128 * 1024)
    node(core, "b", 96 * 1024)
    grants: list[p.Reservation] = []
    for op, k, size in ops:
        key = f"k{k}"
        if op == "put":
            put(core, key, size, replicas=1 + k % 2, checksum=size)
        elif op == "rm":
            core.remove([key])
        elif op == "tick":
            clock.now += 1.0
            core.tick()
            core.heartbeat(p.Heartbeat(node_id="a", epoch="e1"))
            core.heartbeat(p.Heartbeat(node_id="b", epoch="e1"))
        elif op == "reserve":
            grant = core.reserve(p.Reserve(size=size * 2, replicas=1 + k % 2))
            if isinstance(grant, p.Reservation):
                grants.append(grant)
        elif grants:
            grant = grants[k % len(grants)]
            if op == "put_at":
                rel = (size * 64) % (grant.locations[0].size + 128)  # in range or not
                put_at(core, grant, [(key, size % 3000, rel)])
                slot = core.get(p.Get(keys=[key], lease=False)).slots[0]
                if isinstance(slot, p.GetSlot) and slot.size == size % 3000:
                    for loc in slot.locations:
                        inside = [g for g in grant.locations if g.node_id == loc.node_id]
                        if inside and loc.offset - inside[0].offset == rel:
                            assert rel + loc.size <= inside[0].size
            else:
                put_at(core, grant, [], end=True)
        assert_no_overlap(core)


# ---------------------------------------------------------------- client bookkeeping


def _grant(size: int = 4096, rid: int = 7) -> p.Reservation:
    return p.Reservation(reservation=rid, alignment=64, ttl_s=30.0,
                         locations=[p.Location("a", "seg-a", 1 << 20, size)])


def test_arena_ends_only_after_its_last_put_in_flight() -> None:
    """A retired reservation ends with the report of its last put in flight, counting
    every report sent for it (they travel on several connections: the master waits for
    the count)."""
    ended: list[tuple[int, int]] = []
    grants = iter([_grant(rid=1), _grant(rid=2)])
    arenas = Arenas(8192, 1, lambda size, replicas: (next(grants), "m1"),
                    lambda arena, count: ended.append((arena.rid, count)))
    first, offsets = arenas.place([1000, 1000]) or (None, [])
    assert isinstance(first, Arena)
    assert offsets == [0, 1024]
    assert arenas.place([5000]) is None  # over half of what the client asks for: master
    second = arenas.place([1000])
    assert second is not None
    assert second[0] is first
    assert second[1] == [2048]
    third = arenas.place([1500])  # does not fit: a new reservation; the first is retired
    assert third is not None
    assert third[0].rid == 2
    assert ended == []  # two puts still writing into the first
    assert arenas.done(first, report=True) is None
    assert arenas.done(first, report=True) == 2  # the last report ends it: 2 in all
    arenas.close()  # the second has a put in flight: not ended yet
    assert ended == []
    assert arenas.done(third[0], report=False) == 1  # gave up: an end of its own
    assert ended == []  # an end returned by done() is the caller's to send


def test_arena_is_not_used_past_half_its_ttl_and_refusals_back_off() -> None:
    clock = Clock()
    ended: list[tuple[int, int]] = []
    answers: list[tuple[p.Reservation, str] | None] = [(_grant(rid=1), "m1"), None,
                                                       (_grant(rid=3), "m1")]
    arenas = Arenas(8192, 1, lambda size, replicas: answers.pop(0),
                    lambda arena, count: ended.append((arena.rid, count)), clock=clock)
    placed = arenas.place([100])
    assert placed is not None
    assert arenas.done(placed[0], report=True) is None
    clock.now += 16  # past 15 s: retired and ended (1 report + the end), a new one refused
    assert arenas.place([100]) is None
    assert ended == [(1, 2)]
    clock.now += 0.5
    assert arenas.place([100]) is None
    assert answers  # refused recently: not asked again
    clock.now += 1.0
    again = arenas.place([100])
    assert again is not None
    assert again[0].rid == 3


def test_end_waits_for_reports_still_on_the_way() -> None:
    """The end may overtake reports sent on other connections: the master ends the
    reservation only when it has taken as many reports as the end names."""
    core = MasterCore(CFG)
    node(core, "a", 1 << 20)
    grant = reserve(core, 64 << 10)
    core.put_at(p.PutAt(reservation=grant.reservation, keys=["a"], sizes=[10], checksums=[1],
                        offsets=[0], end=True, count=3))
    assert core.status().reserved_bytes > 0  # 1 of 3 taken
    put_at(core, grant, [("b", 10, 64)])
    assert core.status().reserved_bytes > 0  # 2 of 3
    put_at(core, grant, [("c", 10, 128)])
    assert core.exists(["a", "b", "c"]) == [True, True, True]
    assert core.status().reserved_bytes == 0
    assert_no_overlap(core)


# ---------------------------------------------------------------- client against a master


def _count_master_puts(cluster: Cluster) -> list[int]:
    calls = [0]
    real = cluster.server.core.put

    def counting(msg: p.Put) -> list[p.PutSlot | p.ErrorInfo]:
        calls[0] += 1
        return real(msg)

    cluster.server.core.put = counting  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_small_puts_skip_the_master_allocation(cluster: Cluster, transport: str) -> None:
    cluster.add_node("a", capacity_bytes=64 << 20)
    calls = _count_master_puts(cluster)
    with StoreClient(cluster.address, transport=transport) as client:
        values = {f"k{i}": os.urandom(1000 + 997 * i) for i in range(20)}
        for key, value in values.items():
            client.put(key, value)
        client.batch_put([(f"b{i}", v) for i, v in enumerate(values.values())])
        assert calls[0] == 0  # every put placed in the client's reservation
        assert client.batch_get(list(values)) == list(values.values())
        assert client.batch_get([f"b{i}" for i in range(20)]) == list(values.values())
        big = os.urandom(9 << 20)  # over half a reservation: through the master
        client.put("big", big)
        assert calls[0] == 1
        assert client.get("big") == big
        assert cluster.server.core.status().reserved_bytes > 0
    # close gives the unused space back (its message has no reply: wait for it)
    wait_for(lambda: cluster.server.core.status().reserved_bytes == 0, what="reservation end")
    assert_no_overlap(cluster.server.core)


def test_batches_over_one_report_go_through_the_master(cluster: Cluster) -> None:
    """A report has no reply, so it must fit one master frame: a batch with more keys than
    a request may carry is put through the master in chunks instead, nothing dropped."""
    cluster.add_node("a", capacity_bytes=64 << 20)
    calls = _count_master_puts(cluster)
    with StoreClient(cluster.address, transport="tcp") as client:
        items = [(f"k{i}", b"v%d" % i) for i in range(p.MAX_BATCH + 10)]
        assert client.batch_put(items) == [None] * len(items)
        assert calls[0] == 2  # two chunks through the master
        assert client.batch_get([k for k, _ in items]) == [v for _, v in items]


def test_reserve_off_puts_through_the_master(cluster: Cluster) -> None:
    cluster.add_node("a", capacity_bytes=16 << 20)
    calls = _count_master_puts(cluster)
    with StoreClient(cluster.address, transport="tcp", reserve_bytes=0) as client:
        client.put("k", b"v" * 5000)
        assert client.get("k") == b"v" * 5000
    assert calls[0] == 1
    assert cluster.server.core.status().reserved_bytes == 0


def test_concurrent_puts_share_a_reservation_without_overlap(cluster: Cluster) -> None:
    cluster.add_node("a", capacity_bytes=64 << 20)
    values = {f"t{t}/{i}": os.urandom(4096 + 64 * i) for t in range(4) for i in range(40)}
    with StoreClient(cluster.address, transport="tcp", reserve_bytes=256 << 10) as client:
        def work(t: int) -> None:
            for i in range(40):
                key = f"t{t}/{i}"
                client.put(key, values[key])

        run_threads(work, 4)
        # A put's report travels without a reply on one of the pool's connections: the
        # main thread's next request may overtake reports of the other threads' last puts.
        wait_for(lambda: all(client.batch_exists(list(values))), what="every report")
        assert client.batch_get(list(values)) == list(values.values())
    assert_no_overlap(cluster.server.core)


def test_master_restart_sends_puts_through_the_new_master() -> None:
    """A reservation dies with the master that granted it: after a restart on the same
    address the client neither writes into it nor reports to it; it puts through the new
    master, then reserves from it."""
    first = Cluster(MasterConfig(node_timeout_s=2.0))
    host, port = first.address.rsplit(":", 1)
    first.add_node("a", capacity_bytes=32 << 20)
    client = StoreClient(first.address, transport="tcp")
    second: Cluster | None = None
    try:
        client.put("before", b"1" * 3000)
        assert client.get("before") == b"1" * 3000
        first.server.close()  # master restarts (node a stays up, its memory intact)
        second = Cluster(MasterConfig(node_timeout_s=2.0))
        second.server.close()
        second.server = MasterServer(MasterCore(MasterConfig(node_timeout_s=2.0)),
                                     host=host, port=int(port))
        second.add_node("b", capacity_bytes=32 << 20)
        calls = _count_master_puts(second)
        node_a = first.nodes["a"]
        before = bytes(node_a._buffer.view[:8192])
        client.put("after", b"2" * 3000)
        assert calls[0] == 1  # through the new master
        assert bytes(node_a._buffer.view[:8192]) == before  # old reservation untouched
        assert client.get("after") == b"2" * 3000
        client.put("again", b"3" * 3000)
        assert calls[0] == 1  # a reservation from the new master
        assert client.get("again") == b"3" * 3000
        assert_no_overlap(second.server.core)
    finally:
        client.close()
        if second is not None:
            second.close()
        for n in first.nodes.values():
            n.close()


# ---------------------------------------------------------------- review findings


def test_one_threads_puts_land_in_order_while_others_churn(cluster: Cluster) -> None:
    """Reports get no reply: a thread's successive puts of one key, and its get right
    after, must reach the master in order even while other threads use the client (each
    thread has a connection of its own)."""
    cluster.add_node("a", capacity_bytes=64 << 20)
    stop = threading.Event()
    errors: list[BaseException] = []
    with StoreClient(cluster.address, transport="tcp") as client:
        def churn(t: int) -> None:
            try:
                i = 0
                while not stop.is_set() and i < 2000:
                    client.put(f"other{t}/{i % 50}", os.urandom(2048))
                    client.exists(f"other{t}/{(i * 7) % 50}")
                    i += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        others = [threading.Thread(target=churn, args=(t,)) for t in range(3)]
        for th in others:
            th.start()
        try:
            for i in range(150):
                value = b"%d-" % i + os.urandom(1000)
                client.put("k", value)
                assert client.get("k") == value  # its own write, never an older one
        finally:
            stop.set()
            for th in others:
                th.join()
        assert not errors


def test_pool_gives_each_thread_its_own_connection() -> None:
    from kvctl.store.rpc import MasterPool

    server = MasterServer(MasterCore())
    pool = MasterPool(server.address)
    try:
        seen: dict[str, object] = {}

        def use(name: str) -> None:
            with pool.connection() as conn:
                seen[name] = conn
                with pool.connection() as nested:  # same thread, in use: a spare one
                    assert nested is not conn
                    assert isinstance(nested.call(p.Status()), p.StatusReply)
            with pool.connection() as again:
                assert again is seen[name]

        first = threading.Thread(target=use, args=("t1",))
        first.start()
        first.join()
        second = threading.Thread(target=use, args=("t2",))
        second.start()
        second.join()
        assert seen["t1"] is not seen["t2"]
        with pool.connection() as mine:  # opening this one closes the ended threads'
            assert mine is not seen["t1"]
        assert seen["t1"]._sock.fileno() == -1  # type: ignore[attr-defined]
    finally:
        pool.close()
        server.close()


def test_bad_keys_are_refused_not_dropped(cluster: Cluster) -> None:
    """A report gets no reply, so keys the master would refuse are never reported: the put
    goes through the master, which answers with the error."""
    from kvctl.store.errors import BadRequestError

    cluster.add_node("a")
    with StoreClient(cluster.address, transport="tcp") as client:
        for bad in ("", "tab\there", "x" * 5000):
            with pytest.raises(BadRequestError):
                client.put(bad, b"v")
        client.put("fine", b"v")
        assert client.get("fine") == b"v"


def test_late_write_goes_through_the_master(cluster: Cluster) -> None:
    """A put whose write ends too close to its reservation's TTL is not reported (the
    space might be someone else's when the report arrives): it is put through the master,
    and the reservation is not used again."""
    cluster.add_node("a", capacity_bytes=64 << 20)
    calls = _count_master_puts(cluster)
    with StoreClient(cluster.address, transport="tcp") as client:
        client.put("warm", b"w" * 100)
        first = client._arenas._current
        assert first is not None
        client._arenas.late = lambda arena: True  # type: ignore[method-assign]
        client.put("k", b"v" * 3000)
        assert calls[0] == 1
        assert client.get("k") == b"v" * 3000
        assert client._arenas._current is not first


def test_failed_replica_write_goes_through_the_master_on_live_nodes(cluster: Cluster) -> None:
    cluster.add_node("a", capacity_bytes=64 << 20)
    with StoreClient(cluster.address, transport="tcp") as client:
        client.put("warm", b"w" * 100)
        arena = client._arenas._current
        assert arena is not None
        cluster.add_node("b", capacity_bytes=64 << 20)
        cluster.nodes.pop("a").close()  # the reservation's node dies
        wait_for(lambda: [(n.node_id, n.alive) for n in cluster.server.core.status().nodes]
                 == [("a", False), ("b", True)], what="node a suspect")
        client.put("k", b"v" * 3000)  # the placed write fails: retried through the master
        assert client.get("k") == b"v" * 3000
        assert client._arenas._current is not arena


def test_batch_larger_than_the_grant_does_not_churn_reservations() -> None:
    asked: list[int] = []

    def reserve(size: int, replicas: int) -> tuple[p.Reservation, str]:
        asked.append(size)
        return _grant(size=4096, rid=len(asked)), "m1"

    arenas = Arenas(16 << 20, 1, reserve, lambda arena, count: None)
    placed = arenas.place([100])
    assert placed is not None
    arenas.done(placed[0], report=True)
    big = arenas.place([3000])  # fits what is left of the grant
    assert big is not None
    assert big[0] is placed[0]
    # Does not fit any more, and is over half of what the master grants: through the
    # master, without giving the reservation up and asking for a new one each time.
    assert arenas.place([3000]) is None
    assert arenas.place([3000]) is None
    assert asked == [16 << 20]
    again = arenas.place([100])
    assert again is not None
    assert again[0] is placed[0]


def test_reports_extend_the_reservation_carving_does_not() -> None:
    clock = Clock()
    arenas = Arenas(8192, 1, lambda size, replicas: (_grant(), "m1"),
                    lambda arena, count: None, clock=clock)
    placed = arenas.place([100])
    assert placed is not None
    arena = placed[0]
    clock.now += 10
    assert arenas.place([100]) is not None  # carving at 10 s does not extend ...
    assert arena.use_by == 1000.0 + 15
    arenas.done(arena, report=True)  # ... a report sent at 10 s does
    assert arena.use_by == 1010.0 + 15
    assert not arenas.late(arena)
    clock.now += 28.5  # 28.5 s after that report: within 2 s of the master's TTL
    assert arenas.late(arena)


def test_a_node_declared_dead_comes_back_with_new_memory(cluster: Cluster) -> None:
    """The master drops a node that missed heartbeats; when it shows up again it must not
    bring that memory back (clients may still write to locations in it, e.g. their
    reservations): it registers a new segment under a new epoch, the old one disappears,
    and a client holding a reservation in the old memory puts through the master."""
    node = cluster.add_node("a", capacity_bytes=32 << 20)
    core = cluster.server.core
    with StoreClient(cluster.address, transport="tcp") as client:
        client.put("before", b"b" * 3000)
        old_segment, old_epoch = node.segment, node.epoch
        with core._cond:  # it missed its heartbeats (the real tick drops it)
            core._nodes["a"].last_seen -= 100
        core.tick()
        refused = core.register_node(p.RegisterNode(
            node_id="a", epoch=old_epoch, segment=old_segment, endpoint=node.endpoint,
            host_id="h", capacity_bytes=32 << 20))
        assert refused is not None
        assert refused.code == "node_dropped"
        wait_for(lambda: [(n.node_id, n.alive) for n in core.status().nodes] == [("a", True)],
                 what="node registered again")
        assert node.segment != old_segment
        assert node.epoch != old_epoch
        wait_for(lambda: not node._retiring, what="old segment unregistered")
        client.put("after", b"a" * 3000)  # its reservation was in the old memory
        assert client.get("after") == b"a" * 3000
        assert not client.exists("before")  # dropped with the old memory
