"""Shared tier: objects outlive their node, are read by the client from the file, and a
torn or foreign file is a miss (never served); quota, purge and restart."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.store.sharedtier.config import SharedTierConfig, map_path, parse_map
from kvctl.store.sharedtier.fileformat import (
    SharedMissError,
    file_name,
    read_bytes,
    read_into,
    write_object,
)
from kvctl.store.state import open_state
from tests.store.conftest import wait_for

MiB = 1 << 20


class SharedCluster:
    """A master with a shared tier and nodes, in this process."""

    def __init__(self, root: Path, *, state: str = "none", **tier: object) -> None:
        self.root = root
        self.tier = SharedTierConfig(root, **tier)  # type: ignore[arg-type]
        self.state = state
        self.server = self._master()
        self.nodes: list[StorageNode] = []

    def _master(self, port: int = 0) -> MasterServer:
        core = MasterCore(MasterConfig(node_timeout_s=2.0), open_state(self.state),
                          shared_tier=self.tier)
        return MasterServer(core, port=port)

    @property
    def address(self) -> str:
        return self.server.address

    def node(self, capacity_bytes: int = 8 * MiB) -> StorageNode:
        node = StorageNode(self.address, capacity_bytes=capacity_bytes, heartbeat_s=0.05)
        self.nodes.append(node)
        return node

    def restart_master(self) -> None:
        port = self.server.port
        self.server.close()
        self.server = self._master(port)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.server.close()


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[SharedCluster]:
    c = SharedCluster(tmp_path / "dfs")
    yield c
    c.close()


def damage_file(path: Path, how: str) -> None:
    """Flip a bit of the bytes, ``truncate`` by one byte, flip the ``header``'s magic, or
    ``remove`` the file."""
    if how == "flip":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        path.write_bytes(raw)
    elif how == "truncate":
        with path.open("r+b") as fh:
            fh.truncate(path.stat().st_size - 1)
    elif how == "header":
        raw = bytearray(path.read_bytes())
        raw[0] ^= 0xFF
        path.write_bytes(raw)
    else:
        path.unlink()


def _fill(client: StoreClient, count: int = 16) -> None:
    for i in range(count):  # 16 MiB through 8 MiB of DRAM
        client.put(f"fill-{i}", os.urandom(MiB))


def _evict(client: StoreClient, key: str) -> None:
    """Push ``key`` out of DRAM into the shared tier (write-back)."""
    _fill(client)
    wait_for(lambda: client.stat(key).tier == "shared", what="write-back")


def test_file_roundtrip_and_every_kind_of_damage_is_a_miss(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    path = tmp_path / file_name("k/1", 7)
    write_object(path, "k/1", 7, memoryview(data), checksum(data), "ab" * 8)
    assert read_bytes(path, "k/1", 7, checksum(data), len(data)) == data
    out = bytearray(len(data))
    read_into(path, "k/1", 7, checksum(data), memoryview(out))
    assert out == data
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    good = path.read_bytes()

    def damaged(raw: bytes) -> None:
        path.write_bytes(raw)
        with pytest.raises(SharedMissError):
            read_bytes(path, "k/1", 7, checksum(data), len(data))
        with pytest.raises(SharedMissError):
            read_into(path, "k/1", 7, checksum(data), memoryview(out))

    flipped = bytearray(good)
    flipped[-1000] ^= 0x10
    damaged(bytes(flipped))  # a bit flip in the bytes
    header_flip = bytearray(good)
    header_flip[12] ^= 0x01
    damaged(bytes(header_flip))  # a bit flip in the header (size)
    damaged(good[:-1])  # torn
    damaged(good + b"x")  # trailing bytes: not this object
    path.write_bytes(good)
    with pytest.raises(SharedMissError):  # another version of the key
        read_bytes(path, "k/1", 8, checksum(data), len(data))
    with pytest.raises(SharedMissError):  # another key
        read_bytes(path, "k/2", 7, checksum(data), len(data))
    path.unlink()
    with pytest.raises(SharedMissError, match="opened"):
        read_bytes(path, "k/1", 7, checksum(data), len(data))


def test_path_map() -> None:
    pairs = parse_map("/mnt/3fs/kv=/data/kv, /a=/b")
    assert map_path("/mnt/3fs/kv/ab/x.kvs", pairs) == Path("/data/kv/ab/x.kvs")
    assert map_path("/mnt/3fs/kvx/y", pairs) == Path("/mnt/3fs/kvx/y")
    with pytest.raises(UsageError):
        parse_map("relative=/b")


@pytest.mark.parametrize("wait_s", [0.25, 0.0], ids=["in-time", "pending"])
def test_evicted_object_is_written_back_and_outlives_its_node(shared: SharedCluster,
                                                              wait_s: float) -> None:
    node = shared.node()
    # 0: every write outlasts the heartbeat's wait (a slow file system): reported pending,
    # its real report comes with a later heartbeat
    node.shared.wait_s = wait_s
    keep = os.urandom(MiB)
    with StoreClient(shared.address) as client:
        client.put("keep", keep)
        _evict(client, "keep")
        version = client.stat("keep").version
        assert (shared.root / file_name("keep", version)).exists()
        node.close()  # the writer goes: its DRAM with it
        assert client.get("keep") == keep  # read from the file, no node
        buf = bytearray(2 * MiB)
        assert client.get_into("keep", buf) == MiB
        assert buf[:MiB] == keep
        st = client.status().shared
        assert st is not None
        assert st.files >= 1
        assert st.writes >= 1
        assert st.write_errors == 0


def test_write_through_copy_serves_when_the_node_dies(shared: SharedCluster) -> None:
    shared.close()
    c = SharedCluster(shared.root, policy="write-through")
    try:
        node = c.node(64 * MiB)
        with StoreClient(c.address) as client:
            values = {f"k{i}": os.urandom(64 << 10) for i in range(8)}
            client.batch_put(list(values.items()))
            for key in values:
                wait_for(lambda k=key: client.stat(k).tier == "dram+shared", what="copy")
            node.close()  # the DRAM read fails at once: the get falls back to the file
            assert client.batch_get(list(values)) == list(values.values())
    finally:
        c.close()


def test_master_restart_keeps_the_index(tmp_path: Path) -> None:
    c = SharedCluster(tmp_path / "dfs", state=str(tmp_path / "state"))
    try:
        node = c.node()
        keep = os.urandom(MiB)
        with StoreClient(c.address) as client:
            client.put("keep", keep)
            _evict(client, "keep")
        node.close()
        c.nodes.clear()
        c.restart_master()  # no node registers again: the index alone names the file
        with StoreClient(c.address) as client:
            assert client.stat("keep").tier == "shared"
            assert client.get("keep") == keep
    finally:
        c.close()
    with pytest.raises(UsageError, match="shared tier"):  # its state needs the tier
        MasterCore(MasterConfig(), open_state(str(tmp_path / "state"))).close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_file_is_a_miss(shared: SharedCluster, damage: str) -> None:
    shared.node()
    with StoreClient(shared.address) as client:
        client.put("k", os.urandom(MiB))
        _evict(client, "k")
        damage_file(shared.root / file_name("k", client.stat("k").version), damage)
        with pytest.raises(ObjectNotFoundError) as info:
            client.get("k")
        assert info.value.evicted
        assert client.batch_get_into(["k"], [bytearray(MiB)])[0].__class__ is \
            ObjectNotFoundError
        # the first miss was reported: once the master has checked the file the index
        # stops naming it, and the second get may no longer read it
        assert 1 <= client.shared.misses <= 2
        assert client.shared.reads == 0


def test_quota_evicts_the_least_recently_used_first(tmp_path: Path) -> None:
    c = SharedCluster(tmp_path / "dfs", policy="write-through", max_files=3)
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            for name in "abcde":
                client.put(name, os.urandom(64 << 10))
                wait_for(lambda n=name: "shared" in client.stat(n).tier, what="copy")
            assert [client.stat(n).tier for n in "abcde"] == [
                "dram", "dram", "dram+shared", "dram+shared", "dram+shared"]
            st = client.status().shared
            assert st is not None
            assert st.files == 3
            assert st.evictions == 2
            c.server.core.tick()
            files = sorted(p.name for p in c.root.glob("*/*.kvs"))
            assert files == sorted(file_name(n, client.stat(n).version).split("/")[1]
                                   for n in "cde")
    finally:
        c.close()


def test_quota_forgets_an_object_whose_last_copy_it_evicts(tmp_path: Path) -> None:
    c = SharedCluster(tmp_path / "dfs", max_files=2)
    try:
        c.node()
        with StoreClient(c.address) as client:
            client.put("old", os.urandom(MiB))
            _fill(client, 24)  # evicts "old" and many fill-* into a tier of 2 files
            with pytest.raises(ObjectNotFoundError) as info:
                client.get("old")
            assert info.value.evicted
            st = client.status().shared
            assert st is not None
            assert st.files <= 2
            assert st.evictions >= 1
    finally:
        c.close()


def test_orphans_are_purged_and_named_files_kept(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    c = SharedCluster(root, orphan_grace_s=30.0, sweep_interval_s=0.0)
    try:
        c.node()
        with StoreClient(c.address) as client:
            client.put("keep", os.urandom(MiB))
            _evict(client, "keep")
            named = root / file_name("keep", client.stat("keep").version)
            # What a master killed between a node's rename and its journal write leaves:
            # a whole file no index names; and a write that died before its rename.
            data = os.urandom(4096)
            orphan = root / file_name("lost", 999_999)
            write_object(orphan, "lost", 999_999, memoryview(data), checksum(data), "00" * 8)
            young = root / file_name("young", 999_998)
            write_object(young, "young", 999_998, memoryview(data), checksum(data), "00" * 8)
            tmp = orphan.parent / f".{orphan.name}.deadbeef.tmp"
            tmp.write_bytes(b"half")
            old = time.time() - 120
            for p in (orphan, tmp, named):
                os.utime(p, (old, old))
            deadline = time.monotonic() + 10
            while (orphan.exists() or tmp.exists()) and time.monotonic() < deadline:
                c.server.core.tick()
                time.sleep(0.01)
            assert not orphan.exists()
            assert not tmp.exists()
            assert named.exists()
            assert young.exists()
            st = client.status().shared
            assert st is not None
            assert st.purged >= 2
            assert client.get("keep")
    finally:
        c.close()


def test_a_killed_masters_files_are_purged_by_the_next(tmp_path: Path) -> None:
    """A master with no state dies; the one after it knows none of its files."""
    root = tmp_path / "dfs"
    c = SharedCluster(root)
    c.node()
    with StoreClient(c.address) as client:
        client.put("k", os.urandom(MiB))
        _evict(client, "k")
    c.close()
    files = list(root.glob("*/*.kvs"))
    assert files
    old = time.time() - 120
    for p in files:
        os.utime(p, (old, old))
    c = SharedCluster(root, orphan_grace_s=30.0, sweep_interval_s=0.0)
    try:
        deadline = time.monotonic() + 10
        while list(root.glob("*/*.kvs")) and time.monotonic() < deadline:
            c.server.core.tick()
            time.sleep(0.01)
        assert not list(root.glob("*/*.kvs"))
    finally:
        c.close()


def test_a_full_file_system_pauses_writes_and_dram_keeps_serving(tmp_path: Path) -> None:
    root = tmp_path / "small"
    root.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(root)],
            capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        c = SharedCluster(root / "tier", full_retry_s=60.0)
        try:
            c.node()
            with StoreClient(c.address) as client:
                _fill(client, 24)  # 16 MiB of evictions into 3 MiB
                st = client.status().shared
                assert st is not None
                assert st.errors["ENOSPC"] >= 1
                assert st.state == "full"
                assert "ENOSPC" in st.last_error
                fresh = os.urandom(MiB)
                client.put("fresh", fresh)  # DRAM keeps serving
                assert client.get("fresh") == fresh
                assert not list((root / "tier").rglob("*.tmp"))
        finally:
            c.close()
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(root)], check=False)


def test_writer_never_records_bytes_that_changed(tmp_path: Path) -> None:
    from kvctl.store import protocol as p
    from kvctl.store.sharedtier.config import open_tier
    from kvctl.store.sharedtier.writer import SharedWriter

    open_tier(tmp_path)  # a node writes only into a tier (its root's marker file)
    data = bytearray(os.urandom(4096))
    path = tmp_path / file_name("k", 3)
    task = p.Task(task_id=1, op="shared", key="k", version=3, offset=0, size=4096,
                  checksum=checksum(data) ^ 1, path=str(path))  # the DRAM copy moved on
    report = SharedWriter().run(task, lambda off, size: memoryview(data)[off:off + size],
                                "ab" * 8)
    assert not report.ok
    assert report.error.startswith("CHANGED")
    assert not path.exists()
    ok = SharedWriter(wait_s=0.0)  # a slow file system: pending first, the report later
    task = p.Task(task_id=2, op="shared", key="k", version=3, offset=0, size=4096,
                  checksum=checksum(data), path=str(path))
    first = ok.run(task, lambda off, size: memoryview(data)[off:off + size], "ab" * 8)
    deadline = time.monotonic() + 10
    late: list[p.TaskReport] = []
    while first.pending and not late and time.monotonic() < deadline:
        late = ok.finished()
        time.sleep(0.01)
    assert (first if not first.pending else late[0]).ok
    assert read_bytes(path, "k", 3, checksum(data), 4096) == data


def test_a_symlink_planted_at_a_name_is_a_miss(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    data = os.urandom(4096)
    good = tmp_path / "good.kvs"
    write_object(good, "k", 1, memoryview(data), checksum(data), "0" * 16)
    secret.write_bytes(good.read_bytes())  # a valid file, reached only through a link
    link = tmp_path / file_name("k", 1)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(secret)
    with pytest.raises(SharedMissError):
        read_bytes(link, "k", 1, checksum(data), 4096)
