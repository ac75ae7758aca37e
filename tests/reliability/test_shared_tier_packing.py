"""Hostile tests of shared-tier packing (2026-12-01): what broke, fixed, kept fixed."""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from pathlib import Path

import msgspec
import pytest

from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.rpc import MasterConnection
from kvctl.store.sharedtier.config import TIER_MARKER, open_tier
from kvctl.store.sharedtier.fileformat import (
    SharedMissError,
    pack_name,
    read_entry,
    read_object,
    write_object,
    write_pack,
)
from kvctl.store.sharedtier.writer import SharedWriter
from kvctl.store.state import open_state
from tests.store.conftest import wait_for
from tests.store.test_shared_tier_packs import _cluster, _copied

KiB = 1 << 10
MiB = 1 << 20


def test_a_write_never_creates_the_tier_root(tmp_path: Path) -> None:
    root = tmp_path / "dfs"  # an unmounted distributed file system: the root is gone
    data = memoryview(os.urandom(100))
    with pytest.raises(FileNotFoundError):
        write_object(root / "ab" / "x.kvs", "k", 1, data, checksum(data), "00" * 8)
    with pytest.raises(FileNotFoundError):
        write_pack(root / "pk" / "1.kvp", [("k", 1, checksum(data), 0, data)], "00" * 8)
    assert not root.exists()
    root.mkdir()  # the root is there: its xx/ and pk/ subdirectories are made
    write_object(root / "ab" / "x.kvs", "k", 1, data, checksum(data), "00" * 8)
    write_pack(root / "pk" / "1.kvp", [("k", 1, checksum(data), 0, data)], "00" * 8)
    assert sorted(p.name for p in root.iterdir()) == ["ab", "pk"]


@pytest.mark.parametrize("unmounted", ["root-gone", "bare-mount-point"])
@pytest.mark.parametrize("size", [8 * KiB, 512 * KiB], ids=["packed", "single"])
def test_an_unmounted_tier_takes_no_local_copies(tmp_path: Path, size: int,
                                                 unmounted: str) -> None:
    # The tier's directory removed, or (an unmount) left as the bare mount point, an empty
    # directory of the local disk: a write made the root (mkdir -p) or its xx/ and pk/ in
    # it, and copies no other host sees were recorded.
    c = _cluster(tmp_path / "dfs")
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            assert (c.root / TIER_MARKER).exists()
            shutil.rmtree(c.root)
            if unmounted == "bare-mount-point":
                c.root.mkdir()
            values = [(f"r{i}", os.urandom(size)) for i in range(4)]
            client.batch_put(values)
            wait_for(lambda: client.status().shared.write_errors >= 1, what="a write error")
            assert not c.root.exists() or not list(c.root.iterdir())
            st = client.status().shared
            assert st is not None
            assert st.errors.get("other", 0) >= 1
            assert "ENOENT" in st.last_error
            assert (st.files, st.used_bytes, st.packs, st.packed_objects) == (0, 0, 0, 0)
            assert [client.stat(k).tier for k, _ in values] == ["dram"] * 4
            assert client.batch_get([k for k, _ in values]) == [v for _, v in values]
            core = c.server.core
            wait_for(lambda: not core._shared.writing and not core._shared.packs,
                     what="no write left in the tables")
    finally:
        c.close()


