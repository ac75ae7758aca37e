"""Shared tier reads: the client's one-preadv read of a single-object file rejects every
mismatch, and a batched get that mixes DRAM objects, tier-only objects, bad files and
missing keys answers each correctly, whether its files are read on one thread or several."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.sharedtier import fileformat
from kvctl.store.sharedtier import reader as reader_mod
from kvctl.store.sharedtier.fileformat import (
    HEADER,
    SharedMissError,
    file_name,
    read_object,
    write_object,
)
from kvctl.store.sharedtier.reader import SharedReader
from tests.store.conftest import wait_for
from tests.store.test_shared_tier import SharedCluster

KEY = "team/blk-\u00e9"  # a non-ASCII key: its header length is in bytes
VERSION = 0x1234


def _file(tmp_path: Path, data: bytes, key: str = KEY, version: int = VERSION) -> Path:
    path = tmp_path / file_name(key, version)
    tmp_path.mkdir(parents=True, exist_ok=True)  # a write never makes the tier's root
    write_object(path, key, version, memoryview(data), checksum(data), "ab" * 8)
    return path


def _read(path: Path, data: bytes, *, into: bool, key: str = KEY, version: int = VERSION,
          csum: int | None = None, size: int | None = None) -> bytes:
    """``read_object`` as bytes, or into a buffer of exactly ``size`` bytes."""
    csum = checksum(data) if csum is None else csum
    size = len(data) if size is None else size
    if not into:
        got = read_object(path, key, version, csum, size)
        assert got is not None
        return got
    buf = bytearray(size)
    assert read_object(path, key, version, csum, size, memoryview(buf)) is None
    return bytes(buf)


@pytest.mark.parametrize("into", [False, True], ids=["bytes", "into"])
def test_single_read_returns_the_object_and_rejects_every_mismatch(tmp_path: Path,
                                                                   into: bool) -> None:
    data = os.urandom(65536 + 17)
    path = _file(tmp_path, data)
    assert _read(path, data, into=into) == data
    good = path.read_bytes()
    hsize = HEADER.size + len(KEY.encode())

    def miss(raw: bytes | None = None, match: str = "", **kw: Any) -> None:
        if raw is not None:
            path.write_bytes(raw)
        with pytest.raises(SharedMissError, match=match):
            _read(path, data, into=into, **kw)
        path.write_bytes(good)

    def patched(offset: int, fmt: str, value: int | bytes) -> bytes:
        raw = bytearray(good)
        struct.pack_into(fmt, raw, offset, value)
        return bytes(raw)

    miss(patched(0, "<4s", b"KVSX"), "another object")  # magic
    miss(patched(4, "<B", fileformat.FORMAT + 1), "another object")  # a later format
    miss(patched(6, "<H", len(KEY.encode()) - 1), "another object")  # key length
    miss(patched(8, "<Q", len(data) + 1), "another object")  # size in the header
    miss(patched(16, "<Q", checksum(data) ^ 1), "another object")  # checksum in the header
    miss(patched(24, "<Q", VERSION + 1), "another object")  # version in the header
    raw = bytearray(good)
    raw[HEADER.size] ^= 0x01  # the key's first byte
    miss(bytes(raw), "another object")
    raw = bytearray(good)
    raw[hsize + 4000] ^= 0x40  # one bit of the object
    miss(bytes(raw), "checksum")
    miss(good[:-1], "truncated")
    miss(good[:hsize - 3], "truncated")  # not even a whole header
    miss(b"", "truncated")
    miss(good + b"\0", "longer")
    # What the index names differs from a good file
    miss(version=VERSION + 1, match="another object")
    miss(key=KEY + "x", match="truncated")  # another key (a byte longer) at this name
    miss(key=KEY[:-1] + "\u00e8", match="another object")  # another key, as many bytes
    miss(csum=checksum(data) ^ 1, match="another object")
    miss(size=len(data) - 1, match="longer")
    miss(size=len(data) + 1, match="truncated")
    assert _read(path, data, into=into) == data  # the good file still reads
    # Writer epochs are not checked: any writer's file of this object is the object
    assert _read(_file(tmp_path, data), data, into=into) == data


@pytest.mark.parametrize("into", [False, True], ids=["bytes", "into"])
def test_what_is_not_a_regular_file_is_a_miss_that_does_not_hang(tmp_path: Path,
                                                                 into: bool) -> None:
    data = os.urandom(4096)
    path = tmp_path / file_name(KEY, VERSION)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # no writer: an open without O_NONBLOCK would block
    with pytest.raises(SharedMissError, match="cannot be read: ESPIPE"):
        _read(path, data, into=into)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer with bytes waiting
    try:
        os.write(fd, _file(tmp_path / "src", data).read_bytes())
        with pytest.raises(SharedMissError, match="ESPIPE"):
            _read(path, data, into=into)
    finally:
        os.close(fd)
    path.unlink()
    path.mkdir()
    with pytest.raises(SharedMissError, match="EISDIR"):
        _read(path, data, into=into)
    path.rmdir()
    secret = _file(tmp_path / "elsewhere", data)
    path.symlink_to(secret)  # a valid file, reached only through a link
    with pytest.raises(SharedMissError, match="opened: ELOOP"):
        _read(path, data, into=into)
    path.unlink()
    try:
        os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    except OSError as exc:
        pytest.skip(f"no device node here ({errno.errorcode.get(exc.errno or 0)})")
    with pytest.raises(SharedMissError):
        _read(path, data, into=into)


def test_without_the_right_to_skip_atime_it_reads_anyway(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """O_NOATIME on a file this user does not own is EPERM: the read goes on without it
    (and later reads do not ask again)."""
    if not getattr(os, "O_NOATIME", 0):
        pytest.skip("no O_NOATIME on this platform")
    data = os.urandom(1000)
    path = _file(tmp_path, data)
    real_open = os.open
    flags_seen: list[int] = []

    def fake_open(p_: Any, flags: int, *a: Any) -> int:
        flags_seen.append(flags)
        if flags & os.O_NOATIME:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_open(p_, flags, *a)

    monkeypatch.setattr(fileformat, "_READ_FLAGS", [fileformat._READ_FLAGS[0] | os.O_NOATIME])
    monkeypatch.setattr(fileformat.os, "open", fake_open)
    assert _read(path, data, into=False) == data
    assert _read(path, data, into=True) == data
    assert [bool(f & os.O_NOATIME) for f in flags_seen] == [True, False, False]
    assert all(f & os.O_NOFOLLOW and f & os.O_NONBLOCK for f in flags_seen)


def _slot(path: Path, key: str, data: bytes, version: int = VERSION) -> p.GetSlot:
    return p.GetSlot(key=key, size=len(data), checksum=checksum(data), version=version,
                     locations=[], shared=str(path))


@pytest.mark.parametrize("threads", [1, 4])
def test_read_many_keeps_order_counts_and_reads_on_threads(tmp_path: Path, threads: int,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    values = [os.urandom(1000 + 37 * i) for i in range(20)]
    slots = [_slot(_file(tmp_path, v, f"k{i}"), f"k{i}", v) for i, v in enumerate(values)]
    Path(slots[5].shared).unlink()
    raw = bytearray(Path(slots[11].shared).read_bytes())
    raw[-1] ^= 0x01
    Path(slots[11].shared).write_bytes(raw)
    reader = SharedReader(threads=threads)
    seen: set[str] = set()
    real = reader._read

    def spy(*a: Any) -> Any:
        seen.add(threading.current_thread().name)
        return real(*a)

    reader._read = spy  # type: ignore[method-assign]
    bufs = [bytearray(len(v) + 5) for v in values]
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)  # any batch is worth threads
    try:
        for dests in (None, [memoryview(b) for b in bufs]):
            got = reader.read_many([(f"k{i}", s, dests[i] if dests else None)
                                    for i, s in enumerate(slots)])
            for i, (g, v) in enumerate(zip(got, values, strict=True)):
                if i in (5, 11):
                    assert isinstance(g, ObjectNotFoundError)
                    assert g.evicted
                    assert f"'k{i}'" in g.cause  # named as the caller did
                elif dests is None:
                    assert g == v
                else:
                    assert g == len(v)
                    assert bufs[i][:len(v)] == v
        assert (reader.reads, reader.misses) == (36, 4)
        assert (len(seen) > 1) == (threads > 1)  # the caller's thread and the pool's
        # Files that read in microseconds are not worth waking a thread for: read here
        monkeypatch.undo()
        seen.clear()
        reader.read_many([(f"k{i}", s, None) for i, s in enumerate(slots)])
        assert seen == {threading.current_thread().name}
        # Files that take long (a network file system) are, a few at a time already
        reader._unit_s = reader_mod.MIN_SHARE_S
        seen.clear()
        reader.read_many([(f"k{i}", slots[i], None) for i in (0, 1, 2, 3)])
        assert (len(seen) > 1) == (threads > 1)
    finally:
        reader.close()
    assert reader.read_many([]) == []


@pytest.mark.parametrize("threads", [1, 4])
def test_batched_get_mixes_dram_shared_bad_and_missing(tmp_path: Path, threads: int,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)  # threads for any batch
    c = SharedCluster(tmp_path / "dfs", policy="write-through")
    try:
        first = c.node(16 << 20)
        with StoreClient(c.address) as client:
            client.shared.threads = threads
            tier = {f"t{i}": os.urandom((16 << 10) + 101 * i) for i in range(12)}
            assert client.batch_put(list(tier.items())) == [None] * len(tier)
            wait_for(lambda: all("shared" in client.stat(k).tier for k in tier),
                     what="write-through copies")
            client.drop_node(first.node_id)  # its DRAM goes: only the files hold these
            assert {client.stat(k).tier for k in tier} == {"shared"}
            c.node(16 << 20)
            dram = {f"d{i}": os.urandom(4096 + i) for i in range(4)}
            client.batch_put(list(dram.items()))
            root = c.root
            flip = root / file_name("t3", client.stat("t3").version)
            raw = bytearray(flip.read_bytes())
            raw[-100] ^= 0x08
            flip.write_bytes(raw)
            torn = root / file_name("t7", client.stat("t7").version)
            torn.write_bytes(torn.read_bytes()[:-1])
            # An overwrite names a new version: the get reads it, never the old file
            tier["t9"] = os.urandom(5000)
            client.put("t9", tier["t9"])
            keys = ["d0", "t0", "nope", "t3", "d1", "t1", "t2", "t7", "d2", "t4", "t5",
                    "t6", "t8", "t9", "t10", "d3", "t11", "nope2"]
            want = {**tier, **dram}
            bad = {"t3", "t7"}
            got = client.batch_get(keys)
            for key, g in zip(keys, got, strict=True):
                if key.startswith("nope"):
                    assert isinstance(g, ObjectNotFoundError)
                    assert not g.evicted
                elif key in bad:
                    assert isinstance(g, ObjectNotFoundError), key
                    assert g.evicted
                else:
                    assert g == want[key], key
            misses, reads = client.shared.misses, client.shared.reads
            assert misses == 2
            bufs = [bytearray(len(want.get(k, b"")) + 64) for k in keys]
            sizes = client.batch_get_into(keys, bufs)
            for key, n, buf in zip(keys, sizes, bufs, strict=True):
                if key.startswith("nope") or key in bad:
                    assert isinstance(n, ObjectNotFoundError), key
                else:
                    assert n == len(want[key])
                    assert buf[:n] == want[key], key
            # (a bad file reported by the first batch may already be out of the index:
            # a miss without a read)
            assert misses <= client.shared.misses <= 2 * misses
            assert client.shared.reads == 2 * reads
    finally:
        c.close()


def test_read_many_after_close_or_fork_reads_every_share(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A batch racing close() (its pool shut down under it) reads the shares itself, and a
    forked child, whose copy of the pool has no threads, starts its own instead of
    queueing shares nobody runs."""
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)
    values = [os.urandom(2000 + i) for i in range(12)]
    wanted = [(f"k{i}", _slot(_file(tmp_path, v, f"k{i}"), f"k{i}", v), None)
              for i, v in enumerate(values)]
    reader = SharedReader(threads=3)
    try:
        assert reader.read_many(wanted) == values  # the pool is started
        pool = reader._pool
        assert pool is not None
        pool.shutdown(wait=True)  # as close() from another thread, mid-batch
        assert reader.read_many(wanted) == values
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the batch completes, within 20 s
            import signal
            signal.alarm(20)
            try:
                os._exit(0 if reader.read_many(wanted) == values else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        reader.close()
        assert reader.read_many(wanted) == values  # on this thread: no pool after close
        assert reader._pool is None
    finally:
        reader.close()


def test_a_batch_that_fails_returns_only_after_its_threads_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in the caller's share (not a miss: MemoryError, KeyboardInterrupt) goes up
    only once no reading thread can still write into the caller's buffers."""
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)
    values = [os.urandom(3000) for _ in range(8)]
    wanted = [(f"k{i}", _slot(_file(tmp_path, v, f"k{i}"), f"k{i}", v),
               memoryview(bytearray(3000))) for i, v in enumerate(values)]
    real = reader_mod.read_object
    done: list[str] = []

    def slow(path: Any, key: str, *a: Any) -> Any:
        if key == "k0":  # the caller's share (the first half) fails at once
            raise MemoryError("no room")
        time.sleep(0.05)
        got = real(path, key, *a)
        done.append(key)
        return got

    monkeypatch.setattr(reader_mod, "read_object", slow)
    reader = SharedReader(threads=2)
    try:
        with pytest.raises(MemoryError):
            reader.read_many(wanted)
        assert sorted(done) == ["k4", "k5", "k6", "k7"]  # the thread's share, all of it
    finally:
        reader.close()
