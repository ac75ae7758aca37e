"""The journal state: segments and snapshots written from the live view, no second copy,
and a refused write fails acknowledgements and stops puts instead of losing them."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

import kvctl.store.state.journal as journal
from kvctl.store import protocol as p
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.server import MasterServer
from kvctl.store.state import JournalState
from tests.store.conftest import wait_for
from tests.store.test_master import Clock, assert_no_overlap, node, put


def contents(core: MasterCore) -> dict[str, tuple[int, int]]:
    """key -> (size, checksum) of every object, read through the public API."""
    out = {}
    for info in core.list_objects("", 1 << 30)[0]:
        out[info.key] = (info.size, info.checksum)
    return out


def test_snapshot_from_the_live_view_while_changes_go_on(tmp_path: Path) -> None:
    """A snapshot is taken a slice of keys at a time while puts, overwrites and removes go
    on between slices; replaying it and the journal segment begun with it gives exactly
    the state at the end (a fuzzy checkpoint), and older files are deleted."""
    clock = Clock()
    state = JournalState(tmp_path / "s", compact_min_records=100)
    core = MasterCore(MasterConfig(slice_objects=50, node_timeout_s=1e6), state=state,
                      clock=clock)
    node(core, "a", 1 << 26)
    for rnd in range(3):  # three records per key: the journal outgrows the live state
        for i in range(600):
            put(core, f"k{i:04d}", 100 + i, checksum=i + 1000 * rnd)
    assert state.snapshot_wanted(len(core.list_objects("", 1 << 30)[0]))
    # Drive the snapshot job by hand, changing keys on both sides of its cursor between
    # slices.
    core.tick(budget_s=0.0)
    assert core._snapshot is not None
    step = 0
    while core._snapshot is not None:
        step += 1
        put(core, f"k{(step * 37) % 600:04d}", 7000 + step, checksum=100_000 + step)
        core.remove([f"k{(step * 53 + 11) % 600:04d}"])
        put(core, f"new{step}", 50, checksum=step)
        core.tick(budget_s=0.0)
    expected = contents(core)
    core.close()
    names = sorted(f.name for f in (tmp_path / "s").iterdir())
    assert len([n for n in names if n.startswith("snapshot-")]) == 1, names
    restarted = MasterCore(state=JournalState(tmp_path / "s"), clock=clock)
    assert contents(restarted) == expected
    node(restarted, "a", 1 << 26)
    assert_no_overlap(restarted)
    restarted.close()


def test_no_second_copy_of_the_state_in_memory(tmp_path: Path) -> None:
    state = JournalState(tmp_path / "s")
    core = MasterCore(state=state, clock=Clock())
    node(core, "a", 1 << 26)
    for i in range(2000):
        put(core, f"k{i}", 100)
    state.sync()
    sizes = {name: len(v) for name, v in vars(state).items() if hasattr(v, "__len__")
             and not isinstance(v, str | bytes | bytearray | Path)}
    assert all(n < 100 for n in sizes.values()), sizes
    assert state.backlog == 0
    core.close()


def test_files_are_private(tmp_path: Path) -> None:
    state = JournalState(tmp_path / "s")
    core = MasterCore(state=state, clock=Clock())
    node(core, "a")
    put(core, "k", 10)
    core.close()
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    for f in (tmp_path / "s").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_older_state_files_are_read(tmp_path: Path) -> None:
    """``snapshot.msgpack`` + ``journal.log`` of the previous kvctl are replayed first."""
    import msgspec

    from kvctl.store.state import LoadedState, NodeRecord, ObjectRecord, ReplicaRecord

    d = tmp_path / "s"
    d.mkdir()
    node_rec = NodeRecord("a", "E", "seg", "127.0.0.1:1", "h", 1 << 20, 0, "off")
    old = ObjectRecord("old", 100, 1, 3, [ReplicaRecord("a", 0, 100)], [])
    (d / "snapshot.msgpack").write_bytes(msgspec.msgpack.encode(LoadedState([old], [node_rec])))
    newer = msgspec.msgpack.encode(ObjectRecord("later", 10, 2, 4, [ReplicaRecord("a", 128, 10)],
                                                []))
    (d / "journal.log").write_bytes(len(newer).to_bytes(4, "little") + newer)
    core = MasterCore(state=JournalState(d), clock=Clock())
    assert core.exists(["old", "later"]) == [True, True]
    core.close()


def test_a_refused_write_fails_acks_and_stops_puts_until_a_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses a journal write: the requests whose changes it carried are not
    acknowledged (their commit with ``ack`` fails), new puts are refused with the cause,
    the master keeps serving reads; once the disk takes writes again a snapshot of the
    live state is written, puts resume, and after a restart every acknowledged object is
    there (the old journal stayed closed: 999 of 6,000 acknowledged keys were lost)."""
    state = JournalState(tmp_path / "s")
    core = MasterCore(MasterConfig(node_timeout_s=1e6), state=state)
    server = MasterServer(core)
    full = {"on": False}
    real = journal._write_all

    def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(journal, "_write_all", write_all)
    from kvctl.store.rpc import MasterConnection

    conn = MasterConnection(server.address)
    try:
        assert isinstance(conn.call(p.RegisterNode(
            node_id="a", epoch="E", segment="seg", endpoint="127.0.0.1:1", host_id="h",
            capacity_bytes=1 << 26)), p.Ok)

        def put_acked(key: str) -> p.Reply:
            reply = conn.call(p.Put(items=[p.PutItem(key, 100, 1)]))
            assert isinstance(reply, p.PutReply), reply
            slot = reply.slots[0]
            if isinstance(slot, p.ErrorInfo):
                return p.Fail(error=slot)
            return conn.call(p.Commit(keys=[key], versions=[slot.version], ack=True))

        acked = [k for k in (f"before{i}" for i in range(20))
                 if isinstance(put_acked(k), p.Ok)]
        assert len(acked) == 20
        full["on"] = True
        failed = put_acked("during")
        assert isinstance(failed, p.Fail), failed
        assert failed.error.code == "unavailable"
        assert "No space left" in failed.error.cause
        refused = put_acked("refused")
        assert isinstance(refused, p.Fail)
        assert "takes no writes" in refused.error.cause
        assert conn.call(p.Exists(keys=acked[:3])) == p.Bools(values=[True] * 3)
        full["on"] = False
        wait_for(lambda: state.refusal() is None, what="a snapshot after the disk recovered")
        after = put_acked("after")
        assert isinstance(after, p.Ok), after
        acked.append("after")
    finally:
        conn.close()
        server.close()
    restarted = MasterCore(state=JournalState(tmp_path / "s"))
    assert restarted.exists(acked) == [True] * len(acked)
    restarted.close()
