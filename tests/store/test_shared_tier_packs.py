"""Shared tier packs: small copies written several to a file, each record read and checked
alone, the file deleted with its last entry, evicted whole, kept across a restart."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from msgspec.structs import replace as msgspec_replace

from kvctl.errors import KvctlError
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.server import MasterServer
from kvctl.store.sharedtier.fileformat import (
    SharedMissError,
    entry_span,
    file_name,
    pack_name,
    read_entry,
    read_pack_offsets,
    write_pack,
)
from kvctl.store.sharedtier.packs import AT_BITS
from kvctl.store.state import open_state
from tests.store.conftest import wait_for
from tests.store.test_shared_tier import SharedCluster

KiB = 1 << 10
MiB = 1 << 20


def packs(root: Path) -> list[Path]:
    return sorted(root.glob("pk/*.kvp"))


def singles(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kvs"))


def _copied(client: StoreClient, keys: list[str]) -> None:
    for key in keys:
        wait_for(lambda k=key: "shared" in client.stat(k).tier, what="shared copy")


class _Cluster(SharedCluster):
    """A :class:`SharedCluster` whose etcd state has a cluster id of its own."""

    cluster = ""

    def _master(self, port: int = 0) -> MasterServer:
        core = MasterCore(MasterConfig(node_timeout_s=2.0),
                          open_state(self.state, cluster_id=self.cluster),
                          shared_tier=self.tier)
        return MasterServer(core, port=port)


def _cluster(root: Path, **tier: object) -> SharedCluster:
    tier.setdefault("policy", "write-through")
    tier.setdefault("pack_below", 256 * KiB)
    _Cluster.cluster = f"packs-{os.urandom(4).hex()}"
    return _Cluster(root, **tier)


def test_pack_records_read_alone_and_a_flipped_one_is_a_miss_for_itself(tmp_path: Path
                                                                       ) -> None:
    values = [(f"k{i}", os.urandom(1000 + 5000 * i)) for i in range(4)]
    at, entries = 0, []
    for key, data in values:
        entries.append((key, 7, checksum(data), at, memoryview(data)))
        at += entry_span(key, len(data))
    path = tmp_path / pack_name(9)
    write_pack(path, entries, "ab" * 8)
    assert read_pack_offsets(path) == [e[3] for e in entries]
    for (key, data), e in zip(values, entries, strict=True):
        assert read_entry(path, e[3], key, 7, e[2], len(data)) == data
        out = bytearray(len(data))
        assert read_entry(path, e[3], key, 7, e[2], len(data), memoryview(out)) is None
        assert out == data
    raw = bytearray(path.read_bytes())
    raw[entries[2][3] + 200] ^= 0x10
    path.write_bytes(raw)
    for i, ((key, data), e) in enumerate(zip(values, entries, strict=True)):
        if i == 2:
            with pytest.raises(SharedMissError, match="checksum"):
                read_entry(path, e[3], key, 7, e[2], len(data))
        else:
            assert read_entry(path, e[3], key, 7, e[2], len(data)) == data
    with pytest.raises(SharedMissError, match="another object"):  # a record of another key
        read_entry(path, entries[1][3], "k0", 7, entries[1][2], len(values[1][1]))
    with pytest.raises(SharedMissError, match="another object"):  # not a record's start
        read_entry(path, entries[1][3] + 4096, "k1", 7, entries[1][2], len(values[1][1]))
    with pytest.raises(SharedMissError, match="truncated"):
        read_entry(path, len(raw) - 10, "k1", 7, entries[1][2], len(values[1][1]))
    with pytest.raises(SharedMissError, match="opened"):
        read_entry(tmp_path / "none.kvp", 0, "k1", 7, entries[1][2], 10)


def test_small_puts_land_in_few_packs_and_outlive_their_node(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs")
    try:
        node = c.node(64 * MiB)
        with StoreClient(c.address) as client:
            values = {f"s{i}": os.urandom(16 * KiB) for i in range(48)}
            values["big"] = os.urandom(MiB)  # above the threshold: a file of its own
            client.batch_put(list(values.items()))
            _copied(client, list(values))
            assert 1 <= len(packs(c.root)) <= 3
            assert [p.name for p in singles(c.root)] == [
                file_name("big", client.stat("big").version).split("/")[1]]
            st = client.status().shared
            assert st is not None
            assert st.files == len(packs(c.root)) + 1
            assert (st.packs, st.packed_objects, st.pack_below) == (
                len(packs(c.root)), 48, 256 * KiB)
            assert st.used_bytes == sum(p.stat().st_size for p in packs(c.root)) + (
                singles(c.root)[0].stat().st_size)
        node.close()  # its DRAM goes: every read is from the tier now
        c.nodes.clear()
        with StoreClient(c.address) as client:  # one that never mapped the node's DRAM
            keys = list(values)
            assert client.batch_get(keys) == list(values.values())
            outs = [bytearray(len(values[k])) for k in keys]
            assert client.batch_get_into(keys, outs) == [len(values[k]) for k in keys]
            assert outs == list(values.values())
            assert client.get("s3") == values["s3"]
            assert client.shared.misses == 0
            assert client.shared.reads == 2 * len(keys) + 1
    finally:
        c.close()


def test_a_flipped_record_is_a_miss_for_that_object_only_and_leaves_the_index(
        tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs")
    try:
        node = c.node(64 * MiB)
        with StoreClient(c.address) as client:
            values = {f"f{i}": os.urandom(20 * KiB) for i in range(8)}
            client.batch_put(list(values.items()))
            _copied(client, list(values))
            assert len(packs(c.root)) == 1
        node.close()
        c.nodes.clear()
        with StoreClient(c.address) as client:
            obj = c.server.core._index.get("f5")
            assert obj is not None
            at = obj.pack & ((1 << AT_BITS) - 1)
            path = packs(c.root)[0]
            raw = bytearray(path.read_bytes())
            raw[at + 4096] ^= 0x01
            path.write_bytes(raw)
            got = client.batch_get(list(values))
            for key, value in zip(values, got, strict=True):
                if key == "f5":
                    assert isinstance(value, KvctlError)
                    assert "fails its checksum" in str(value)
                else:
                    assert value == values[key]
            # reported, checked by the master: the index no longer names that record
            wait_for(lambda: not getattr(c.server.core._index.get("f5"), "shared", 0),
                     what="bad record dropped")
            assert c.server.core._shared.packs[obj.pack >> AT_BITS].live == 7 if (
                obj.pack) else True
            assert client.get("f4") == values["f4"]
            assert path.exists()  # its other records live
    finally:
        c.close()


def test_a_pack_is_deleted_with_its_last_entry(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs")
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            keys = [f"d{i}" for i in range(6)]
            client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
            _copied(client, keys)
            [path] = packs(c.root)
            client.put("d0", b"new bytes")  # an overwrite kills its entry
            for key in keys[1:5]:
                client.remove(key)
            c.server.core.tick()
            assert path.exists()  # d5 lives
            st = client.status().shared
            assert st is not None
            assert st.files >= 1
            client.remove("d5")
            wait_for(lambda: (c.server.core.tick(), not path.exists())[1], what="pack gone")
            wait_for(lambda: "shared" in client.stat("d0").tier, what="the new d0 copy")
            st = client.status().shared
            assert st is not None
            assert st.files == 1  # the new d0's pack
            assert st.used_bytes == sum(p.stat().st_size for p in packs(c.root))
    finally:
        c.close()


def test_quota_evicts_whole_packs_oldest_first(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs", max_files=2)
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            groups = [[f"g{g}-{i}" for i in range(4)] for g in range(3)]
            for keys in groups:  # one pack each
                client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
                _copied(client, keys)
            tiers = [[client.stat(k).tier for k in keys] for keys in groups]
            assert tiers[0] == ["dram"] * 4  # the oldest pack went whole; DRAM kept
            assert tiers[1] == tiers[2] == [["dram+shared"] * 4][0]
            st = client.status().shared
            assert st is not None
            assert st.files == 2
            assert st.evictions == 4
            wait_for(lambda: (c.server.core.tick(), len(packs(c.root)) == 2)[1],
                     what="evicted pack deleted")
    finally:
        c.close()


@pytest.mark.parametrize("state", ["journal", "etcd"])
def test_master_restart_keeps_packs_readable_and_their_table(
        tmp_path: Path, state: str, request: pytest.FixtureRequest) -> None:
    url = (str(tmp_path / "state") if state == "journal"
           else request.getfixturevalue("etcd_server").url)
    c = _cluster(tmp_path / "dfs", state=url)
    try:
        node = c.node(64 * MiB)
        with StoreClient(c.address) as client:
            values = {f"r{i}": os.urandom(12 * KiB) for i in range(10)}
            client.batch_put(list(values.items()))
            _copied(client, list(values))
            client.remove("r0")
            before = client.status().shared
        assert before is not None
        table = {pid: (pk.live, pk.path) for pid, pk in c.server.core._shared.packs.items()}
        node.close()
        c.nodes.clear()
        c.restart_master()
        core = c.server.core
        assert {pid: (pk.live, pk.path) for pid, pk in core._shared.packs.items()} == table
        with StoreClient(c.address) as client:
            after = client.status().shared
            assert after is not None
            assert after.files == before.files
            assert (after.packs, after.packed_objects) == (before.packs, 9)
            del values["r0"]
            assert client.batch_get(list(values)) == list(values.values())
            for key in values:  # the last entries go: so does the file, after a restart
                client.remove(key)
            wait_for(lambda: (core.tick(), not packs(c.root))[1], what="pack deleted")
    finally:
        c.close()


def test_an_orphan_pack_is_purged_and_a_named_one_kept(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    c = _cluster(root, orphan_grace_s=30.0, sweep_interval_s=0.0)
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            client.batch_put([(f"o{i}", os.urandom(4 * KiB)) for i in range(3)])
            _copied(client, [f"o{i}" for i in range(3)])
            [named] = packs(root)
            # a master killed between the node's rename and its journal write
            data = os.urandom(4096)
            orphan = root / pack_name(12345)
            write_pack(orphan, [("lost", 1, checksum(data), 0, memoryview(data))], "00" * 8)
            old = time.time() - 120
            for p in (orphan, named):
                os.utime(p, (old, old))
            deadline = time.monotonic() + 10
            while orphan.exists() and time.monotonic() < deadline:
                c.server.core.tick()
                time.sleep(0.01)
            assert not orphan.exists()
            assert named.exists()
            assert client.get("o1")
    finally:
        c.close()


def test_packing_off_writes_a_file_per_object(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs", pack_below=0)
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            keys = [f"n{i}" for i in range(6)]
            client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
            _copied(client, keys)
            assert not packs(c.root)
            assert len(singles(c.root)) == 6
    finally:
        c.close()


def test_a_batch_reads_each_pack_with_one_open_and_a_missing_pack_misses_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.store import protocol as p
    from kvctl.store.sharedtier import fileformat
    from kvctl.store.sharedtier.reader import SharedReader

    slots, values = [], []
    for pack_id in (1, 2, 3):
        at, entries = 0, []
        for i in range(5):
            key, data = f"p{pack_id}-{i}", os.urandom(3000 + i)
            entries.append((key, 4, checksum(data), at, memoryview(data)))
            slots.append(p.GetSlot(key=key, size=len(data), checksum=checksum(data), version=4,
                                   locations=[], shared=str(tmp_path / pack_name(pack_id)),
                                   shared_at=at))
            values.append(data)
            at += entry_span(key, len(data))
        write_pack(tmp_path / pack_name(pack_id), entries, "00" * 8)
    (tmp_path / pack_name(2)).unlink()
    opened: list[str] = []
    real = fileformat._open
    monkeypatch.setattr(fileformat, "_open", lambda path, key: (opened.append(str(path)),
                                                                real(path, key))[1])
    reader = SharedReader(threads=1)
    got = reader.read_many([(s.key, s, None) for s in slots])
    assert got[:5] == values[:5]
    assert all(isinstance(g, KvctlError) for g in got[5:10])
    assert got[10:] == values[10:]
    assert sorted(set(opened)) == sorted(str(tmp_path / pack_name(i)) for i in (1, 2, 3))
    assert len(opened) == 2 + 5  # one open per pack, again per record of the missing one
    outs = [bytearray(s.size) for s in slots]
    got = reader.read_many([(s.key, s, memoryview(o)) for s, o in zip(slots, outs,
                                                                       strict=True)])
    assert got[:5] == [s.size for s in slots[:5]]
    assert outs[10:] == values[10:]


def test_the_writer_leaves_out_records_whose_dram_changed(tmp_path: Path) -> None:
    from kvctl.store import protocol as p
    from kvctl.store.sharedtier.config import open_tier
    from kvctl.store.sharedtier.writer import SharedWriter

    dram = bytearray(os.urandom(3 * 8192))
    sums = [checksum(dram[i * 8192:(i + 1) * 8192]) for i in range(3)]
    sums[1] ^= 1  # its DRAM copy moved on
    entries = [p.PackEntry(f"w{i}", 5, i * 8192, 8192, sums[i], i * entry_span("w0", 8192))
               for i in range(3)]
    open_tier(tmp_path)  # a node writes only into a tier (its root's marker file)
    path = tmp_path / pack_name(77)
    task = p.Task(task_id=1, op="pack", key="", version=77, offset=0, size=0, checksum=0,
                  path=str(path), entries=entries)
    writer = SharedWriter()
    report = writer.run(task, lambda off, size: memoryview(dram)[off:off + size], "ab" * 8)
    assert report.ok
    assert report.failed == [1]
    assert read_pack_offsets(path) == [entries[0].at, entries[2].at]
    assert read_entry(path, entries[2].at, "w2", 5, sums[2], 8192) == dram[2 * 8192:]
    with pytest.raises(SharedMissError):  # zeros where it would have been
        read_entry(path, entries[1].at, "w1", 5, sums[1], 8192)
    every = msgspec_replace(task, task_id=2, entries=[
        msgspec_replace(e, checksum=e.checksum ^ 2) for e in entries])
    path.unlink()
    report = writer.run(every, lambda off, size: memoryview(dram)[off:off + size], "ab" * 8)
    assert not report.ok
    assert report.error.startswith("CHANGED")
    assert not path.exists()


def test_write_back_evictions_are_packed_and_their_dram_freed(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs", policy="write-back")
    try:
        node = c.node(4 * MiB)
        with StoreClient(c.address) as client:
            values = {f"e{i}": os.urandom(40 * KiB) for i in range(150)}  # 6 MiB through 4
            for key, value in values.items():
                client.put(key, value)
            wait_for(lambda: sum(client.stat(k).tier == "shared" for k in values) >= 40,
                     what="write-back")
            evicted = [k for k in values if client.stat(k).tier == "shared"]
            assert len(packs(c.root)) < len(evicted) / 4  # several evictions to a file
            assert not singles(c.root)
        node.close()
        c.nodes.clear()
        with StoreClient(c.address) as client:
            assert client.batch_get(evicted) == [values[k] for k in evicted]
            assert client.shared.reads == len(evicted)
    finally:
        c.close()


def test_a_full_file_system_fails_a_pack_whole_and_leaks_nothing(tmp_path: Path) -> None:
    root = tmp_path / "small"
    root.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)],
            capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        c = _cluster(root / "tier", full_retry_s=60.0)
        try:
            c.node(64 * MiB)
            with StoreClient(c.address) as client:
                values = [(f"x{i}", os.urandom(64 * KiB)) for i in range(30)]  # 2 MiB
                client.batch_put(values)
                core = c.server.core
                st = core._shared
                wait_for(lambda: client.status().shared.errors["ENOSPC"] >= 1,
                         what="ENOSPC")
                wait_for(lambda: not st.writing and not any(
                    pk.task is not None for pk in st.packs.values()), what="writes over")
                assert all(pk.landed for pk in st.packs.values())
                assert st.files == len(packs(root / "tier")) == len(st.packs)
                assert st.used_bytes == sum(p.stat().st_size for p in packs(root / "tier"))
                assert not list((root / "tier").rglob("*.tmp"))
                assert client.batch_get([k for k, _ in values]) == [v for _, v in values]
        finally:
            c.close()
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_node_dropped_with_a_pack_in_flight_leaves_nothing_behind(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs")
    try:
        node = c.node(64 * MiB)
        with StoreClient(c.address) as client:
            client.batch_put([(f"z{i}", os.urandom(8 * KiB)) for i in range(10)])
            node.close()  # before the copies' task is carried out (or reported)
            c.nodes.clear()
            core = c.server.core
            st = core._shared
            with core._lock:
                [dropped] = list(core._nodes.values())
            core.drop_node(dropped.node_id)
            assert not st.writing
            assert not st.open_packs
            assert not [pk for pk in st.packs.values() if not pk.landed]
            assert st.queued.get(dropped, (0, 0)) == (0, 0)
    finally:
        c.close()


def test_a_pack_whose_every_record_changed_while_written_is_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.store import protocol as p
    from kvctl.store.sharedtier.writer import SharedWriter

    real = SharedWriter._write_pack

    def changed_meanwhile(self: SharedWriter, task: p.Task, views: list[memoryview],
                          epoch: str) -> p.TaskReport:
        report = real(self, task, views, epoch)  # written and renamed, then found changed
        return msgspec_replace(report, failed=list(range(len(task.entries))))

    monkeypatch.setattr(SharedWriter, "_write_pack", changed_meanwhile)
    c = _cluster(tmp_path / "dfs")
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            keys = [f"c{i}" for i in range(5)]
            client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
            core = c.server.core
            wait_for(lambda: (core.tick(), core._shared.writes >= 1 and not packs(c.root))[1],
                     what="the pack deleted")
            assert not core._shared.packs
            assert [client.stat(k).tier for k in keys] == ["dram"] * 5
            st = client.status().shared
            assert st is not None
            assert (st.files, st.used_bytes) == (0, 0)
    finally:
        c.close()


def test_a_cut_pack_misses_from_the_cut_on(tmp_path: Path) -> None:
    at, entries = 0, []
    for i in range(4):
        data = os.urandom(6000)
        entries.append((f"t{i}", 2, checksum(data), at, memoryview(data)))
        at += entry_span(f"t{i}", 6000)
    path = tmp_path / pack_name(5)
    write_pack(path, entries, "00" * 8)
    with path.open("r+b") as fh:
        fh.truncate(entries[2][3] + 100)  # torn inside the third record
    for i, (key, version, csum, where, data) in enumerate(entries):
        if i < 2:
            assert read_entry(path, where, key, version, csum, 6000) == bytes(data)
        else:
            with pytest.raises(SharedMissError, match="truncated"):
                read_entry(path, where, key, version, csum, 6000)
    assert read_pack_offsets(path) is None  # its trailer went with the cut


def test_an_object_overwritten_while_its_pack_is_written_is_no_entry_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.store.sharedtier import writer

    real = writer.write_pack

    def slow(*args: object, **kwargs: object) -> None:
        time.sleep(0.4)  # a distributed file system taking its time
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "write_pack", slow)
    c = _cluster(tmp_path / "dfs")
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            keys = [f"v{i}" for i in range(6)]
            client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
            core = c.server.core
            def sent() -> bool:  # the node has the pack's task: a new put packs elsewhere
                with core._lock:
                    tasks = [t for n in core._nodes.values() for t in n.inflight.values()]
                    return any(t.op == "pack" for t in tasks)

            wait_for(sent, what="a pack in flight")
            new = os.urandom(5 * KiB)
            client.put("v2", new)  # while the pack holding v2's old version is written
            _copied(client, keys)
            [old] = [pk for pk in core._shared.packs.values()
                     if "v0" in pk.keys]
            assert old.live == 5
            assert "v2" not in old.keys
            assert client.get("v2") == new
            for key in keys:
                client.remove(key)
            wait_for(lambda: (core.tick(), not packs(c.root))[1], what="every pack deleted")
            st = client.status().shared
            assert st is not None
            assert (st.files, st.used_bytes, st.packs, st.packed_objects) == (0, 0, 0, 0)
    finally:
        c.close()
