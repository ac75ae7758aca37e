"""The journal's disk fills during compaction (issue 27 item 10): 5,000 keys overwritten
to 45,000 records, the disk filled to leave room for records but not a snapshot, 2,500
more overwrites, the filler removed. A snapshot that does not fit is abandoned before it
takes the space the journal's appends need (before: it wrote until ENOSPC, the appends
failed and every put was refused), is tried again once a second (not at every tick, each
try a new segment), and completes by itself once space returns; no key ever reads back
an older version than its last acknowledged one, while serving or after a restart."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.store.state import JournalState
from tests.reliability.conftest import decode_value, make_value, wait_for

pytestmark = pytest.mark.integration

KEYS = 5000
ROUNDS = 9
BATCH = 500


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A real 12 MiB tmpfs."""
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m,nr_inodes=256", "tmpfs",
                        str(mount)], capture_output=True, check=False, timeout=10)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root/CAP_SYS_ADMIN): "
                    f"{r.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False,
                       timeout=10)


def test_compaction_on_a_disk_without_room_for_a_snapshot(disk: Path) -> None:
    state_dir = disk / "master"
    journal = JournalState(state_dir, compact_min_records=46_000)
    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=30), state=journal))
    node = StorageNode(server.address, node_id="a", capacity_bytes=256 << 20,
                       heartbeat_s=0.1)
    keys = [f"key-{i:05d}-{'p' * 20}" for i in range(KEYS)]
    acked: dict[str, int] = {}
    refused: list[str] = []

    def put_round(version: int, some: list[str]) -> None:
        for j in range(0, len(some), BATCH):
            items = [(k, make_value(k, version, 64)) for k in some[j:j + BATCH]]
            for (key, _), error in zip(items, client.batch_put(items), strict=True):
                if error is None:
                    acked[key] = version
                else:
                    refused.append(error.cause)

    def assert_none_stale() -> None:
        got = client.batch_get(keys)
        stale = [(k, decode_value(k, g), acked[k]) for k, g in zip(keys, got, strict=True)
                 if not isinstance(g, bytes) or decode_value(k, g) != acked[k]]
        assert not stale, f"{len(stale)} keys read back another version: {stale[:3]}"

    try:
        with StoreClient(server.address, timeout_s=10) as client:
            for version in range(1, ROUNDS + 1):
                put_round(version, keys)
            assert not refused
            record = sum(f.stat().st_size for f in state_dir.iterdir()) // (KEYS * ROUNDS)
            st = os.statvfs(disk)
            ballast = disk / "ballast"
            with ballast.open("wb") as f:  # room for the records below, not a snapshot
                # 3,100 records to come and the snapshot's reserve; a snapshot of 5,000
                f.write(bytes(st.f_bavail * st.f_frsize - 3_100 * record - (300 << 10)))
            put_round(ROUNDS + 1, keys[:KEYS // 2])  # past compact_min: snapshots tried
            for version in range(ROUNDS + 2, ROUNDS + 32):  # snapshots tried meanwhile
                put_round(version, keys[:20])
                time.sleep(0.1)
            assert not refused, f"{len(refused)} puts refused: {refused[0]}"
            assert journal.refusal() is None
            assert not (state_dir / "snapshot-00000002.msgpack").exists()
            segments = len(list(state_dir.glob("journal-*.log")))
            assert segments < 10, f"{segments} journal segments from failed snapshots"
            assert_none_stale()
            ballast.unlink()
            wait_for(lambda: any(state_dir.glob("snapshot-*.msgpack")), timeout_s=15,
                     what="the snapshot once space returned")
            put_round(ROUNDS + 3, keys)
            assert not refused, f"{len(refused)} puts refused: {refused[0]}"
            assert_none_stale()
    finally:
        node.close()
        server.close()
    restarted = MasterCore(state=JournalState(state_dir))
    try:
        for key in keys[::50]:
            info = restarted.stat(key)
            assert isinstance(info, p.ObjectInfo), info
            assert info.checksum == checksum(make_value(key, acked[key], 64)), key
    finally:
        restarted.close()