def test_the_sweep_leaves_a_pack_whose_delete_waits_for_its_readers(tmp_path: Path) -> None:
    # A batched get on another host holds a lease on a packed copy; the copies leave the
    # index (removed, evicted): the pack's delete waits for the lease. The sweep used to
    # take the pack (no table names it any more) as an orphan and delete it at once,
    # ahead of the lease and of the state change being durable.
    c = _cluster(tmp_path / "dfs", orphan_grace_s=0.3, sweep_interval_s=0.05)
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            keys = [f"l{i}" for i in range(6)]
            client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
            core = c.server.core
            wait_for(lambda: len(core._shared.packs) >= 1 and all(
                pk.landed for pk in core._shared.packs.values()), what="packs landed")
            [pack] = sorted((c.root / "pk").glob("*.kvp"))
            time.sleep(0.4)  # older than the orphan grace
            with core._lock:
                for key in keys:  # a reader's lease on each copy, as a get takes
                    obj = core._index.get(key)
                    obj.readers += 1
                    obj.lease_until = core._clock() + 60.0
            for key in keys:
                client.remove(key)
            assert not core._shared.packs
            for _ in range(30):  # many sweeps of pk/ pass meanwhile
                time.sleep(0.02)
                core._shared_housekeeping()
            assert pack.exists()
            assert core._shared.backlog() == 1
    finally:
        c.close()


def _pack_task(path: Path, key: str, data: bytes, task_id: int = 1) -> p.Task:
    return p.Task(task_id=task_id, op="pack", key="", version=1, offset=0, size=0,
                  checksum=0, path=str(path),
                  entries=[p.PackEntry(key, 3, 0, len(data), checksum(data), 0)])


def test_a_late_write_of_a_reused_pack_id_never_replaces_the_pack(tmp_path: Path) -> None:
    # Pack ids restart at max(ids the state names) + 1: a master killed with packs in
    # flight gives their ids again, and the node that was writing the old one (a slow
    # distributed file system) renames it late, over the new pack the index now names.
    root = tmp_path / "dfs"
    open_tier(root)
    path = root / pack_name(77)
    new, old = os.urandom(5000), os.urandom(5000)
    new_writer, old_writer = SharedWriter(), SharedWriter()
    report = new_writer.run(_pack_task(path, "new", new), lambda o, s: memoryview(new),
                            "11" * 8)
    assert report.ok
    late = old_writer.run(_pack_task(path, "old", old), lambda o, s: memoryview(old),
                          "22" * 8)
    assert not late.ok
    assert late.error.startswith("EEXIST")
    assert read_entry(path, 0, "new", 3, checksum(new), len(new)) == new
    assert not list(root.rglob("*.tmp"))


def test_a_restarted_master_never_gives_a_task_id_of_its_last_run(tmp_path: Path) -> None:
    # A node's late report (a write pending across the restart) names the old run's task
    # id; were it one the new master gave a task in flight on that node, its outcome
    # (ok: DRAM freed, a copy recorded) would be taken for the new task's.
    state = str(tmp_path / "state")
    first = MasterCore(MasterConfig(), open_state(state))
    ids = [next(first._task_ids) for _ in range(1000)]
    first.close()
    second = MasterCore(MasterConfig(), open_state(state))
    try:
        assert next(second._task_ids) > max(ids)
    finally:
        second.close()


def test_an_older_client_reading_a_pack_as_a_single_file_misses(tmp_path: Path) -> None:
    # A client from before packing drops GetSlot.shared_at (msgspec ignores the trailing
    # field) and reads the pack as the object's own file: a miss, never the wrong bytes,
    # for the record at offset 0 (the pack goes on past it) as for any other.
    values = [(f"o{i}", os.urandom(3000)) for i in range(3)]
    path = tmp_path / pack_name(5)
    entries, at = [], 0
    for key, data in values:
        entries.append((key, 1, checksum(data), at, memoryview(data)))
        at += 4096
    write_pack(path, entries, "00" * 8)
    for key, data in values:
        with pytest.raises(SharedMissError, match=r"longer|another object"):
            read_object(path, key, 1, checksum(data), len(data))


def core_nodes(c: object) -> list[object]:
    core = c.server.core  # type: ignore[attr-defined]
    with core._lock:
        return [n for n in core._nodes.values() if n.alive]


