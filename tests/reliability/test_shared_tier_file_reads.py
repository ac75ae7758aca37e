"""Hostile conditions for the client's shared-tier file reads (kvctl.store.sharedtier).

Readers of a file this user does not own: O_NOATIME is refused (EPERM). The first thread
to be refused turned the flag off for everyone; a second thread refused at the same time
then saw the flag already off, took its EPERM for a real one and reported a miss (and the
client reported a good file as bad). Reproduced as a real other user (nobody) against
root's files: 30 misses in 50 rounds of 8 threads before the fix.

A batch racing its client's close() started reading threads nobody stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import kvctl
from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.sharedtier import reader as reader_mod
from kvctl.store.sharedtier.fileformat import file_name, write_object
from kvctl.store.sharedtier.reader import SharedReader

_PROBE = textwrap.dedent("""
    import os, sys, threading
    from kvctl.store.sharedtier import fileformat
    from kvctl.store.sharedtier.fileformat import SharedMissError, read_object
    files = [(p, k, int(c), int(n)) for p, k, c, n in
             (line.split() for line in sys.stdin.read().splitlines())]
    os.setgid(65534)
    os.setuid(65534)
    misses = []
    for _ in range(20):
        fileformat._READ_FLAGS[0] = fileformat._OPEN_FLAGS | os.O_NOATIME  # a new process
        gate = threading.Barrier(len(files))

        def read(f):
            gate.wait(10)
            try:
                read_object(f[0], f[1], 1, f[2], f[3])
            except SharedMissError as exc:
                misses.append(exc.cause)

        threads = [threading.Thread(target=read, args=(f,)) for f in files]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    print(len(misses), misses[:1])
""")


def test_threads_refused_o_noatime_at_once_all_read_the_file(tmp_path: Path) -> None:
    if not getattr(os, "O_NOATIME", 0):
        pytest.skip("no O_NOATIME on this platform")
    if os.geteuid() != 0:
        pytest.skip("needs root to read as another user (nobody)")
    root = Path("/var/tmp") / f"kvctl-hostile-noatime-{os.getpid()}"  # nobody can reach it
    root.mkdir(mode=0o755)
    try:
        lines = []
        for i in range(8):
            data = os.urandom(4096)
            path = root / file_name(f"k{i}", 1)
            write_object(path, f"k{i}", 1, memoryview(data), checksum(data), "ab" * 8)
            path.chmod(0o644)
            path.parent.chmod(0o755)
            lines.append(f"{path} k{i} {checksum(data)} {len(data)}")
        out = subprocess.run([sys.executable, "-c", _PROBE], input="\n".join(lines),
                             capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "PYTHONPATH": str(Path(kvctl.__file__).parents[1])})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == "0", out.stdout
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _live_readers() -> int:
    return sum(t.name.startswith("kvctl-shared-read") for t in threading.enumerate())


def test_a_batch_racing_close_leaves_no_reading_threads(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """StoreClient.close() from one thread while another is in a batched get: the batch's
    next share started a new pool after close() had stopped the old one, and nothing ever
    stopped that one (3 threads leaked per client so closed)."""
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)  # threads for any batch
    values = [os.urandom(2000 + i) for i in range(12)]
    wanted = []
    for i, v in enumerate(values):
        path = tmp_path / file_name(f"k{i}", 1)
        write_object(path, f"k{i}", 1, memoryview(v), checksum(v), "ab" * 8)
        wanted.append((f"k{i}", p.GetSlot(key=f"k{i}", size=len(v), checksum=checksum(v),
                                          version=1, locations=[], shared=str(path)), None))
    before = _live_readers()
    reader = SharedReader(threads=4)
    closed = threading.Event()
    got: list[list[object]] = []

    def batches() -> None:
        for _ in range(10_000):  # until close(), then one more
            last = closed.is_set()
            got.append(list(reader.read_many(wanted)))
            if last:
                return

    worker = threading.Thread(target=batches)
    worker.start()
    time.sleep(0.05)
    reader.close()
    closed.set()
    worker.join(30)
    assert not worker.is_alive()
    assert all(g == values for g in got)
    assert reader._pool is None
    assert _live_readers() == before


def test_a_fork_while_another_thread_holds_the_readers_lock_does_not_hang_the_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's lock is taken for a moment by every get (its counters) and batch (its
    pool); a fork at that moment copied it held, and the child's first get hung."""
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)
    values = [os.urandom(1000 + i) for i in range(4)]
    wanted = []
    for i, v in enumerate(values):
        path = tmp_path / file_name(f"k{i}", 1)
        write_object(path, f"k{i}", 1, memoryview(v), checksum(v), "ab" * 8)
        wanted.append((f"k{i}", p.GetSlot(key=f"k{i}", size=len(v), checksum=checksum(v),
                                          version=1, locations=[], shared=str(path)), None))
    reader = SharedReader(threads=2)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with reader._lock:  # as a get counting its read in another thread
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # exit 0 only if both reads complete within 10 s
            import signal
            signal.alarm(10)
            try:
                ok = reader.read_many(wanted) == values and reader.read(*wanted[0]) == values[0]
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    finally:
        release.set()
        holder.join(10)
        reader.close()


def test_close_in_a_forked_child_does_not_touch_the_parents_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's copy of the parent's pool has no threads, and its shutdown lock may be
    copied held (a submit in another thread at the fork): close() in the child hung."""
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)
    v = os.urandom(1000)
    path = tmp_path / file_name("k", 1)
    write_object(path, "k", 1, memoryview(v), checksum(v), "ab" * 8)
    slot = p.GetSlot(key="k", size=len(v), checksum=checksum(v), version=1, locations=[],
                     shared=str(path))
    reader = SharedReader(threads=2)
    assert reader.read_many([("k", slot, None)] * 4) == [v] * 4  # the pool is started
    pool = reader._pool
    assert pool is not None
    with pool._shutdown_lock:  # as a submit in another thread at the fork
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(10)
            try:
                reader.close()
                os._exit(0 if reader.read_many([("k", slot, None)] * 2) == [v] * 2 else 1)
            except BaseException:
                os._exit(2)
    _, status = os.waitpid(pid, 0)
    reader.close()
    assert os.waitstatus_to_exitcode(status) == 0, status


def test_a_pack_trailer_asking_for_billions_of_offsets_is_no_pack(tmp_path: Path) -> None:
    """A sparse 64 GiB file whose trailer claims 2^32-1 records passed the bounds check
    (they fit in its size) and read_pack_offsets asked for a 32 GiB read."""
    from kvctl.store.sharedtier.fileformat import PACK_MAGIC, PACK_TAIL, read_pack_offsets

    path = tmp_path / "1.kvp"
    with path.open("wb") as fh:
        fh.truncate(64 << 30)
        fh.seek((64 << 30) - PACK_TAIL.size)
        fh.write(PACK_TAIL.pack(PACK_MAGIC, 0xFFFFFFFF))
    started = time.monotonic()
    assert read_pack_offsets(path) is None
    assert time.monotonic() - started < 5
