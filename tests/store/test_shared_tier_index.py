"""The shared tier's index against crashes and drops: a file leaves the tier only after
the state change that stops naming it is durable; a dropped node leaves nothing in the
write-through queues; a master restart restores the LRU order from the records' use
stamps."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.store.sharedtier import housekeeping, mixin, writer
from kvctl.store.sharedtier.config import SharedTierConfig
from kvctl.store.sharedtier.fileformat import file_name
from kvctl.store.sharedtier.housekeeping import SharedState
from kvctl.store.state import JournalEntry, MetadataState, NodeRecord, NoState, ObjectRecord
from tests.fixtures.servers import ServerProcess
from tests.store.conftest import wait_for
from tests.store.test_shared_tier import MiB, SharedCluster

KiB = 1 << 10


class RecordingState(NoState):
    """Takes changes at once; makes them durable (in :attr:`durable`) only at an ack while
    :attr:`open` is set, logging each into :attr:`log` as it becomes durable."""

    def __init__(self, log: list[tuple[str, str, int]], durable: dict[str, ObjectRecord]
                 | None = None, nodes: dict[str, NodeRecord] | None = None) -> None:
        self.log = log
        self.open = threading.Event()
        self.open.set()
        self.durable = dict(durable or {})
        self.nodes = dict(nodes or {})
        self._taken: list[tuple[str, ObjectRecord | None]] = []
        self._lock = threading.Lock()

    def replay(self) -> Iterator[JournalEntry]:
        yield from self.nodes.values()
        yield from self.durable.values()

    def put_object(self, record: ObjectRecord) -> None:
        with self._lock:
            self._taken.append((record.key, record))

    def delete_object(self, key: str) -> None:
        with self._lock:
            self._taken.append((key, None))

    def put_node(self, record: NodeRecord) -> None:
        self.nodes[record.node_id] = record

    def delete_node(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    def ack(self, timeout_s: float | None = None) -> str | None:
        if not self.open.is_set():
            return "stalled"
        with self._lock:
            for key, record in self._taken:
                if record is None:
                    self.durable.pop(key, None)
                else:
                    self.durable[key] = record
                self.log.append(("durable", key, record.shared if record else -1))
            self._taken.clear()
        return None


def _master(state: RecordingState, tier: SharedTierConfig, port: int = 0) -> MasterServer:
    return MasterServer(MasterCore(MasterConfig(node_timeout_s=2.0), state, shared_tier=tier),
                        port=port)


def test_an_evicted_file_is_deleted_only_after_the_index_change_is_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "dfs"
    tier = SharedTierConfig(root, policy="write-through", max_files=1)
    log: list[tuple[str, str, int]] = []
    real_unlink = housekeeping._unlink_all

    def unlink_all(paths: list[str]) -> tuple[int, list[tuple[str, str]]]:
        log.extend(("unlink", path, 0) for path in paths)
        return real_unlink(paths)

    monkeypatch.setattr(housekeeping, "_unlink_all", unlink_all)
    gate = _gate_writes(monkeypatch)
    state = RecordingState(log)
    server = _master(state, tier)
    node = StorageNode(server.address, capacity_bytes=8 * MiB, heartbeat_s=0.05)
    try:
        with StoreClient(server.address) as client:
            first = os.urandom(64 * KiB)
            client.put("a", first)
            wait_for(lambda: client.stat("a").tier == "dram+shared", what="a's copy")
            a_file = root / file_name("a", client.stat("a").version)
            gate.clear()  # b's copy waits on the node ...
            client.put("b", os.urandom(64 * KiB))
            state.open.clear()  # ... the state stalls (etcd, a slow disk) ...
            gate.set()  # ... and b's copy lands: the quota (1 file) evicts a's
            wait_for(lambda: "shared" not in client.stat("a").tier, what="a's eviction")
            for _ in range(20):
                server.core.tick()
            assert a_file.exists(), "deleted while the index change was not durable"
            # a master killed now restarts on what is durable: it names a's file
            assert state.durable["a"].shared
            crashed = RecordingState([], state.durable, state.nodes)
        node.close()
        server.close()
        server = _master(crashed, tier)
        with StoreClient(server.address) as client:
            assert client.get("a") == first  # from the file the durable index names
        server.close()

        # the same eviction with a state that takes it: the delete follows the record
        server = _master(RecordingState(log, crashed.durable, crashed.nodes),
                         dataclasses.replace(tier, max_files=10))
        node = StorageNode(server.address, capacity_bytes=8 * MiB, heartbeat_s=0.05)
        log.clear()
        with StoreClient(server.address) as client:
            client.put("c", os.urandom(64 * KiB))
            wait_for(lambda: client.stat("c").tier == "dram+shared", what="c's copy")
            c_file = str(root / file_name("c", client.stat("c").version))
            assert client.remove("c")
            wait_for(lambda: ("unlink", c_file, 0) in log, what="c's delete")
        dropped = log.index(("durable", "c", -1))
        assert dropped < log.index(("unlink", c_file, 0))
    finally:
        node.close()
        server.close()


def _gate_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Shared-tier writes on the nodes wait while the returned event is clear."""
    gate = threading.Event()
    gate.set()
    real_write = writer.write_object

    def gated(*args: object, **kwargs: object) -> None:
        assert gate.wait(30)
        real_write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "write_object", gated)
    return gate


