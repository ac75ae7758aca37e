"""``TransferEngine.run``: small tcp submissions move in the calling thread; retries counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvctl.transfer import OpCode, TransferEngine, TransferRequest, TransferState
from kvctl.transfer.transports.tcp import TcpTransport
from tests.transfer._helpers import behind_proxy, memory_url, pattern, wait_until

SIZE = 1 << 20


@pytest.fixture
def url() -> str:
    return memory_url()


@pytest.fixture
def target(url: str) -> Iterator[TransferEngine]:
    with TransferEngine("target", url) as engine:
        engine.register_segment("remote", 8 * SIZE)
        yield engine


def _worker_sockets(engine: TransferEngine) -> int:
    """Connections the tcp transport's worker paths have opened."""
    tcp: TcpTransport = engine._tcp
    return sum(path.sock is not None for peer in tcp._peers.values() for path in peer.paths)


def test_small_batch_runs_in_the_calling_thread(target: TransferEngine, url: str) -> None:
    with TransferEngine("i", url, transport="tcp") as ini:
        ini.register_segment("local", 8 * SIZE)
        local = ini.local_view("local")
        local[:65536] = pattern(1, 0, 0, 65536)
        batch = ini.allocate_batch(16)
        result = ini.run(batch, [TransferRequest(OpCode.WRITE, "local", i * 4096, "remote",
                                                 i * 4096, 4096) for i in range(16)],
                         timeout_s=10)
        assert result.ok
        assert result.bytes_moved == 65536
        assert result.retries == 0
        assert bytes(target.local_view("remote")[:65536]) == pattern(1, 0, 0, 65536)
        ini.free_batch(batch)
        back = ini.allocate_batch(1)
        assert ini.run(back, [TransferRequest(OpCode.READ, "local", SIZE, "remote", 0, 65536)],
                       timeout_s=10).ok
        assert bytes(local[SIZE:SIZE + 65536]) == pattern(1, 0, 0, 65536)
        assert _worker_sockets(ini) == 0  # no worker path was needed
        # A 4 MiB request is sliced and spread over the spare connections of 4 paths.
        local[:4 * SIZE] = pattern(2, 0, 0, 4 * SIZE)
        big = ini.allocate_batch(1)
        assert ini.run(big, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, 4 * SIZE)],
                       timeout_s=10).ok
        (status,) = ini.status(big)
        assert len(status.path.split(",")) == 4
        assert bytes(target.local_view("remote")[:4 * SIZE]) == pattern(2, 0, 0, 4 * SIZE)
        assert _worker_sockets(ini) == 0


def test_large_batch_and_submit_still_use_the_workers(target: TransferEngine, url: str) -> None:
    with TransferEngine("i", url, transport="tcp") as ini:
        ini.register_segment("local", 8 * SIZE)
        ini.local_view("local")[:] = pattern(3, 0, 0, 8 * SIZE)
        batch = ini.allocate_batch(8)
        result = ini.run(batch, [TransferRequest(OpCode.WRITE, "local", i * SIZE, "remote",
                                                 i * SIZE, SIZE) for i in range(8)],
                         timeout_s=20)  # 8 MiB: over the inline limit
        assert result.ok
        assert bytes(target.local_view("remote")) == pattern(3, 0, 0, 8 * SIZE)
        assert _worker_sockets(ini) > 0
        small = ini.allocate_batch(1)  # submit returns at once: the workers move it
        ini.submit(small, [TransferRequest(OpCode.READ, "local", 0, "remote", 0, 64)])
        assert ini.wait(small, 10).ok


def test_concurrent_callers_get_their_own_connections(target: TransferEngine,
                                                      url: str) -> None:
    with TransferEngine("i", url, transport="tcp") as ini:
        ini.register_segment("local", 8 * SIZE)
        target.local_view("remote")[:8 * SIZE] = pattern(4, 0, 0, 8 * SIZE)
        errors: list[str] = []

        def reader(k: int) -> None:
            for _ in range(50):
                off = k * SIZE
                res = ini.transfer([TransferRequest(OpCode.READ, "local", off, "remote", off,
                                                    SIZE)], timeout_s=20)
                if not res.ok:
                    errors.append(str(res.first_cause))
        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert bytes(ini.local_view("local")[:4 * SIZE]) == pattern(4, 0, 0, 8 * SIZE)[:4 * SIZE]


@pytest.mark.parametrize("mode", ["run", "submit"])
def test_cut_connection_is_retried_on_another_path_and_counted(url: str, mode: str) -> None:
    # the proxy cuts the first connection mid-payload
    with behind_proxy(url, "remote", SIZE, cut_after=300_000) as (tgt, proxy), \
            TransferEngine("i", url, transport="tcp", connections_per_peer=2,
                           slice_bytes=SIZE) as ini:
        ini.register_segment("local", SIZE)
        data = pattern(5, 0, 0, SIZE)
        ini.local_view("local")[:] = data
        batch = ini.allocate_batch(1)
        req = [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, SIZE)]
        if mode == "run":
            result = ini.run(batch, req, timeout_s=20)
        else:
            ini.submit(batch, req)
            result = ini.wait(batch, 20)
        assert result.ok
        assert result.retries == 1
        (status,) = ini.status(batch)
        assert status.state is TransferState.COMPLETED
        if mode == "submit":  # the workers retried it on the path that was not cut
            assert status.path.endswith("#1")
        assert proxy.cuts == 1
        assert bytes(tgt.local_view("remote")) == data


