"""etcd restored from an older backup under a running master (an operator's disaster
recovery, issue 27 item 9): the master sees etcd's revision go below its watermark, refuses
new puts and says so, and re-writes every record it holds, so no acknowledged put is lost
(before the fix it acknowledged on, logged nothing, and a restarted master lost the 50 puts
made between the backup and the restore). The restore is emulated faithfully: etcd stopped,
its data directory copied aside (the backup), later put back over the newer one (what
``etcdctl snapshot restore`` produces: the same keys and revisions as at the backup)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.store.errors import StoreUnavailableError
from kvctl.store.state import MetadataState, NodeRecord, ObjectRecord, ReplicaRecord
from kvctl.store.state.writebehind import read_state
from tests.fixtures.servers import ServerProcess

pytestmark = pytest.mark.integration

NODE = NodeRecord("a", "E", "seg", "127.0.0.1:1", "h", 1 << 30, 0, "")
DEADLINE_S = 20.0


def _record(i: int, version: int) -> ObjectRecord:
    return ObjectRecord(f"k{i:04d}", 100, version, version, [ReplicaRecord("a", i * 100, 100)],
                        [])


def _put(state: MetadataState, live: dict[str, ObjectRecord], rec: ObjectRecord) -> None:
    assert state.refusal() is None, state.refusal()
    live[rec.key] = rec
    state.put_object(rec)
    assert state.ack(timeout_s=10) is None


def _tick(state: MetadataState, live: dict[str, ObjectRecord]) -> None:
    """What the master's tick does: a snapshot from its live view when one is wanted."""
    if state.snapshot_wanted(len(live)):
        snap = state.start_snapshot([NODE])
        assert snap is not None
        snap.add([live[k] for k in sorted(live)])
        snap.write()
        snap.finish()


def _backup(etcd: ServerProcess, to: Path) -> None:
    etcd.stop()
    shutil.copytree(etcd.data_dir, to)
    etcd.start()


def _restore(etcd: ServerProcess, backup: Path) -> None:
    etcd.stop()
    shutil.rmtree(etcd.data_dir)
    shutil.copytree(backup, etcd.data_dir)
    etcd.start()


def test_restore_under_a_running_master_loses_no_acknowledged_put(
        spawn_etcd: Callable[[], ServerProcess], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    etcd = spawn_etcd()
    state = MetadataState(etcd.url, cluster_id="restore", compact_min=1_000_000)
    live: dict[str, ObjectRecord] = {}
    try:
        list(state.replay())
        state.put_node(NODE)
        assert state.ack(timeout_s=10) is None
        for i in range(100):
            _put(state, live, _record(i, i + 1))
        _backup(etcd, tmp_path / "backup")
        for i in range(100, 150):  # the 50 puts the backup does not have
            _put(state, live, _record(i, i + 1))
        with caplog.at_level(logging.ERROR, logger="kvctl.store.state"):
            _restore(etcd, tmp_path / "backup")
            deadline = time.monotonic() + DEADLINE_S
            while state.refusal() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        refusal = state.refusal()
        assert refusal is not None
        assert "etcd went back" in refusal, refusal
        assert any("etcd went back from revision" in r.getMessage() for r in caplog.records)
        deadline = time.monotonic() + DEADLINE_S
        while state.refusal() is not None and time.monotonic() < deadline:
            _tick(state, live)
            time.sleep(0.05)
        assert state.refusal() is None  # re-written: puts are taken again
        for i in range(150, 160):
            _put(state, live, _record(i, i + 1))
    finally:
        state.close()
    loaded = read_state(etcd.url, cluster_id="restore")  # a restarted master's load
    assert {r.key: r.version for r in loaded.objects} == {k: r.version for k, r in
                                                          live.items()}


def test_a_log_that_ends_before_its_watermark_is_refused_on_load(
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """A load checks the watermark: etcd without the log batch the watermark names (its
    tail lost or deleted) does not load as if nothing were missing."""
    from kvctl.metadata import open_metadata

    etcd = spawn_etcd()
    state = MetadataState(etcd.url, cluster_id="mark")
    try:
        list(state.replay())
        state.put_node(NODE)
        for i in range(5):
            state.put_object(_record(i, i + 1))
            assert state.ack(timeout_s=10) is None
    finally:
        state.close()
    client = open_metadata(etcd.url)
    try:
        keys = sorted(k for k in client.list("kvctl/mark/store/log/"))
        assert keys
        client.delete(keys[-1])  # the last batch lost; the watermark still names it
    finally:
        client.close()
    with pytest.raises(StoreUnavailableError, match="watermark"):
        read_state(etcd.url, cluster_id="mark")


def test_restore_under_a_serving_master(spawn_etcd: Callable[[], ServerProcess],
                                        tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """The same through a serving master, a node and a client, puts going on: the master
    says etcd went back, refuses puts with that cause while it re-writes its state (a
    moment: its tick takes the snapshot), then takes them again; a master restarted on
    etcd afterwards holds every acknowledged put."""
    from kvctl.store import protocol as p
    from kvctl.store.checksum import checksum
    from kvctl.store.client import StoreClient
    from kvctl.store.master import MasterConfig, MasterCore
    from kvctl.store.node import StorageNode
    from kvctl.store.server import MasterServer
    from tests.reliability.conftest import make_value

    etcd = spawn_etcd()
    state = MetadataState(etcd.url, cluster_id="serve")
    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=30), state=state))
    node = StorageNode(server.address, node_id="a", capacity_bytes=32 << 20, heartbeat_s=0.1)
    acked: list[str] = []
    refused: list[str] = []
    try:
        with StoreClient(server.address, timeout_s=10) as client:
            for i in range(100):
                client.put(f"k{i}", make_value(f"k{i}", 1, 1000))
                acked.append(f"k{i}")
            _backup(etcd, tmp_path / "backup")
            for i in range(100, 150):
                client.put(f"k{i}", make_value(f"k{i}", 1, 1000))
                acked.append(f"k{i}")
            caplog.set_level(logging.WARNING, logger="kvctl.store.state")
            _restore(etcd, tmp_path / "backup")
            deadline = time.monotonic() + DEADLINE_S
            i = 150

            def rewritten() -> bool:
                return any("written again" in r.getMessage() for r in caplog.records)

            while time.monotonic() < deadline and (i < 200 or not rewritten()):
                try:
                    client.put(f"k{i}", make_value(f"k{i}", 1, 1000))
                    acked.append(f"k{i}")
                except StoreUnavailableError as exc:
                    refused.append(exc.cause)
                i += 1
                time.sleep(0.02)
            assert any("etcd went back from revision" in r.getMessage()
                       for r in caplog.records)
            assert rewritten()
            assert all("etcd went back" in cause for cause in refused), refused[:1]
            assert state.rewound is None, state.rewound
            print(f"\netcd restored under a serving master: {len(refused)} put(s) refused "
                  f"while it re-wrote its state, {len(acked)} acknowledged")
            client.put("after", make_value("after", 1, 1000))
            acked.append("after")
    finally:
        node.close()
        server.close()
    restarted = MasterCore(state=MetadataState(etcd.url, cluster_id="serve"))
    try:
        for key in acked:
            info = restarted.stat(key)
            assert isinstance(info, p.ObjectInfo), (key, info)
            assert info.checksum == checksum(make_value(key, 1, 1000)), key
    finally:
        restarted.close()
