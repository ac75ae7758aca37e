"""Bad shared-tier files reported by clients: the master checks each file itself, drops
the index entry of a bad one (durably) and deletes the file; reports of good files,
unknown keys, stale versions and floods change nothing and stay bounded."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.master.records import Obj
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer
from kvctl.store.sharedtier import reports
from kvctl.store.sharedtier.fileformat import file_name, write_object
from kvctl.store.sharedtier.reports import BadFileReports, verify
from kvctl.store.tenants import parse_tenants
from tests.store.conftest import wait_for
from tests.store.test_shared_tier import MiB, SharedCluster, _evict, damage_file


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "in-chunks"])
def test_verify_says_what_is_wrong_and_trusts_only_the_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    if chunked:  # as a large object is checked: header, length, streaming xxh3
        monkeypatch.setattr(reports, "WHOLE_READ_MAX", 0)
        monkeypatch.setattr(reports, "CHUNK", 4096)
    data = os.urandom(100_000)
    path = tmp_path / file_name("k", 5)
    csum = checksum(data)
    write_object(path, "k", 5, memoryview(data), csum, "ab" * 8)
    assert verify(path, "k", 5, len(data), csum) is None
    # what the index says decides, whatever a client claims: another version, size or
    # checksum makes the same good file "bad" only against that record
    assert verify(path, "k", 6, len(data), csum) is not None
    assert verify(path, "k", 5, len(data), csum ^ 1) is not None
    good = path.read_bytes()
    for how in ("flip", "truncate", "header"):
        path.write_bytes(good)
        damage_file(path, how)
        found = verify(path, "k", 5, len(data), csum)
        assert found is not None, how
        assert found[0] == "corrupt", how
    path.unlink()
    assert verify(path, "k", 5, len(data), csum) == ("ENOENT", "missing")
    os.mkfifo(path)  # a FIFO planted at the name: never opened for a blocking read
    found = verify(path, "k", 5, len(data), csum)
    assert found is not None
    assert found[0] == "corrupt"
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    found = verify(path, "k", 5, len(data), csum)
    assert found is not None
    assert found[0] == "corrupt"


def test_the_queue_is_bounded_and_good_files_are_not_read_again() -> None:
    queue = BadFileReports()
    objs = [Obj(f"k{i}", 10, 0, i + 1, ()) for i in range(reports.MAX_QUEUED + 10)]
    taken = [queue.take(o, f"/t/{o.key}", 0.0) for o in objs]
    assert taken.count(True) == reports.MAX_QUEUED
    assert queue.dropped == 10
    assert not queue.take(objs[0], "/t/k0", 0.0)  # queued already: once
    queue.queue.clear()
    queue.was_good(objs[0], 100.0)
    assert not queue.take(objs[0], "/t/k0", 100.0 + reports.GOOD_FOR_S / 2)
    assert queue.take(objs[0], "/t/k0", 100.0 + reports.GOOD_FOR_S + 1)
    for o in objs:  # the memory of good files is bounded too
        queue.was_good(o, 0.0)
    assert len(queue.good) <= reports.GOOD_MEMORY


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_reported_bad_file_leaves_the_index_for_good(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "dfs"
    c = SharedCluster(root, state=str(tmp_path / "state"))
    try:
        c.node()
        with StoreClient(c.address) as client:
            client.put("k", os.urandom(MiB))
            _evict(client, "k")
            version = client.stat("k").version
            path = root / file_name("k", version)
            damage_file(path, damage)
            with pytest.raises(ObjectNotFoundError):
                client.get("k")  # a miss, reported
            wait_for(lambda: client.status().shared.bad_files == 1,  # type: ignore[union-attr]
                     what="the master's check of the reported file")
            st = client.status().shared
            assert st is not None
            assert st.reports == 1
            assert st.errors.get("ENOENT" if damage == "remove" else "corrupt") == 1
            assert "dropped from the index" in st.last_error
            with pytest.raises(ObjectNotFoundError):
                client.stat("k")  # its last copy: the object is gone
            misses = client.shared.misses
            with pytest.raises(ObjectNotFoundError) as info:
                client.get("k")  # answered by the index, not by another bad read
            assert info.value.evicted
            assert client.shared.misses == misses
            wait_for(lambda: not path.exists(), what="the bad file's delete")
        c.nodes[0].close()
        c.nodes.clear()
        c.restart_master()  # the drop was recorded (journal): the index stays without it
        with StoreClient(c.address) as client, pytest.raises(ObjectNotFoundError):
            client.stat("k")
    finally:
        c.close()


def test_a_bad_copy_of_an_object_with_dram_keeps_the_object(tmp_path: Path) -> None:
    """The file goes; the DRAM replica still serves (write-through: both copies)."""
    c = SharedCluster(tmp_path / "dfs", policy="write-through")
    try:
        node = c.node(64 * MiB)
        with StoreClient(c.address) as client:
            value = os.urandom(256 << 10)
            client.put("k", value)
            wait_for(lambda: client.stat("k").tier == "dram+shared", what="the copy")
            path = tmp_path / "dfs" / file_name("k", client.stat("k").version)
            damage_file(path, "flip")
            # report as a client would after its DRAM read failed and the file missed
            with client._pool.connection() as conn:
                conn.send(p.SharedBad(keys=["k"], versions=[client.stat("k").version]))
            wait_for(lambda: client.stat("k").tier == "dram", what="the copy dropped")
            assert client.get("k") == value
            assert node.shared.written == 1
    finally:
        c.close()


def test_hostile_reports_change_nothing(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    c = SharedCluster(root)
    try:
        c.node()
        with StoreClient(c.address) as client:
            value = os.urandom(MiB)
            client.put("good", value)
            _evict(client, "good")
            version = client.stat("good").version
            path = root / file_name("good", version)
            started = time.monotonic()
            with client._pool.connection() as conn:
                # the good file, over and over; a stale version; unknown and odd keys;
                # lengths that disagree; a flood of keys in one message
                for _ in range(200):
                    conn.send(p.SharedBad(keys=["good"], versions=[version]))
                conn.send(p.SharedBad(keys=["good", "nope", "", "x" * 5000],
                                      versions=[version + 1, 1]))
                conn.send(p.SharedBad(keys=[f"flood-{i}" for i in range(p.MAX_BATCH)],
                                      versions=list(range(p.MAX_BATCH))))
            assert client.get("good") == value  # the connection is still in step
            assert time.monotonic() - started < 5.0
            wait_for(lambda: client.status().shared.reports >= 200,  # type: ignore[union-attr]
                     what="the reports")
            time.sleep(0.3)  # the checking thread had its chance
            st = client.status().shared
            assert st is not None
            assert st.bad_files == 0
            assert st.reports_dropped >= 190  # verified good once, then not read again
            assert path.exists()
            assert client.stat("good").tier == "shared"
            assert client.get("good") == value
    finally:
        c.close()


def test_a_file_the_master_cannot_read_stays_indexed(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO or ESTALE on the master's own read proves nothing: counted, the entry stays."""
    c = SharedCluster(tmp_path / "dfs")
    try:
        c.node()
        with StoreClient(c.address) as client:
            client.put("k", os.urandom(MiB))
            _evict(client, "k")

            def failing(*args: object, **kwargs: object) -> None:
                raise OSError(116, "Stale file handle")

            monkeypatch.setattr(reports, "verify", failing)
            with client._pool.connection() as conn:
                conn.send(p.SharedBad(keys=["k"], versions=[client.stat("k").version]))
            wait_for(lambda: client.status().shared.errors.get(  # type: ignore[union-attr]
                "ESTALE", 0) == 1, what="the failed check")
            assert client.stat("k").tier == "shared"
    finally:
        c.close()


