"""The engine API end to end, target and initiator engines in one process (memory://)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.transfer import (
    BusyError,
    OpCode,
    OutOfRangeError,
    SegmentNotFoundError,
    TransferEngine,
    TransferFailedError,
    TransferRequest,
    TransferState,
    TransferTimeoutError,
    TransportUnavailableError,
)
from kvctl.transfer.admin import segment_key
from kvctl.transfer.segments import SegmentInfo
from tests.fixtures.threads import run_threads
from tests.transfer._helpers import memory_url, pattern

BLOCK = 16 * 1024
SIZE = 64 * BLOCK


@pytest.fixture
def url() -> str:
    return memory_url()


@pytest.fixture
def target(url: str) -> Iterator[TransferEngine]:
    with TransferEngine("target", url) as engine:
        engine.register_segment("remote", SIZE)
        yield engine


def _initiator(url: str, transport: str, **kw: object) -> TransferEngine:
    engine = TransferEngine(f"init-{transport}", url, transport=transport, **kw)  # type: ignore[arg-type]
    engine.register_segment("local", SIZE)
    return engine


def _fill(view: memoryview, run: int, blocks: int = SIZE // BLOCK) -> None:
    for i in range(blocks):
        view[i * BLOCK : (i + 1) * BLOCK] = pattern(run, i, i * BLOCK, BLOCK)


def _check(view: memoryview, run: int, blocks: int = SIZE // BLOCK) -> None:
    for i in range(blocks):
        assert bytes(view[i * BLOCK : (i + 1) * BLOCK]) == pattern(run, i, i * BLOCK, BLOCK), i


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_write_then_read_back_is_intact(target: TransferEngine, url: str, transport: str) -> None:
    with _initiator(url, transport, slice_bytes=8 * 1024, connections_per_peer=3) as engine:
        local = engine.local_view("local")
        _fill(local, run=1)
        batch = engine.allocate_batch(64)
        engine.submit(batch, [TransferRequest(OpCode.WRITE, "local", i * BLOCK, "remote",
                                              i * BLOCK, BLOCK) for i in range(64)])
        result = engine.wait(batch, 10)
        assert result.ok
        assert result.bytes_moved == SIZE
        statuses = engine.status(batch)
        assert {s.transport for s in statuses} == {transport}
        assert all(s.state is TransferState.COMPLETED and s.path for s in statuses)
        if transport == "tcp":  # 16 KiB requests were sliced in two and spread over paths
            assert len({p for s in statuses for p in s.path.split(",")}) > 1
        engine.free_batch(batch)
        _check(target.local_view("remote"), run=1)

        local[:] = bytes(SIZE)
        engine.transfer([TransferRequest(OpCode.READ, "local", i * BLOCK, "remote", i * BLOCK,
                                         BLOCK) for i in range(64)], timeout_s=10)
        _check(local, run=1)


def test_auto_picks_shm_on_same_host_and_says_so(target: TransferEngine, url: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "kvctl.transfer"), _initiator(url, "auto") as engine:
        handle = engine.open_segment("remote")
        assert handle.transport == "shm"
        assert handle.same_host
        assert handle.size_bytes == SIZE
    assert "segment remote: transport shm (same host)" in caplog.text


def test_auto_uses_tcp_for_another_host(target: TransferEngine, url: str) -> None:
    info = target.lookup("remote")
    foreign = SegmentInfo(**{**info.__dict__, "name": "faraway", "host": "other-host/boot"})
    target.metadata.put(segment_key("", "faraway"), foreign.to_json())
    with _initiator(url, "auto") as engine:
        assert engine.open_segment("faraway").transport == "tcp"
        engine.local_view("local")[:10] = b"0123456789"
        engine.transfer([TransferRequest(OpCode.WRITE, "local", 0, "faraway", 0, 10)])
        assert bytes(target.local_view("remote")[:10]) == b"0123456789"
    with _initiator(url, "shm") as engine, pytest.raises(TransportUnavailableError,
                                                          match="another host"):
        engine.open_segment("faraway")


def test_file_segments_on_both_sides(url: str, tmp_path: Path) -> None:
    with TransferEngine("ft", url) as tgt:
        tgt.register_segment("disk", SIZE, kind="file", path=tmp_path / "t.bin")
        for transport in ("shm", "tcp"):
            with TransferEngine(f"fi-{transport}", url, transport=transport) as ini:
                ini.register_segment("ldisk", SIZE, kind="file", path=tmp_path / f"{transport}.bin")
                ini.register_segment("mem", SIZE)
                _fill(ini.local_view("mem"), run=3)
                ini.transfer([TransferRequest(OpCode.WRITE, "mem", 0, "disk", 0, SIZE)])
                assert (tmp_path / "t.bin").read_bytes()[:BLOCK] == pattern(3, 0, 0, BLOCK)
                ini.transfer([TransferRequest(OpCode.READ, "ldisk", BLOCK, "disk", BLOCK,
                                              4 * BLOCK)])
                got = (tmp_path / f"{transport}.bin").read_bytes()[BLOCK : 2 * BLOCK]
                assert got == pattern(3, 1, BLOCK, BLOCK)


def test_notification_reaches_the_target_after_the_data(target: TransferEngine, url: str) -> None:
    with _initiator(url, "tcp") as engine:
        engine.local_view("local")[:5] = b"kv-42"
        batch = engine.allocate_batch(1)
        engine.submit(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, 5)],
                      notify=b"prefill done: req 42")
        assert engine.wait(batch, 10).ok
        note = target.get_notification(5)
        assert (note.sender, note.message) == ("init-tcp", b"prefill done: req 42")
        assert bytes(target.local_view("remote")[:5]) == b"kv-42"
        engine.notify("remote", b"direct")
        assert target.get_notification(5).message == b"direct"
    with pytest.raises(TransferTimeoutError):
        target.get_notification(0.05)


def test_not_found_is_distinct_from_failed(target: TransferEngine, url: str) -> None:
    with _initiator(url, "tcp") as engine:
        batch = engine.allocate_batch(4)
        with pytest.raises(SegmentNotFoundError, match="not published"):
            engine.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "nope", 0, 1)])
        with pytest.raises(SegmentNotFoundError, match="not registered"):
            engine.submit(batch, [TransferRequest(OpCode.READ, "nope", 0, "remote", 0, 1)])
        with pytest.raises(OutOfRangeError):
            engine.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "remote", SIZE, 1)])
        with pytest.raises(OutOfRangeError):
            engine.submit(batch, [TransferRequest(OpCode.READ, "local", 2**64 - 1, "remote",
                                                  0, 1)])
        with pytest.raises(UsageError, match="length"):
            engine.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "remote", 0, 0)])
        assert batch.submitted == 0  # rejected submissions leave no trace
        with pytest.raises(SegmentNotFoundError):
            engine.lookup("nope")


def test_failed_request_carries_a_cause(target: TransferEngine, url: str) -> None:
    with _initiator(url, "tcp") as engine:
        engine.open_segment("remote")
        target.unregister_segment("remote")  # the descriptor we cached is now stale
        batch = engine.allocate_batch(1)
        engine.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "remote", 0, 8)])
        result = engine.wait(batch, 10)
        assert result.failed == 1
        assert "no segment" in (result.first_cause or "")
        (status,) = engine.status(batch)
        assert status.state is TransferState.FAILED
        assert "NO_SEGMENT" in (status.cause or "")
        with pytest.raises(TransferFailedError, match="no segment"):
            engine.transfer([TransferRequest(OpCode.READ, "local", 0, "remote", 0, 8)])
        with pytest.raises(SegmentNotFoundError):  # re-reading shows it is gone
            engine.refresh_segment("remote")


def test_batch_capacity_and_free_rules(target: TransferEngine, url: str) -> None:
    with _initiator(url, "shm") as engine:
        batch = engine.allocate_batch(2)
        reqs = [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, 8)] * 3
        with pytest.raises(UsageError, match="free slot"):
            engine.submit(batch, reqs)
        engine.submit(batch, reqs[:2])
        engine.wait(batch, 5)
        engine.free_batch(batch)
        with pytest.raises(UsageError, match="freed"):
            engine.submit(batch, reqs[:1])
        with pytest.raises(UsageError):
            engine.allocate_batch(0)


def test_free_batch_and_unregister_refused_while_in_flight(url: str) -> None:
    """A target that never answers keeps requests in flight: both refusals must hold."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    info = SegmentInfo("stuck", "shm", "x", "elsewhere/1", 1,
                       (f"127.0.0.1:{silent.getsockname()[1]}",), 1, ("tcp",),
                       (SegmentInfo.from_json(_one_buffer(), source="t").buffers))
    with TransferEngine("i", url, transport="tcp", timeout_s=1.0) as engine:
        engine.metadata.put(segment_key("", "stuck"), info.to_json())
        engine.register_segment("local", SIZE)
        batch = engine.allocate_batch(1)
        engine.submit(batch, [TransferRequest(OpCode.READ, "local", 0, "stuck", 0, 8)])
        with pytest.raises(BusyError, match="in flight"):
            engine.free_batch(batch)
        with pytest.raises(BusyError, match="in flight"):
            engine.unregister_segment("local")
        with pytest.raises(TransferTimeoutError):
            engine.wait(batch, 0.05)
        result = engine.wait(batch, 10)  # the stalled handshake times out: nothing hangs
        assert result.timed_out == 1
        (status,) = engine.status(batch)
        assert status.state is TransferState.TIMEOUT
        assert "no answer" in (status.cause or "")
        engine.free_batch(batch)
        engine.unregister_segment("local")
    silent.close()