def test_a_stalled_etcd_holds_the_delete_until_it_has_the_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """The same order against a real etcd, SIGSTOPped while the quota evicts a copy: the
    file stays while etcd names it, and goes once etcd took the record without it."""
    etcd = spawn_etcd()
    cluster = f"tier-{secrets.token_hex(4)}"
    root = tmp_path / "dfs"
    tier = SharedTierConfig(root, policy="write-through", max_files=1)
    gate = _gate_writes(monkeypatch)
    core = MasterCore(MasterConfig(node_timeout_s=5.0),
                      MetadataState(etcd.url, cluster_id=cluster, timeout_s=0.5),
                      shared_tier=tier)
    server = MasterServer(core)
    node = StorageNode(server.address, capacity_bytes=8 * MiB, heartbeat_s=0.05)
    proc = etcd._proc
    assert proc is not None
    try:
        with StoreClient(server.address) as client:
            client.put("a", os.urandom(64 * KiB))
            wait_for(lambda: client.stat("a").tier == "dram+shared", what="a's copy")
            a_file = root / file_name("a", client.stat("a").version)
            gate.clear()
            client.put("b", os.urandom(64 * KiB))
            proc.send_signal(signal.SIGSTOP)
            try:
                gate.set()
                wait_for(lambda: "shared" not in client.stat("a").tier, what="eviction")
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline:
                    core.tick()
                    assert a_file.exists(), "deleted while etcd still named it"
            finally:
                proc.send_signal(signal.SIGCONT)
            wait_for(lambda: not a_file.exists(), what="the delete after etcd took it")
        loaded = MetadataState(etcd.url, cluster_id=cluster).load()
        assert {r.key: r.shared for r in loaded.objects}["a"] == 0
    finally:
        node.close()
        server.close()