def test_packing_switched_off_and_on_across_restarts_keeps_every_copy(tmp_path: Path) -> None:
    c = _cluster(tmp_path / "dfs", state=str(tmp_path / "state"))
    try:
        c.node(64 * MiB)
        values = {f"w{i}": os.urandom(8 * KiB) for i in range(8)}
        with StoreClient(c.address) as client:
            client.batch_put(list(values.items()))
            wait_for(lambda: all("shared" in client.stat(k).tier for k in values),
                     what="packed copies")
        packed = sorted((c.root / "pk").glob("*.kvp"))
        assert packed
        for below in (0, 256 * KiB):  # off: the packs stay named; on again: new ones
            c.tier = dataclasses.replace(c.tier, pack_below=below)
            c.restart_master()
            with StoreClient(c.address) as client:
                key = f"n{below}"
                values[key] = os.urandom(8 * KiB)
                wait_for(lambda: len(core_nodes(c)) == 1, what="the node back")
                client.put(key, values[key])
                wait_for(lambda k=key: "shared" in client.stat(k).tier, what="a copy")
                st = client.status().shared
                assert st is not None
                assert st.packed_objects == 8 + (below > 0)
                assert client.batch_get(list(values)) == list(values.values())
        assert len(list(c.root.glob("*/*.kvs"))) == 1  # the copy made with packing off
        with StoreClient(c.address) as client:
            for key in values:
                client.remove(key)
            core = c.server.core
            wait_for(lambda: (core.tick(), not list(c.root.glob("*/*.kv[sp]")))[1],
                     what="every file deleted")
            st = client.status().shared
            assert st is not None
            assert (st.files, st.used_bytes, st.packs, st.packed_objects) == (0, 0, 0, 0)
    finally:
        c.close()


def _lose_a_reply(monkeypatch: pytest.MonkeyPatch, op: str) -> list[p.Tasks]:
    """The first heartbeat reply handing out an ``op`` task is lost on its way back (the
    master sent it, the node's connection broke): the node registers again, epoch kept."""
    real = MasterConnection.call
    lost: list[p.Tasks] = []

    def call(self: MasterConnection, msg: msgspec.Struct) -> p.Reply:
        reply = real(self, msg)
        if isinstance(msg, p.Heartbeat) and isinstance(reply, p.Tasks) and not lost and any(
                t.op == op for t in reply.tasks):
            lost.append(reply)
            raise StoreUnavailableError("the reply was lost (test)", None)
        return reply

    monkeypatch.setattr(MasterConnection, "call", call)
    return lost


@pytest.mark.parametrize("slow", [False, True], ids=["lost", "still-running"])
def test_a_lost_heartbeat_reply_leaks_no_pack_queue_slot_or_copy_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow: bool) -> None:
    # The master moved a pack task in flight and its reply never reached the node: no
    # report ever comes, so the pack stayed in the table (never landed), the node's queue
    # slot and the objects' entries of copies being written stayed for good (32 such and
    # the node got no write-through copy again). Registering again the node names the
    # tasks it still runs; the master fails the others. A write still running (slow) when
    # the connection breaks is not failed: it lands and is recorded.
    from kvctl.store.sharedtier import writer

    lost = _lose_a_reply(monkeypatch, "pack") if not slow else []
    broke: list[int] = []
    if slow:
        real_write = writer.write_pack
        real_call = MasterConnection.call

        def slow_write(*args: object, **kwargs: object) -> None:
            time.sleep(0.6)  # reported pending, still running when the connection breaks
            real_write(*args, **kwargs)  # type: ignore[arg-type]

        def call(self: MasterConnection, msg: msgspec.Struct) -> p.Reply:
            reply = real_call(self, msg)
            if isinstance(msg, p.Heartbeat) and any(r.pending for r in msg.reports) and (
                    not broke):
                broke.append(1)
                raise StoreUnavailableError("the connection broke (test)", None)
            return reply

        monkeypatch.setattr(writer, "write_pack", slow_write)
        monkeypatch.setattr(MasterConnection, "call", call)
    c = _cluster(tmp_path / "dfs")
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            keys = [f"q{i}" for i in range(5)]
            client.batch_put([(k, os.urandom(8 * KiB)) for k in keys])
            core = c.server.core
            st = core._shared

            def settled() -> bool:
                with core._lock:
                    return not st.writing and all(pk.landed for pk in st.packs.values()) and (
                        all(not n.inflight for n in core._nodes.values()))

            wait_for(settled, what="no pack, queue slot or task left in flight")
            assert lost or broke
            with core._lock:
                assert all(q == (0, 0) for q in st.queued.values())
            tiers = [client.stat(k).tier for k in keys]
            assert tiers == (["dram+shared"] * 5 if slow else ["dram"] * 5)
            client.batch_put([(f"n{i}", os.urandom(8 * KiB)) for i in range(5)])
            _copied(client, [f"n{i}" for i in range(5)])  # the node copies again
    finally:
        c.close()