def _one_buffer() -> bytes:
    from kvctl.transfer.segments import BufferInfo

    return SegmentInfo("t", "shm", "x", "h", 1, ("a:1",), 1, ("tcp",),
                       (BufferInfo(0, SIZE, "cpu:0"),)).to_json()


def test_registry_lists_and_unregisters(url: str) -> None:
    with TransferEngine("reg", url) as engine:
        engine.register_segment("a", 4096)
        engine.register_memory("b", [bytearray(100), bytearray(200)])
        with pytest.raises(UsageError, match="already registered"):
            engine.register_segment("a", 4096)
        assert [i.name for i in engine.list_segments()] == ["a", "b"]
        assert engine.lookup("b").transports == ("tcp",)  # caller memory: not mappable
        assert [b.offset for b in engine.lookup("b").buffers] == [0, 100]
        with TransferEngine("other", url) as other, pytest.raises(UsageError,
                                                                  match="already published"):
            other.register_segment("a", 4096)
        engine.unregister_segment("a")
        with pytest.raises(SegmentNotFoundError):
            engine.unregister_segment("a")
        assert [i.name for i in engine.list_segments()] == ["b"]
    with TransferEngine("after", url) as engine:
        assert engine.list_segments() == []  # close withdrew everything


def test_close_is_idempotent_and_final(url: str) -> None:
    engine = TransferEngine("c", url)
    engine.register_segment("x", 4096)
    engine.close()
    engine.close()
    with pytest.raises(Exception, match="closed"):
        engine.allocate_batch(1)


