"""Hostile tests of etcd state as a log of batches over fuzzy snapshots
(kvctl/store/state/etcdlog.py, kvctl/store/state/writebehind.py): an acknowledged change
is durable or was never acknowledged, whatever the process is killed in, and etcd's own
limits do not wedge a master."""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from kvctl.metadata import open_metadata
from kvctl.metadata.etcd import EtcdMetadata
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.state import MetadataState, NodeRecord, ObjectRecord, ReplicaRecord
from kvctl.store.state.base import JournalEntry
from kvctl.store.state.writebehind import read_state
from tests.fixtures.servers import ServerProcess, make_etcd

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUNS = 10
NODE = NodeRecord("a", "E", "seg", "127.0.0.1:1", "h", 1 << 30, 0, "")

#: A process changing keys (puts, overwrites, removes) and snapshotting between them, a
#: slice at a time from its own live view, as a master does; each acknowledged change is
#: appended to a file once acked (``+`` before it is asked for, ``=`` once acknowledged).
_WRITER = r"""
import os, random, sys
from kvctl.store.state import MetadataState, ObjectRecord, ReplicaRecord
url, cluster, out, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rnd = random.Random(seed)
state = MetadataState(url, cluster_id=cluster, max_txn_ops=7, snapshot_chunk_bytes=300,
                      compact_min=10)
live = {}
for e in state.replay():
    if type(e).__name__ == "ObjectRecord":
        live[e.key] = e
    elif type(e).__name__ == "DeleteObject":
        live.pop(e.key, None)
log = open(out, "a", buffering=1)
version = max((r.version for r in live.values()), default=0)
snap, after = None, None

def change():
    global version
    key = f"k{rnd.randrange(60):03d}"
    version += 1
    if key in live and rnd.random() < 0.3:
        log.write(f"+ {key} 0\n")
        del live[key]
        state.delete_object(key)
    else:
        rec = ObjectRecord(key, 100, version, version, [ReplicaRecord("a", 0, 100)], [])
        log.write(f"+ {key} {version}\n")
        live[key] = rec
        state.put_object(rec)
    assert state.ack(timeout_s=30) is None
    log.write(f"= {key}\n")

while True:
    for _ in range(rnd.randrange(1, 6)):
        change()
    if snap is None:
        snap, after = state.start_snapshot([]), ""
        continue
    keys = sorted(k for k in live if k > after)[:rnd.randrange(1, 12)]
    snap.add([live[k] for k in keys])
    snap.write()
    if keys:
        after = keys[-1]
    else:
        assert snap.finish()
        snap = None
"""


#: The same through a real master core (its placement, commits, removes, and its own
#: snapshot job slicing the live index under the lock between the changes).
_MASTER = r"""
import random, sys
from kvctl.store import protocol as p
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.state import MetadataState
url, cluster, out, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
slices, chunks = (int(a) for a in (sys.argv[5:] or ["4", "300"]))
rnd = random.Random(seed)
state = MetadataState(url, cluster_id=cluster, max_txn_ops=7, snapshot_chunk_bytes=chunks,
                      compact_min=10)
core = MasterCore(MasterConfig(node_timeout_s=1e6, slice_objects=slices), state=state)
assert core.register_node(p.RegisterNode(
    node_id="a", epoch="e1", segment="seg-a", endpoint="127.0.0.1:1", host_id="h",
    capacity_bytes=1 << 30, ssd_capacity_bytes=0, ssd_policy="off")) is None
log = open(out, "a", buffering=1)
while True:
    key = f"k{rnd.randrange(60):03d}"
    if rnd.random() < 0.3:
        log.write(f"+ {key} 0\n")
        core.remove([key])
        version = 0
    else:
        log.write(f"+ {key} -1\n")
        slot = core.put(p.Put(items=[p.PutItem(key, 100, 7)], replicas=1))[0]
        assert isinstance(slot, p.PutSlot), slot
        if not slot.skip:
            core.commit(p.Commit(keys=[key], versions=[slot.version]))
        version = slot.version
    assert state.ack(timeout_s=30) is None
    log.write(f"= {key} {version}\n")
    core.tick(budget_s=0)
"""


