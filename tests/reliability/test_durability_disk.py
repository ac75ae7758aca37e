"""The master's journal on a full disk (a small real tmpfs): every put that got OK is
readable while serving and after SIGKILL + restart; a put that cannot be journaled gets a
clear error (never no answer); a snapshot (compaction) on a full disk leaves the journal
working once space returns; restarting with the disk full serves what it has, or exits
with ``Error:`` and ``Hint:``.

The disk is filled with a ballast file, so the test decides when space returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.store.state import JournalState
from tests.reliability.conftest import (
    ROOT,
    StoreCluster,
    decode_value,
    make_value,
    wait_for,
)

pytestmark = pytest.mark.integration

#: Keys this long make each journal record about 1 KiB: the disk fills in a few dozen puts.
PAD = "x" * 1000


def _mount(path: Path, options: str) -> None:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                       capture_output=True, check=False, timeout=10)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root/CAP_SYS_ADMIN): "
                    f"{r.stderr.decode(errors='replace').strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB file system with 64 inodes."""
    mount = tmp_path / "disk"
    _mount(mount, "size=2m,nr_inodes=64")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False,
                       timeout=10)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Take all but ``leave_bytes`` of ``disk`` with a ballast file (deleted to free it)."""
    st = os.statvfs(disk)
    ballast = disk / "ballast"
    with ballast.open("wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave_bytes)))
    return ballast


def put_until_refused(client: StoreClient, prefix: str, *, count: int
                      ) -> tuple[list[str], list[KvctlError]]:
    """Put ``count`` keys; the ones acknowledged and the errors of the others. Each put
    must answer (OK or an error) within 15 s."""
    acked: list[str] = []
    failed: list[KvctlError] = []
    for i in range(count):
        key = f"{prefix}{i}-{PAD}"
        started = time.monotonic()
        try:
            client.put(key, make_value(key, 1, 4096))
            acked.append(key)
        except KvctlError as exc:
            failed.append(exc)
        assert time.monotonic() - started < 15, "a put got no answer"
    return acked, failed


def assert_clear(errors: list[KvctlError]) -> None:
    """Each refused put says the journal cannot take it (not a timeout: an answer)."""
    for exc in errors:
        assert isinstance(exc, StoreUnavailableError), exc
        assert "No space left on device" in exc.cause or "takes no writes" in exc.cause, \
            exc.cause
        assert "did not answer" not in exc.cause


def assert_readable(client: StoreClient, keys: list[str]) -> None:
    got = client.batch_get(keys)
    bad = [(k[:12], g) for k, g in zip(keys, got, strict=True) if not isinstance(g, bytes)]
    assert not bad, f"{len(bad)} of {len(keys)} acknowledged puts unreadable: {bad[:3]}"
    assert [decode_value(k, g) for k, g in zip(keys, got, strict=True)] == [1] * len(keys)


def test_full_journal_disk_loses_no_acknowledged_put_across_sigkill(
        store_cluster: Callable[..., StoreCluster], small_disk: Path) -> None:
    """Puts into a master whose journal disk fills up: some are acknowledged, the rest
    get a clear error; the acknowledged ones read back exactly while it serves, after a
    SIGKILL + restart on the still-full disk (it starts, serves reads and refuses puts
    with the cause), and after space returns (puts work again). Before: 39 of 80
    acknowledged puts were lost, some puts had no answer, and the restart exited 4."""
    state = small_disk / "master"
    cluster = store_cluster()
    cluster.start_master(state=str(state))
    cluster.start_nodes("a")
    with StoreClient(cluster.address, timeout_s=10) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        ballast = fill(small_disk, 96 << 10)
        acked, failed = put_until_refused(client, "k", count=160)
        assert 20 <= len(acked) < 160, (len(acked), len(failed))
        assert_clear(failed)
        print(f"\nfull journal disk: {len(acked)} of 160 puts acknowledged, "
              f"{len(failed)} refused with the cause")
        assert_readable(client, acked)

        cluster.restart_master()  # SIGKILL, then the same state on the full disk
        wait_for(lambda: [n.state for n in client.status().nodes] == ["alive"],
                 timeout_s=15, what="node re-registered")
        assert_readable(client, acked)
        more, refused = put_until_refused(client, "r", count=5)
        assert not more
        assert_clear(refused)

        ballast.unlink()  # space returns: writes resume, without a restart

        def writable() -> bool:
            try:
                client.put("after", make_value("after", 1, 4096))
            except StoreUnavailableError:
                return False
            return True

        wait_for(writable, timeout_s=15, what="puts accepted once space returned")
        later, failed = put_until_refused(client, "later", count=20)
        assert len(later) == 20, failed[:2]
        cluster.restart_master()
        wait_for(lambda: [n.state for n in client.status().nodes] == ["alive"],
                 timeout_s=15, what="node re-registered")
        assert_readable(client, [*acked, *later, "after"])


def test_restart_without_room_for_a_journal_file_says_why(small_disk: Path) -> None:
    """Restarting a master whose state disk cannot take even a new (empty) journal file:
    exit 2 with ``Error:`` naming the file and the errno and a ``Hint:`` about space (before:
    exit 4, "unexpected OSError ... a bug in kvctl")."""
    state = small_disk / "master"
    JournalState(state).close()
    filler = small_disk / "inodes"
    filler.mkdir()
    for i in range(200):  # use up every inode
        try:
            (filler / str(i)).touch()
        except OSError:
            break
    proc = subprocess.run(
        [sys.executable, "-m", "kvctl", "store", "master", "--listen", "127.0.0.1:0",
         "--state", str(state)], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Error: cannot write master journal" in proc.stderr
    assert "No space left on device" in proc.stderr
    assert "Hint: free space on that disk" in proc.stderr
    assert "a bug" not in proc.stderr


def test_a_snapshot_on_a_full_disk_leaves_the_journal_working(small_disk: Path) -> None:
    """Compaction (a snapshot) runs while the disk is full and fails: the journal refuses
    puts with the cause meanwhile, is not left closed (before: "write to closed file" for
    good once space returned, 999 of 6,000 acknowledged keys lost and 1,499 older
    versions), and once space returns takes writes again; every key holds its last
    acknowledged version (or a later one that was tried), while serving and after a
    restart from the journal."""
    state = small_disk / "master"
    journal = JournalState(state, compact_min_records=150)
    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=30), state=journal))
    node = StorageNode(server.address, node_id="a", capacity_bytes=32 << 20, heartbeat_s=0.1)
    keys = [f"c{i}-{PAD[:200]}" for i in range(20)]
    acked: dict[str, int] = {}
    tried: dict[str, set[int]] = {k: set() for k in keys}

    def round_of_puts(version: int) -> int:
        refused = 0
        for key in keys:
            tried[key].add(version)
            try:
                client.put(key, make_value(key, version, 2048))
                acked[key] = version
            except StoreUnavailableError as exc:
                assert_clear([exc])
                refused += 1
        return refused

    try:
        with StoreClient(server.address, timeout_s=10) as client:
            for version in range(1, 6):  # past compact_min_records: snapshots run
                assert round_of_puts(version) == 0
            ballast = fill(small_disk, 16 << 10)
            version, refused = 6, 0
            full_until = time.monotonic() + 3  # the journal retries a snapshot every second
            while time.monotonic() < full_until:
                refused += round_of_puts(version)
                version += 1
            assert refused, "the disk never filled"
            print(f"\nsnapshot on a full disk: {refused} puts refused over "
                  f"{version - 6} rounds of {len(keys)} keys")
            assert journal.refusal() is not None
            for key in keys:
                got = decode_value(key, client.get(key))
                assert got >= acked[key], (key, got, acked[key])
                assert got in tried[key], (key, got, tried[key])
            ballast.unlink()
            wait_for(lambda: journal.refusal() is None, timeout_s=15,
                     what="the journal taking writes again")
            for v in range(version, version + 5):
                assert round_of_puts(v) == 0
            for key in keys:
                assert decode_value(key, client.get(key)) == acked[key]
    finally:
        node.close()
        server.close()
    restarted = MasterCore(state=JournalState(state))
    try:
        for key in keys:
            info = restarted.stat(key)
            assert isinstance(info, p.ObjectInfo), info
            assert info.checksum == checksum(make_value(key, acked[key], 2048)), key
    finally:
        restarted.close()