def test_a_restarted_master_gives_no_pack_the_name_of_an_orphan(tmp_path: Path) -> None:
    # A master killed with packs renamed but not recorded: the next one restarts its ids
    # past those its state names, i.e. at the orphans' (which then failed EEXIST, or
    # before the no-replace write were replaced and purged with the new pack's records).
    c = _cluster(tmp_path / "dfs", state=str(tmp_path / "state"))
    try:
        c.node(64 * MiB)
        with StoreClient(c.address) as client:
            client.put("a", os.urandom(8 * KiB))
            _copied(client, ["a"])
        orphan_id = c.server.core._shared.next_pack + 3  # ids a run ahead of the clock
        data = memoryview(os.urandom(4096))
        for pack_id in (orphan_id, (1 << 64) - 1):  # and a name no id of ours can have
            write_pack(c.root / pack_name(pack_id), [("lost", 1, checksum(data), 0, data)],
                       "00" * 8)
        c.restart_master()
        assert c.server.core._shared.next_pack == orphan_id + 1
        wait_for(lambda: len(core_nodes(c)) == 1, what="the node back")
        with StoreClient(c.address) as client:
            client.put("b", os.urandom(8 * KiB))
            _copied(client, ["b"])
            assert client.status().shared.write_errors == 0
    finally:
        c.close()



def test_batched_gets_racing_pack_deaths_get_exact_bytes_or_a_miss(tmp_path: Path) -> None:
    # Tier-only packed copies (their node gone) read in batches by one client while another
    # takes them out of the tier (remove: the same death of entries as a quota eviction,
    # the last one deleting the pack): each key reads exact or misses, never other bytes.
    c = _cluster(tmp_path / "dfs")
    try:
        node = c.node(64 * MiB)
        values = {f"d{i}": os.urandom(16 * KiB) for i in range(192)}
        with StoreClient(c.address) as client:
            client.batch_put(list(values.items()))
            _copied(client, list(values))
        node.close()
        c.nodes.clear()
        keys = list(values)
        got = misses = 0
        with StoreClient(c.address) as remover, StoreClient(c.address) as reader:
            def remove_all() -> None:
                for key in keys:
                    remover.remove(key)
                    time.sleep(0.002)

            thread = threading.Thread(target=remove_all)
            thread.start()
            for _ in range(400):  # bounded; batches read while packs die under them
                for key, out in zip(keys, reader.batch_get(keys), strict=True):
                    if isinstance(out, bytes):
                        assert out == values[key], key
                        got += 1
                    else:
                        misses += 1
                if not thread.is_alive():
                    break
            thread.join(timeout=30)
            tier_reads = reader.shared.reads
        assert tier_reads == got > 0
        assert misses > 0
        core = c.server.core
        wait_for(lambda: (core.tick(), not packs_on(c.root))[1], what="every pack deleted")
    finally:
        c.close()


def packs_on(root: Path) -> list[Path]:
    return sorted(root.glob("pk/*.kvp"))