def _expected(log: Path) -> tuple[dict[str, int], dict[str, set[int]]]:
    """Per key: its last acknowledged version (0: removed), and the versions it may have
    (the acknowledged one, or the one asked for when the process was killed)."""
    acked: dict[str, int] = {}
    asked: dict[str, int] = {}
    for line in log.read_text().splitlines():
        parts = line.split()
        if parts[0] == "+" and len(parts) == 3:
            asked[parts[1]] = int(parts[2])
        elif parts[0] == "=" and parts[1] in asked:  # "= KEY [VERSION]"
            acked[parts[1]] = int(parts[2]) if len(parts) == 3 else asked[parts[1]]
            del asked[parts[1]]
    maybe = {key: {acked.get(key, 0), version} for key, version in asked.items()}
    return acked, maybe


def _check(loaded: dict[str, int], acked: dict[str, int], maybe: dict[str, set[int]],
           run: int) -> None:
    """``loaded`` holds exactly ``acked``, but for a key in ``maybe`` (-1 there: a put
    whose version was not learnt, any version above the acknowledged one)."""
    for key in sorted(set(acked) | set(maybe) | set(loaded)):
        got = loaded.get(key, 0)
        if key in maybe:
            ok = got in maybe[key] or (-1 in maybe[key] and got > acked.get(key, 0))
            assert ok, (run, key, got, maybe[key])
        else:
            assert got == acked.get(key, 0), (run, key, got, acked.get(key, 0))