def test_a_tenant_reports_only_its_own_keys_and_the_stream_stays_in_step() -> None:
    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=1e6)), token="admin-0123",
                          tenants=parse_tenants(["alpha=alpha-4567"]))
    seen: list[tuple[list[str], list[int]]] = []
    server.core.report_shared = lambda keys, versions: seen.append(  # type: ignore[method-assign]
        (list(keys), list(versions)))
    alpha = MasterConnection(server.address, token="alpha-4567")
    try:
        alpha.send(p.SharedBad(keys=["beta/x", "alpha/k", "other"], versions=[1, 2, 3]))
        # no reply to it: the next request's answer is its own
        assert alpha.call(p.Exists(keys=["alpha/k"])) == p.Bools(values=[False])
        assert seen == [(["alpha/k"], [2])]
    finally:
        alpha.close()
        server.close()


def test_a_master_that_does_not_take_reports_gets_none(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An older master would answer a SharedBad (a message that gets no reply) and the
    client's next answer would be that one: a client reports only to a master whose
    greeting says it takes them."""
    real = MasterConnection.__init__

    def older(self: MasterConnection, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.shared_reports = False  # what an older master's greeting decodes to

    monkeypatch.setattr(MasterConnection, "__init__", older)
    c = SharedCluster(tmp_path / "dfs")
    try:
        c.node()
        with StoreClient(c.address) as client:
            client.put("k", os.urandom(MiB))
            _evict(client, "k")
            damage_file(tmp_path / "dfs" / file_name("k", client.stat("k").version), "flip")
            with pytest.raises(ObjectNotFoundError):
                client.get("k")
            assert client.exists("k")  # in step: the answer is this request's
            st = client.status().shared
            assert st is not None
            assert st.reports == 0
    finally:
        c.close()