def test_a_dropped_node_leaves_no_write_through_entries(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _gate_writes(monkeypatch)
    gate.clear()
    c = SharedCluster(tmp_path / "dfs", policy="write-through")
    try:
        node = c.node(64 * MiB)
        core = c.server.core
        st = core._shared
        assert isinstance(st, SharedState)
        with StoreClient(c.address) as client:
            client.batch_put([(f"k{i}", os.urandom(16 * KiB)) for i in range(5)])
            master_node = core._nodes[node.node_id]
            wait_for(lambda: st.queued.get(master_node, (0, 0))[0] == 5, what="5 queued")
            assert len(st.writing) == 5
            client.drop_node(node.node_id)  # with its 5 copies in flight
            with core._lock:
                assert master_node not in st.queued
                assert not [k for k, (_, n, _) in st.writing.items() if n is master_node]
        gate.set()
    finally:
        gate.set()
        c.close()


def test_a_master_restart_keeps_the_tiers_lru_order(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mixin, "RESTAMP_MIN_AGE", 1)
    c = SharedCluster(tmp_path / "dfs", state=str(tmp_path / "state"), policy="write-through")
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            for name in "abcd":
                client.put(name, os.urandom(16 * KiB))
                wait_for(lambda n=name: "shared" in client.stat(n).tier, what="copy")
            client.get("a")  # a is the most recently used now; its record says so
            core = c.server.core
            stamp = core._index.get("a").shared  # type: ignore[union-attr]
            for _ in range(20):  # the newest copy: gets write no more records
                client.get("a")
            assert core._index.get("a").shared == stamp  # type: ignore[union-attr]
        for n in c.nodes:
            n.close()
        c.nodes.clear()
        c.tier = dataclasses.replace(c.tier, max_files=3)
        c.restart_master()  # its quota now evicts the least recently used: b, not a
        with StoreClient(c.address) as client:
            assert "shared" in client.stat("a").tier
            assert "shared" not in client.stat("b").tier
            assert all("shared" in client.stat(n).tier for n in "cd")
    finally:
        c.close()


def test_use_stamps_are_written_at_a_bounded_rate() -> None:
    st = SharedState(SharedTierConfig(Path("/unused")))
    assert sum(st.may_restamp(100.0, 64.0) for _ in range(200)) == 64
    assert not st.may_restamp(100.0, 64.0)
    assert sum(st.may_restamp(100.5, 64.0) for _ in range(200)) == 32


def test_a_new_copy_is_never_deleted_by_the_delete_of_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy leaves the index (found bad; or the quota) while the object stays in DRAM;
    before its file's delete runs (it waits for the state), DRAM evicts the object and its
    write-back writes the same name again: that delete must not remove the new file (the
    index would name a file that is gone)."""
    hold = threading.Event()
    real_durable = housekeeping._durable
    monkeypatch.setattr(housekeeping, "_durable",
                        lambda core, keys: not hold.is_set() and real_durable(core, keys))
    root = tmp_path / "dfs"
    c = SharedCluster(root, policy="write-through")
    try:
        node = c.node()
        with StoreClient(c.address) as client:
            value = os.urandom(256 * KiB)
            client.put("a", value)
            wait_for(lambda: client.stat("a").tier == "dram+shared", what="a's copy")
            version = client.stat("a").version
            path = root / file_name("a", version)
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 1
            path.write_bytes(raw)
            hold.set()  # the delete of the bad file waits (a stalled state)
            with client._pool.connection() as conn:
                conn.send(p.SharedBad(keys=["a"], versions=[version]))
            wait_for(lambda: client.stat("a").tier == "dram", what="the bad copy dropped")
            for i in range(12):  # a leaves DRAM: its write-back writes the name again
                client.put(f"fill-{i}", os.urandom(MiB))
            wait_for(lambda: client.stat("a").tier == "shared", what="a written back")
            hold.clear()
            st = c.server.core._shared
            assert st is not None
            deadline = time.monotonic() + 10
            while st.backlog() and time.monotonic() < deadline:
                c.server.core.tick()  # the delete goes ahead (or is cancelled)
                time.sleep(0.05)
            assert not st.backlog()
            assert path.exists()
            node.close()
            assert client.get("a") == value
    finally:
        c.close()


def test_a_write_claims_its_name_from_a_waiting_delete() -> None:
    st = SharedState(SharedTierConfig(Path("/unused")))
    st.unlink_later("/t/x", 0.0, "x")
    assert st.backlog() == 1
    assert st.claim("/t/x")  # waiting: cancelled, the write goes ahead
    assert st.backlog() == 0
    assert st.take_due(1.0, 10) == []
    st.unlink_later("/t/x", 0.0, "x")
    assert st.take_due(1.0, 10) == [("/t/x", "x")]
    assert not st.claim("/t/x")  # under way: no write renames into the name now
    st.deleted(["/t/x"])
    assert st.claim("/t/x")


def test_copies_stamped_in_a_row_share_one_stamp() -> None:
    """A large tier's copies share about 1,024 stamps (one int object each: no memory per
    copy); a small tier's are exact."""
    st = SharedState(SharedTierConfig(Path("/unused")))
    assert [st.next_stamp() for _ in range(3)] == [2, 3, 4]
    st.stamp = base = 1 << 40  # past the small ints Python keeps one object of anyway
    st.files = 4 * housekeeping.STAMP_BUCKETS  # buckets of 4 copies
    got = [st.next_stamp() for _ in range(9)]
    assert got == [base] * 3 + [base + 1] * 4 + [base + 2] * 2
    assert got[3] is got[6]
    assert st.stamp_age(base + 1) == 4