def _kill_again_and_again(script: str, etcd_url: str, cluster: str, log: Path, *,
                          runs: int = RUNS, args: tuple[str, ...] = (),
                          compacted: bool = True) -> list[str]:
    """Run ``script`` (see :data:`_WRITER`), SIGKILL it at a random moment once it has
    acknowledged 40 more changes, check what it left, start it again, ``runs`` times;
    then check that a snapshot was taken (with ``compacted``: that snapshots replaced most
    of the log). The keys left under the store's prefix."""
    rnd = random.Random(7)
    loaded: dict[str, int] = {}
    base = log.read_text().count("=") if log.exists() else 0
    for run in range(runs):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, etcd_url, cluster, str(log), str(run), *args],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                not log.exists() or log.read_text().count("=") < base + 40 * (run + 1)):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.05)
        time.sleep(rnd.random() * 0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()
        acked, maybe = _expected(log)
        loaded = {o.key: o.version for o in read_state(etcd_url, cluster_id=cluster).objects}
        _check(loaded, acked, maybe, run)
        with log.open("a") as f:  # the change in flight settled as loaded
            for key in maybe:
                f.write(f"+ {key} {loaded.get(key, 0)}\n= {key}\n")
    assert loaded  # (the writer did write, and snapshots replaced most of its log)
    with open_metadata(etcd_url) as meta:
        keys = list(meta.list(f"kvctl/{cluster}/store/"))
    assert f"kvctl/{cluster}/store/manifest" in keys
    if compacted:
        assert sum("/log/" in k for k in keys) < (log.read_text().count("=") - base) / 4
    return keys


def test_sigkill_at_any_point_of_log_and_snapshots_keeps_every_acknowledged_change(
        etcd_url: str, tmp_path: Path) -> None:
    """A writer process changing keys and snapshotting (fuzzy: changes between the slices,
    to keys in slices written and still to come) is SIGKILLed at random moments, restarted
    on what it left, ten times over: each load holds exactly the acknowledged changes (no
    lost put or remove, no resurrected key, no older version), but for the one change in
    flight when it was killed."""
    _kill_again_and_again(_WRITER, etcd_url, f"kill-{secrets.token_hex(4)}",
                          tmp_path / "acked.log")


def test_sigkill_of_a_master_core_snapshotting_keeps_every_acknowledged_change(
        etcd_url: str, tmp_path: Path) -> None:
    """The same with a real master core: puts (placed and committed), overwrites and
    removes, each acknowledged by the state, its own snapshot job slicing the live index
    four objects at a time between them, restored from what the last run left."""
    _kill_again_and_again(_MASTER, etcd_url, f"killm-{secrets.token_hex(4)}",
                          tmp_path / "acked.log")


def test_sigkill_while_a_store_moves_from_the_old_layout_keeps_every_acknowledged_change(
        etcd_url: str, tmp_path: Path) -> None:
    """A store of 25,000 records one key per record (the layout before the log): a master
    core loads it, changes it, snapshots it and deletes the old keys 10,000 per
    transaction, and is SIGKILLed at random moments in all of that (mid-snapshot, after the
    manifest, mid-deletion), four times: each load holds exactly what was acknowledged
    (the old keys left beside a snapshot are neither loaded nor taken for a downgrade)."""
    cluster = f"killold-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    log = tmp_path / "acked.log"
    encode = msgspec.msgpack.encode
    records = [ObjectRecord(f"o{i:05d}", 100, 7, 1, [ReplicaRecord("a", i * 128, 100, "e1")],
                            []) for i in range(25_000)]
    with open_metadata(etcd_url) as meta:
        assert isinstance(meta, EtcdMetadata)
        meta.write_batch([(prefix + "nodes/a", encode(NodeRecord(
            "a", "e1", "seg-a", "127.0.0.1:1", "h", 1 << 30, 0, "off")))])
        for i in range(0, len(records), 128):
            meta.write_batch([(prefix + "objects/" + r.key, encode(r))
                              for r in records[i:i + 128]])
    log.write_text("".join(f"+ {r.key} 1\n= {r.key} 1\n" for r in records))
    _kill_again_and_again(_MASTER, etcd_url, cluster, log, runs=4,
                          args=("1500", str(16 << 10)), compacted=False)
    core = MasterCore(MasterConfig(node_timeout_s=1e6),
                      state=MetadataState(etcd_url, cluster_id=cluster))
    try:  # the deletion finished by a master left alone
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            core.tick()
            with open_metadata(etcd_url) as meta:
                if not meta.list_page(prefix + "objects/", limit=1).entries:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the old layout's keys were not deleted")
    finally:
        core.close()
    acked, maybe = _expected(log)
    assert not maybe
    _check({o.key: o.version for o in read_state(etcd_url, cluster_id=cluster).objects},
           acked, maybe, -1)


def _incompressible(n: int, seed: int) -> list[ObjectRecord]:
    """Records whose keys (about 4 KiB of CJK text each) zlib cannot shrink."""
    rnd = random.Random(seed)
    return [ObjectRecord("".join(chr(rnd.randrange(0x4E00, 0x9FFF)) for _ in range(1360)),
                         100, i, i + 1, [ReplicaRecord("a", i * 128, 100)], [])
            for i in range(n)]


def test_etcd_taking_smaller_requests_shrinks_batches_and_chunks_instead_of_wedging(
        tmp_path: Path) -> None:
    """etcd started with --max-request-bytes 512 KiB refuses a 1 MiB batch of records
    that do not compress: the master used to retry that same batch for good (no put
    taken ever again, every acknowledgement failing), and its snapshots likewise. Now the
    batches and chunks shrink, everything is acknowledged and loads whole."""
    etcd: ServerProcess = make_etcd(tmp_path)
    etcd.argv += ["--max-request-bytes", str(512 << 10)]
    etcd.start()
    try:
        cluster = f"small-{secrets.token_hex(4)}"
        state = MetadataState(etcd.url, cluster_id=cluster, compact_min=10)
        list(state.replay())
        records = _incompressible(400, 1)
        for rec in records:
            state.put_object(rec)
        assert state.ack(timeout_s=20) is None
        assert state.refusal() is None
        for _attempt in range(3):  # the first may be refused (chunks shrink), then taken
            snap = state.start_snapshot([])
            assert snap is not None
            snap.add(records)
            if snap.finish():
                break
            assert state.snapshot_wanted(len(records)), "retried at once, chunks smaller"
        else:
            pytest.fail("no snapshot was taken")
        state.close()
        loaded = read_state(etcd.url, cluster_id=cluster).objects
        assert sorted(o.key for o in loaded) == sorted(r.key for r in records)
    finally:
        etcd.stop()


def _compact(url: str) -> None:
    """A write, then etcd compacted to the newest revision (what the load reads at is
    gone)."""
    with open_metadata(url) as meta:
        assert isinstance(meta, EtcdMetadata)
        meta.put("hostile/compact", b"x")
        revision = meta.list_page("hostile/compact", limit=1).revision
        meta._call("kv/compaction", {"revision": str(revision), "physical": True})


def test_etcd_compacted_during_a_masters_load_is_loaded_again_whole(
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """etcd compacts the revision a master is loading its snapshot at (between pages):
    the load used to fail with etcd's bare message and a hint to check etcd's version;
    now it is loaded again from the start, whole. A state compacted under every load
    says what happened and what to do."""
    etcd_url = spawn_etcd().url  # its own: compacting the shared one disturbs others
    cluster = f"compact-{secrets.token_hex(4)}"
    state = MetadataState(etcd_url, cluster_id=cluster, snapshot_chunk_bytes=300)
    list(state.replay())
    records = [ObjectRecord(f"k{i:04d}", 100, i, i + 1, [ReplicaRecord("a", i * 128, 100)],
                            []) for i in range(1000)]
    state.put_node(NODE)
    for rec in records:
        state.put_object(rec)
    assert state.ack(timeout_s=20) is None
    snap = state.start_snapshot([NODE])
    assert snap is not None
    snap.add(records)
    assert snap.finish()
    state.close()

    class Compacted(MetadataState):
        """Real etcd compacted after the first record of the first ``times`` loads."""

        times = 1

        def replay(self) -> Iterator[JournalEntry]:
            entries = super().replay()
            yield next(entries)
            if self.times > 0:
                self.times -= 1
                _compact(etcd_url)
            yield from entries

    core = MasterCore(MasterConfig(node_timeout_s=1e6),
                      state=Compacted(etcd_url, cluster_id=cluster))
    try:
        assert core.exists([r.key for r in records]) == [True] * len(records)
    finally:
        core.close()
    always = Compacted(etcd_url, cluster_id=cluster)
    always.times = 10
    with pytest.raises(StoreUnavailableError, match="compacted the revision") as caught:
        always.load()
    assert "auto-compaction" in (caught.value.hint or "")
    always.close()


def test_an_unreadable_record_of_the_old_layout_stops_the_load(etcd_url: str) -> None:
    """A store in the one-key-per-record layout with one record that does not decode:
    it used to be skipped with a warning, then the first snapshot made the state without
    it and the old keys were deleted, so it was lost for good. Now the load stops with
    the key named, as for a log batch, and nothing is deleted."""
    cluster = f"oldbad-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    records = [ObjectRecord(f"k{i}", 100, i, i + 1, [], []) for i in range(3)]
    with open_metadata(etcd_url) as meta:
        assert isinstance(meta, EtcdMetadata)
        meta.write_batch([(prefix + "objects/" + r.key, msgspec.msgpack.encode(r)
                           if r.key != "k1" else b"\xc1 garbage") for r in records])
    with pytest.raises(StoreUnavailableError, match="objects/k1 is unreadable"):
        MasterCore(MasterConfig(node_timeout_s=1e6),
                   state=MetadataState(etcd_url, cluster_id=cluster)).close()
    with open_metadata(etcd_url) as meta:
        assert sorted(meta.list(prefix)) == [prefix + "objects/" + r.key for r in records]


def test_records_an_older_kvctl_wrote_after_the_move_to_the_log_stop_the_load(
        etcd_url: str) -> None:
    """A downgrade (unsupported): a kvctl older than the log layout sees none of the log,
    starts empty and writes one key per record again. Upgraded back, a master used to load
    the older snapshot and log (the downgraded run's puts lost, its removes undone) and
    then delete those keys as leftovers of the move. Now it refuses to start, saying so;
    keys left over from the move itself (older than the manifest) still load as before.
    So does one downgraded before the first snapshot."""
    cluster = f"downgrade-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    state = MetadataState(etcd_url, cluster_id=cluster)
    list(state.replay())
    state.put_object(ObjectRecord("before", 1, 1, 1, [], []))
    assert state.ack(timeout_s=20) is None
    snap = state.start_snapshot([])
    assert snap is not None
    snap.add([ObjectRecord("before", 1, 1, 1, [], [])])
    assert snap.finish()
    state.close()
    assert len(read_state(etcd_url, cluster_id=cluster).objects) == 1
    with open_metadata(etcd_url) as meta:  # what an older kvctl writes
        meta.put(prefix + "objects/during", msgspec.msgpack.encode(
            ObjectRecord("during", 1, 1, 2, [], [])))
    with pytest.raises(StoreUnavailableError, match="older than the log layout") as caught:
        read_state(etcd_url, cluster_id=cluster)
    assert "not supported" in (caught.value.hint or "")
    with open_metadata(etcd_url) as meta:
        assert meta.get(prefix + "objects/during") is not None  # nothing deleted

    # Before the first snapshot (a log, no manifest): the log's older changes would be
    # replayed over what the older kvctl wrote since.
    cluster = f"downgrade-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    state = MetadataState(etcd_url, cluster_id=cluster)
    list(state.replay())
    state.put_object(ObjectRecord("k", 1, 1, 1, [], []))
    assert state.ack(timeout_s=20) is None
    state.close()
    with open_metadata(etcd_url) as meta:
        meta.put(prefix + "objects/k", msgspec.msgpack.encode(
            ObjectRecord("k", 1, 1, 2, [], [])))
    with pytest.raises(StoreUnavailableError, match="older than the log layout"):
        read_state(etcd_url, cluster_id=cluster)


def test_an_elected_master_is_fenced_before_it_loads(etcd_url: str) -> None:
    """The fence of an elected master goes on its state before the load (it used to go on
    after the server had started its tick and accept threads, so a write made in between,
    the first tick's snapshot of a store in the old layout, say, went out unfenced). A
    master whose term was taken while it loaded writes nothing: its first write is refused
    and it learns it was deposed."""
    from kvctl.store.embedded import start_master
    from kvctl.store.settings import StoreSettings
    from kvctl.store.state.base import StateBackend

    cluster = f"prefence-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    term_key = prefix + "hostile-term"
    with open_metadata(etcd_url) as meta:
        assert isinstance(meta, EtcdMetadata)
        meta.write_batch([(prefix + "objects/k", msgspec.msgpack.encode(
            ObjectRecord("k", 1, 1, 1, [ReplicaRecord("a", 0, 1)], [])))])
        meta.put(term_key, b"ours")
        entry = meta.get_entry(term_key)
        assert entry is not None
        meta.put(term_key, b"the next leader's")  # taken while this one loaded
    why: list[str] = []

    def fence(state: StateBackend) -> None:
        assert isinstance(state, MetadataState)
        state.fence_writes((term_key, entry[1]), why.append)

    server = start_master(StoreSettings(listen="127.0.0.1:0", state=etcd_url),
                          token=None, cluster_id=cluster, fence=fence)
    try:
        deadline = time.monotonic() + 10
        while not why and time.monotonic() < deadline:
            server.core.tick()  # the old layout: a snapshot at once
            time.sleep(0.05)
        assert why
        assert "another master leads now" in why[0]
    finally:
        server.close()
    with open_metadata(etcd_url) as meta:
        assert sorted(meta.list(prefix)) == [term_key, prefix + "objects/k"]


class _Held(MetadataState):
    """Real etcd state whose batches holding one of the keys in ``held`` wait at ``gate``
    before they are written (slow requests: the log number is taken, the write lands
    later); ``holding`` counts them."""

    held: set[str] = set()
    gate = threading.Event()
    holding: list[str] = []

    def _write(self, changes: list[tuple[str, bytes | None]], seq: int) -> bool:
        names = {k.rsplit("/", 1)[-1] for k, _ in changes} & self.held
        if names:
            self.held = self.held - names
            self.holding.extend(names)
            assert self.gate.wait(20)
        return super()._write(changes, seq)


def test_a_batch_numbered_before_a_snapshot_and_written_after_its_manifest(
        etcd_url: str) -> None:
    """Two batches take their log numbers, then the master starts a snapshot (a later
    number), and the batches land only after it has switched the manifest: below its
    number they are not replayed, and their changes are in the snapshot (it read the live
    view after they were made), or after it in the log: one of the two keys is removed
    once the snapshot has begun, while its put is held. Both load as acknowledged."""
    cluster = f"late-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    state = _Held(etcd_url, cluster_id=cluster, inflight=2)
    state.gate, state.holding = threading.Event(), []
    list(state.replay())
    live = {f"k{i}": ObjectRecord(f"k{i}", 1, i, i, [], []) for i in range(20)}
    for rec in live.values():
        state.put_object(rec)
    assert state.ack(timeout_s=20) is None
    acks: list[str | None] = []

    def put(rec: ObjectRecord) -> None:
        state.put_object(rec)
        acks.append(state.ack(timeout_s=20))

    state.held = {"kept", "gone"}
    for key in ("kept", "gone"):  # one batch each, both writers held
        live[key] = ObjectRecord(key, 1, 1, 7, [], [])
        threading.Thread(target=put, args=(live[key],)).start()
        deadline = time.monotonic() + 10
        while key not in state.holding and time.monotonic() < deadline:
            time.sleep(0.01)
        assert key in state.holding
    snap = state.start_snapshot([])
    assert snap is not None
    del live["gone"]
    state.delete_object("gone")  # after the snapshot began; its put still held
    remove_ack = threading.Thread(target=lambda: acks.append(state.ack(timeout_s=20)))
    remove_ack.start()
    snap.add(sorted(live.values(), key=lambda r: r.key))
    assert snap.finish()
    with open_metadata(etcd_url) as meta:
        assert list(meta.list(prefix + "log/")) == []  # the manifest deleted the log
    state.gate.set()
    remove_ack.join(timeout=20)
    deadline = time.monotonic() + 20
    while len(acks) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert acks == [None, None, None]
    state.close()
    with open_metadata(etcd_url) as meta:
        assert len(meta.list(prefix + "log/")) == 3  # two below the snapshot, one above
    loaded = {o.key: o for o in read_state(etcd_url, cluster_id=cluster).objects}
    assert loaded == live


def test_a_snapshot_chunk_replaced_by_fewer_records_stops_the_load(etcd_url: str) -> None:
    """A chunk of the snapshot the manifest names overwritten with a well-formed chunk of
    other records (none here): the chunk count is right, so the load used to go on with
    those records missing; the manifest's record count now catches it."""
    from kvctl.store.state.etcdlog import pack

    cluster = f"chunk-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    state = MetadataState(etcd_url, cluster_id=cluster, snapshot_chunk_bytes=200)
    list(state.replay())
    records = [ObjectRecord(f"k{i:03d}", 1, i, i, [], []) for i in range(40)]
    snap = state.start_snapshot([])
    assert snap is not None
    snap.add(records)
    assert snap.finish()
    state.close()
    assert len(read_state(etcd_url, cluster_id=cluster).objects) == 40
    with open_metadata(etcd_url) as meta:
        chunks = sorted(meta.list(prefix + "snapshots/"))
        assert len(chunks) > 2
        meta.put(chunks[1], pack([]))
    with pytest.raises(StoreUnavailableError, match="records") as caught:
        read_state(etcd_url, cluster_id=cluster)
    assert "backup" in (caught.value.hint or "")


def test_a_deleted_manifest_stops_the_load(etcd_url: str) -> None:
    """The manifest deleted (by hand, a stray ``etcdctl del``): the load used to see no
    snapshot and replay the log written after it alone, the snapshot's objects silently
    gone. Now it stops and says what is missing; a first snapshot cut short (its chunks,
    no manifest, the log it was taken from) still loads."""
    cluster = f"nomanifest-{secrets.token_hex(4)}"
    prefix = f"kvctl/{cluster}/store/"
    state = MetadataState(etcd_url, cluster_id=cluster, snapshot_chunk_bytes=200)
    list(state.replay())
    records = [ObjectRecord(f"k{i:03d}", 1, i, i, [], []) for i in range(30)]
    for rec in records:
        state.put_object(rec)
    assert state.ack(timeout_s=20) is None
    cut = state.start_snapshot([])
    assert cut is not None
    cut.add(records)
    cut.write()
    cut.abort()
    assert len(read_state(etcd_url, cluster_id=cluster).objects) == 30
    snap = state.start_snapshot([])
    assert snap is not None
    snap.add(records)
    assert snap.finish()
    state.put_object(ObjectRecord("after", 1, 1, 1, [], []))
    assert state.ack(timeout_s=20) is None
    state.close()
    assert len(read_state(etcd_url, cluster_id=cluster).objects) == 31
    with open_metadata(etcd_url) as meta:
        assert meta.delete(prefix + "manifest")
    with pytest.raises(StoreUnavailableError, match="manifest was deleted") as caught:
        read_state(etcd_url, cluster_id=cluster)
    assert "backup" in (caught.value.hint or "")


def test_etcd_over_its_quota_is_an_error_that_says_how_to_recover(tmp_path: Path) -> None:
    """etcd past --quota-backend-bytes refuses every write with 'database space exceeded';
    the error used to end with a hint to check etcd's version. Now it says what to run."""
    from kvctl.metadata import MetadataError

    etcd: ServerProcess = make_etcd(tmp_path)
    etcd.argv += ["--quota-backend-bytes", str(1 << 20)]
    etcd.start()
    try:
        with open_metadata(etcd.url) as meta:
            value = os.urandom(64 << 10)
            refused: MetadataError | None = None
            for i in range(200):  # 12.5 MiB at most: far past a 1 MiB quota
                try:
                    meta.put(f"fill/{i}", value)
                except MetadataError as exc:
                    refused = exc
                    break
            assert refused is not None, "etcd took 12.5 MiB under a 1 MiB quota"
            assert "database space exceeded" in refused.cause
            assert refused.hint is not None
            assert "etcdctl alarm disarm" in refused.hint
            assert "etcdctl defrag" in refused.hint
    finally:
        etcd.stop()
