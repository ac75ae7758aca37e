"""etcd state at journal speed: changes leave the lock into ordered batched transactions,
acknowledged only once durable; loading is paged."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import msgspec
import pytest

from kvctl.metadata import open_metadata
from kvctl.metadata.etcd import EtcdMetadata
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer
from kvctl.store.state import MetadataState, NodeRecord, ObjectRecord, ReplicaRecord
from kvctl.store.state.writebehind import read_state
from tests.fixtures.servers import ServerProcess
from tests.store.conftest import Cluster, wait_for

pytestmark = pytest.mark.integration


def _records(n: int, prefix: str = "k") -> list[ObjectRecord]:
    return [ObjectRecord(f"{prefix}{i:06d}", 100, i, i + 1, [ReplicaRecord("a", i * 128, 100)],
                         []) for i in range(n)]


def test_changes_are_batched_in_order_and_loaded_in_pages(etcd_url: str) -> None:
    """1,000 changes from one thread become a handful of transactions (log batches) of at
    most 128, one key changed 300 times ends at its last value, and a second state loads
    everything (the log read 16 batches per range request, all at one revision)."""
    cluster = f"wb-{secrets.token_hex(4)}"
    state = MetadataState(etcd_url, cluster_id=cluster, max_txn_ops=128)
    for rec in _records(1000):
        state.put_object(rec)
    for i in range(300):
        state.put_object(ObjectRecord("hot", i, i, i, [], []))
    state.delete_object("k000007")
    assert state.ack(timeout_s=30) is None
    assert state.backlog == 0
    assert state.txns < 1301 / 4, state.txns  # batched, not one request per change
    state.close()
    loader = MetadataState(etcd_url, cluster_id=cluster)
    loaded = loader.load()
    keys = {o.key: o for o in loaded.objects}
    assert len(keys) == 1000
    assert "k000007" not in keys
    assert keys["hot"].size == 299
    loader.close()


def test_acknowledged_only_when_durable_and_refused_while_etcd_is_down(
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """A commit that asks for an ack gets it once etcd has the object; with etcd stopped
    the ack fails after ``ack_timeout_s`` and new puts are refused with the cause, while
    gets keep being served at once (the old master blocked its lock for 2 s per write);
    when etcd is back the change is written and puts resume."""
    etcd = spawn_etcd()
    cluster = f"wb-{secrets.token_hex(4)}"
    core = MasterCore(MasterConfig(node_timeout_s=1e6),
                      state=MetadataState(etcd.url, cluster_id=cluster, ack_timeout_s=1.0,
                                          timeout_s=0.5))
    server = MasterServer(core)
    conn = MasterConnection(server.address)

    def stored(key: str) -> bool:
        return key in {o.key for o in read_state(etcd.url, cluster_id=cluster).objects}

    try:
        assert isinstance(conn.call(p.RegisterNode(
            node_id="a", epoch="E", segment="seg", endpoint="127.0.0.1:1", host_id="h",
            capacity_bytes=1 << 26)), p.Ok)

        def put(key: str) -> p.Reply:
            reply = conn.call(p.Put(items=[p.PutItem(key, 100, 1)]))
            assert isinstance(reply, p.PutReply)
            slot = reply.slots[0]
            if isinstance(slot, p.ErrorInfo):
                return p.Fail(error=slot)
            return conn.call(p.Commit(keys=[key], versions=[slot.version], ack=True))

        assert isinstance(put("before"), p.Ok)
        assert stored("before")
        etcd.stop()
        failed = put("during")
        assert isinstance(failed, p.Fail)
        assert failed.error.code == "unavailable"
        assert "not durable" in failed.error.cause
        started = time.monotonic()
        got = conn.call(p.Get(keys=["before"], lease=False))
        assert isinstance(got, p.GetReply)
        assert isinstance(got.slots[0], p.GetSlot)
        assert time.monotonic() - started < 0.5
        refused = put("refused")
        assert isinstance(refused, p.Fail)
        assert "takes no writes" in refused.error.cause
        etcd.start()
        wait_for(lambda: isinstance(put("after"), p.Ok), timeout_s=20, what="puts resume")
        wait_for(lambda: stored("during"), what="the change kept meanwhile written")
    finally:
        conn.close()
        server.close()


def test_fill_with_client_batches_on_etcd_loses_nothing(etcd_url: str) -> None:
    """10,000 objects put in batches of 512 (the client's default batching) with etcd
    state: every object acknowledged is in etcd and survives a restart, the node is never
    suspect, and another client's exists never waits behind the state writes (the old
    master wrote one request per change on its lock: 440 puts/s, both nodes dropped and
    9,216 objects lost at 10^4)."""
    cluster_id = f"fill-{secrets.token_hex(4)}"
    state = MetadataState(etcd_url, cluster_id=cluster_id)
    cluster = Cluster(MasterConfig(node_timeout_s=1.0))
    cluster.server.close()
    cluster.server = MasterServer(MasterCore(MasterConfig(node_timeout_s=1.0), state=state))
    waits: list[float] = []
    stop = threading.Event()
    try:
        cluster.add_node("a", capacity_bytes=64 << 20)
        keys = [f"fill/{i:06d}" for i in range(10_000)]
        value = b"v" * 1024

        def probe() -> None:
            with StoreClient(cluster.address, transport="tcp") as other:
                while not stop.is_set():
                    started = time.monotonic()
                    other.exists("fill/000000")
                    waits.append(time.monotonic() - started)
                    time.sleep(0.005)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        states: set[str] = set()
        started = time.monotonic()
        with StoreClient(cluster.address, transport="tcp") as client:
            for i in range(0, len(keys), 512):
                result = client.batch_put([(k, value) for k in keys[i:i + 512]])
                assert result == [None] * len(result), [r for r in result if r][:3]
                states.update(n.state for n in client.status().nodes)
            took = time.monotonic() - started
            assert client.status().lost == 0
        stop.set()
        prober.join(10)
        print(f"\netcd state: {len(keys) / took:.0f} puts/s, exists max "
              f"{max(waits) * 1000:.0f} ms over {len(waits)} probes, {state.txns} txns")
        assert states == {"alive"}
        assert max(waits) < 1.0
    finally:
        stop.set()
        cluster.close()
    assert len(read_state(etcd_url, cluster_id=cluster_id).objects) == 10_000


NODE = NodeRecord("a", "E", "seg", "127.0.0.1:1", "h", 1 << 30, 0, "off")


def _objects(url: str, cluster: str) -> dict[str, ObjectRecord]:
    return {o.key: o for o in read_state(url, cluster_id=cluster).objects}


def _keys(url: str, prefix: str) -> list[str]:
    with open_metadata(url) as meta:
        return sorted(meta.list(prefix))


def test_snapshot_replaces_the_log_and_one_cut_short_changes_nothing(etcd_url: str) -> None:
    """A snapshot is written in chunks (many pages of them) from slices of the live view
    while changes go on; changes made during it are replayed over it. One abandoned
    halfway (the master killed) leaves the previous state whole; one finished replaces the
    log batches it covers and every earlier snapshot, and loads to the same state."""
    cluster = f"snap-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    state = MetadataState(etcd_url, cluster_id=cluster, max_txn_ops=10,
                          snapshot_chunk_bytes=400, compact_min=100)
    records = _records(600)
    state.put_node(NODE)
    for rec in records:
        state.put_object(rec)
    assert state.ack(timeout_s=30) is None
    assert list(state.replay())  # (a master loads before it writes)
    assert state.snapshot_wanted(600) is False
    expected = _objects(etcd_url, cluster)
    assert len(expected) == 600

    cut = state.start_snapshot([NODE])
    assert cut is not None
    cut.add(records[:300])
    cut.write()  # some chunks in etcd, then the master dies
    cut.abort()
    assert _objects(etcd_url, cluster) == expected
    assert _keys(etcd_url, prefix + "manifest") == []

    snap = state.start_snapshot([NODE])
    assert snap is not None
    for i in range(0, 600, 64):  # slices of the live view, changes between them
        snap.add(records[i:i + 64])
        snap.write()
        if i == 64:
            state.delete_object("k000001")  # in a slice already taken
            state.put_object(ObjectRecord("k000599", 1, 2, 3, [], []))  # in one to come
            state.put_object(ObjectRecord("new", 1, 2, 3, [], []))
            assert state.ack(timeout_s=30) is None
    assert snap.finish()
    expected.pop("k000001")
    expected["new"] = ObjectRecord("new", 1, 2, 3, [], [])
    expected["k000599"] = ObjectRecord("k000599", 1, 2, 3, [], [])
    assert _objects(etcd_url, cluster) == expected
    chunks = _keys(etcd_url, prefix + "snapshots/")
    assert len(chunks) > 2 * 16, len(chunks)  # loaded across several pages
    assert len({key.rsplit("/", 2)[1] for key in chunks}) == 1  # the cut one is gone
    assert len(_keys(etcd_url, prefix + "log/")) == 1  # only the batch written during it
    reader = MetadataState(etcd_url, cluster_id=cluster)
    assert [n.node_id for n in reader.load().nodes] == ["a"]
    reader.close()
    state.close()


def test_a_node_record_behind_its_objects_in_the_log_keeps_them(etcd_url: str) -> None:
    """The write-behind queue keeps the latest change per key, so a node that registered
    again can have its record behind objects placed on it; a restore still finds their
    copies (the log is folded, nodes first)."""
    cluster = f"order-{secrets.token_hex(4)}"
    state = MetadataState(etcd_url, cluster_id=cluster)
    state.put_object(ObjectRecord("k", 100, 5, 1, [ReplicaRecord("a", 0, 100, "E")], []))
    state.put_node(NODE)
    assert state.ack(timeout_s=30) is None
    state.close()
    core = MasterCore(MasterConfig(node_timeout_s=1e6),
                      state=MetadataState(etcd_url, cluster_id=cluster))
    try:
        assert core.exists(["k"]) == [True]
    finally:
        core.close()


def test_a_store_in_the_old_layout_loads_and_moves_to_the_log(etcd_url: str) -> None:
    """A store written one key per record (before the log) loads whole, changes made after
    go to the log, the master's first snapshot replaces the old keys (deleted in slices
    afterwards), and the next master loads the same objects. Old keys left beside a
    snapshot (a master stopped while deleting them) are not loaded, and deleted by the
    next master."""
    cluster = f"old-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    encode = msgspec.msgpack.encode
    with open_metadata(etcd_url) as meta:
        assert isinstance(meta, EtcdMetadata)
        meta.write_batch([(prefix + "nodes/a", encode(NODE))])
        records = _records(300)
        for i in range(0, 300, 100):
            meta.write_batch([(prefix + "objects/" + r.key, encode(r))
                              for r in records[i:i + 100]])
    state = MetadataState(etcd_url, cluster_id=cluster)
    core = MasterCore(MasterConfig(node_timeout_s=1e6), state=state)
    try:
        assert core.exists(["k000000", "k000299"]) == [True, True]
        core.remove(["k000007"])
        assert state.ack(timeout_s=30) is None
        assert _keys(etcd_url, prefix + "objects/")  # still there: no snapshot yet
        assert len(_objects(etcd_url, cluster)) == 299  # old keys + the log
        assert state.snapshot_wanted(299)
        core.tick()  # snapshots the live view

        def deleted() -> bool:
            core.tick()  # starts the deletion, once the snapshot is in
            return not _keys(etcd_url, prefix + "objects/")

        wait_for(deleted, what="old keys deleted")
        assert _keys(etcd_url, prefix + "nodes/") == []
        assert _keys(etcd_url, prefix + "manifest")
        assert not state.snapshot_wanted(299)
    finally:
        core.close()
    loaded = _objects(etcd_url, cluster)
    assert sorted(loaded) == sorted(r.key for r in records if r.key != "k000007")

    with open_metadata(etcd_url) as meta:  # as if the deletion had been cut short
        assert isinstance(meta, EtcdMetadata)
        meta.write_batch([(prefix + "objects/k000007", encode(records[7]))])
        manifest = meta.get(prefix + "manifest")
        assert manifest is not None  # (a key left over is older than the manifest)
        meta.write_batch([(prefix + "manifest", manifest)])
    core = MasterCore(MasterConfig(node_timeout_s=1e6),
                      state=MetadataState(etcd_url, cluster_id=cluster))
    try:
        assert core.exists(["k000007", "k000008"]) == [False, True]

        def left_deleted() -> bool:
            core.tick()
            return not _keys(etcd_url, prefix + "objects/")

        wait_for(left_deleted, what="the old key left deleted")
    finally:
        core.close()


def test_a_deposed_masters_snapshot_is_refused(etcd_url: str) -> None:
    """A snapshot finished after another master took the term changes nothing (every
    chunk and the manifest carry the fence), and the master is told it was deposed."""
    cluster = f"fence-{secrets.token_hex(4)}"
    term_key = f"kvctl/{cluster}/store/term"
    with open_metadata(etcd_url) as meta:
        assert isinstance(meta, EtcdMetadata)
        meta.put(term_key, b"1")
        entry = meta.get_entry(term_key)
        assert entry is not None
        why: list[str] = []
        state = MetadataState(etcd_url, cluster_id=cluster, fence=(term_key, entry[1]),
                              on_fenced=why.append)
        state.put_node(NODE)
        state.put_object(_records(1)[0])
        assert state.ack(timeout_s=30) is None
        list(state.replay())
        snap = state.start_snapshot([NODE])
        assert snap is not None
        snap.add(_records(1))
        meta.put(term_key, b"2")  # another master's term
        assert not snap.finish()
    assert why
    assert "another master leads now" in why[0]
    assert _keys(etcd_url, f"kvctl/{cluster}/store/manifest") == []
    assert list(_objects(etcd_url, cluster)) == ["k000000"]
    state.close()


def test_an_unreadable_chunk_stops_the_load(etcd_url: str) -> None:
    """A master never starts on part of its state: a log batch that does not decode is a
    StoreUnavailableError naming its key, not objects silently left out."""
    cluster = f"bad-{secrets.token_hex(4)}"
    state = MetadataState(etcd_url, cluster_id=cluster)
    state.put_object(_records(1)[0])
    assert state.ack(timeout_s=30) is None
    state.close()
    with open_metadata(etcd_url) as meta:
        (key,) = meta.list(f"kvctl/{cluster}/store/log/")
        meta.put(key, b"\xc1 not msgpack")
    with pytest.raises(StoreUnavailableError, match="unreadable"):
        read_state(etcd_url, cluster_id=cluster)


def test_a_snapshot_etcd_fails_leaves_the_state_whole(
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """etcd stops while a snapshot is being written: the snapshot fails (no manifest, the
    log stays), it is not tried again at once (every tick would), and once etcd is back
    the state loads whole and the next snapshot replaces the log."""
    etcd = spawn_etcd()
    cluster = f"snapfail-{secrets.token_hex(4)}"
    state = MetadataState(etcd.url, cluster_id=cluster, timeout_s=0.5, compact_min=10)
    records = _records(200)
    state.put_node(NODE)
    for rec in records:
        state.put_object(rec)
    assert state.ack(timeout_s=30) is None
    list(state.replay())
    snap = state.start_snapshot([NODE])
    assert snap is not None
    snap.add(records)
    etcd.stop()
    assert not snap.finish()
    assert not state.snapshot_wanted(0)  # tried again later, not on every tick
    etcd.start()
    assert len(_objects(etcd.url, cluster)) == 200
    assert _keys(etcd.url, f"kvctl/{cluster}/store/manifest") == []
    again = state.start_snapshot([NODE])
    assert again is not None
    again.add(records)
    assert again.finish()
    assert _keys(etcd.url, f"kvctl/{cluster}/store/log/") == []
    assert len(_objects(etcd.url, cluster)) == 200
    state.close()