def test_concurrent_submitters_share_an_engine(target: TransferEngine, url: str) -> None:
    with _initiator(url, "tcp") as engine:
        _fill(engine.local_view("local"), run=9)

        def worker(k: int) -> None:
            for _ in range(5):
                engine.transfer([TransferRequest(OpCode.WRITE, "local", i * BLOCK, "remote",
                                                 i * BLOCK, BLOCK)
                                 for i in range(k * 16, (k + 1) * 16)], timeout_s=10)

        run_threads(worker, 4, timeout_s=30)
        _check(target.local_view("remote"), run=9)


def test_close_leaves_no_threads_behind(url: str) -> None:
    before = {t.ident for t in threading.enumerate()}
    with TransferEngine("tgt", url) as tgt, _initiator(url, "tcp") as ini:
        tgt.register_segment("r", 4096)
        ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "r", 0, 64)])
        with _initiator(url + "x", "shm"):
            pass
    leftover = [t.name for t in threading.enumerate()
                if t.ident not in before and t.is_alive()]
    assert leftover == []


def test_hold_local_is_bounded_and_counted() -> None:
    """hold_local lends a view only inside a registered buffer, counts it as in flight
    (the segment cannot be unregistered meanwhile), and refuses anything else."""
    with TransferEngine("holder", memory_url()) as eng:
        eng.register_segment("seg", 1 << 20, kind="shm")
        eng.local_view("seg")[100:104] = b"abcd"
        got = eng.hold_local("seg", 100, 4)
        assert got is not None
        view, release = got
        assert bytes(view) == b"abcd"
        with pytest.raises(BusyError):
            eng.unregister_segment("seg")
        release()
        for name, offset, size in (("seg", (1 << 20) - 3, 4), ("seg", 1 << 20, 1),
                                   ("seg", -1, 4), ("nope", 0, 4)):
            assert eng.hold_local(name, offset, size) is None
        eng.unregister_segment("seg")  # nothing left held
        assert eng.hold_local("seg", 0, 4) is None