def test_move_direct_reads_and_writes_unregistered_buffers(target: TransferEngine,
                                                          url: str) -> None:
    """One value, no batch: straight between any buffer and the target, bounds checked
    before anything is sent, refusals and non-tcp targets reported as errors."""
    from kvctl.errors import TransferError
    from kvctl.transfer.errors import OutOfRangeError, UsageError

    with TransferEngine("i", url, transport="tcp") as ini:
        data = pattern(6, 0, 0, 65536)
        ini.move_direct(OpCode.WRITE, "remote", 4096, memoryview(data))
        assert bytes(target.local_view("remote")[4096:4096 + 65536]) == data
        back = bytearray(65536)
        ini.move_direct(OpCode.READ, "remote", 4096, memoryview(back))
        assert back == data
        with pytest.raises(OutOfRangeError):
            ini.move_direct(OpCode.READ, "remote", 8 * SIZE - 10, memoryview(back))
        with pytest.raises(UsageError):
            ini.move_direct(OpCode.READ, "remote", 0, memoryview(bytearray(0)))
        with pytest.raises(UsageError):
            ini.move_direct(OpCode.READ, "remote", 0, memoryview(bytearray(5 * SIZE)))
        assert _worker_sockets(ini) == 0
        # The target unregisters the segment: a refusal, and the connection stays usable.
        target.register_segment("other", SIZE)
        ini.move_direct(OpCode.WRITE, "other", 0, memoryview(data))
        # The target answers before it lets go of the segment: unregister once it has.
        wait_until(lambda: _unregistered(target, "other"), what="segment released")
        with pytest.raises(TransferError):
            ini.move_direct(OpCode.READ, "other", 0, memoryview(back))
        ini.move_direct(OpCode.READ, "remote", 4096, memoryview(back))
        assert back == data
    with TransferEngine("same-host", url, transport="auto") as local, \
            pytest.raises(UsageError):  # reached over shm: move_direct is tcp only
        local.move_direct(OpCode.READ, "remote", 0, memoryview(back))


def _unregistered(engine: TransferEngine, name: str) -> bool:
    from kvctl.transfer.errors import BusyError

    try:
        engine.unregister_segment(name)
    except BusyError:
        return False
    return True


def test_move_direct_failure_leaves_the_path_for_a_batch(url: str) -> None:
    from kvctl.errors import TransferError

    # the proxy cuts the first connection mid-payload
    with behind_proxy(url, "remote", SIZE, cut_after=1000) as (tgt, proxy), \
            TransferEngine("i", url, transport="tcp", connections_per_peer=1) as ini:
        data = pattern(7, 0, 0, 65536)
        with pytest.raises(TransferError):
            ini.move_direct(OpCode.WRITE, "remote", 0, memoryview(data))
        assert proxy.cuts == 1
        ini.move_direct(OpCode.WRITE, "remote", 0, memoryview(data))  # a new connection
        assert bytes(tgt.local_view("remote")[:65536]) == data


def _pooled(engine: TransferEngine) -> list[object]:
    """The idle connections the tcp transport keeps for inline moves."""
    tcp: TcpTransport = engine._tcp
    return [sock for peer in tcp._peers.values() for spare in peer._spare for sock in spare]


def test_idle_connections_cut_by_the_peer_do_not_fail_the_next_request(url: str) -> None:
    """A target that restarted, or a middlebox that cut idle connections, leaves the pool
    holding dead sockets: the next move_direct and the next inline batch open new ones
    instead of failing (or retrying) once."""
    from kvctl.transfer.transports.tcp import _idle_and_open

    with behind_proxy(url, "remote", SIZE) as (tgt, proxy), \
            TransferEngine("i", url, transport="tcp", connections_per_peer=2) as ini:
        ini.register_segment("local", SIZE)
        data = pattern(8, 0, 0, 4096)
        ini.local_view("local")[:4096] = data
        ini.move_direct(OpCode.WRITE, "remote", 0, memoryview(data))
        batch = ini.allocate_batch(1)
        assert ini.run(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 4096,
                                               4096)], timeout_s=10).ok
        pooled = _pooled(ini)
        assert pooled
        before = proxy.connections
        proxy.cut_all()
        wait_until(lambda: not any(_idle_and_open(s) for s in pooled),  # type: ignore[arg-type]
                   what="the cut reaching the client")
        back = bytearray(4096)
        ini.move_direct(OpCode.READ, "remote", 0, memoryview(back))
        assert back == data
        again = ini.allocate_batch(1)
        result = ini.run(again, [TransferRequest(OpCode.READ, "local", 8192, "remote", 4096,
                                                 4096)], timeout_s=10)
        assert result.ok, result
        assert result.retries == 0
        assert bytes(ini.local_view("local")[8192:12288]) == data
        assert proxy.connections > before
        assert _worker_sockets(ini) == 0  # no worker path was needed either
        assert bytes(tgt.local_view("remote")[4096:8192]) == data
