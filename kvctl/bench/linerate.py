"""Line rate: the ceiling each path can reach, so results read as "% of line rate".

A row is judged against a rate measured with the row's own *shape* (:class:`Shape`: block
size, batch size, initiator threads) in the same run, right after the row itself, so a busy
machine lowers both and a working set that fits in a cache is compared with one that fits
too. Sources, by path:

- ``shm`` (same host, shared memory): ``memcpy`` of each batch's bytes (batch x block, one
  contiguous copy: what shm's coalesced runs do at best) between two buffers of that size
  per thread, ``threads`` threads at once (``ctypes.memmove`` releases the GIL);
- ``tcp`` on loopback: raw TCP over 127.0.0.1, each thread's batch split over
  :data:`TCP_STREAMS` connections (the kvctl engine's connections per peer), each sending its
  share (at most :data:`MAX_TCP_BUFFER_BYTES` at a time) and waiting for a one-byte
  acknowledgement before the next (``sendall`` / ``recv_into``, no framing, no protocol);
- cross-host ``tcp``/``rdma``: the port rate of the best NIC for the local buffer, from
  :mod:`kvctl.topo` (:func:`nic_line_rate`).

Buffers are allocated for each measurement and touched once before timing, as a row's warm-up
batches touch its own; no copy buffer is larger than :data:`MAX_BUFFER_BYTES` (no cache holds
that much: a larger working set measures the same). A measurement is the best of
:data:`ROUNDS` rounds of at least one batch each. A row that beats its measured rate gets one
re-measurement; a row still above it has ``line_rate_valid`` false: the baseline is wrong and
no line-rate verdict is drawn from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import mmap
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvctl.errors import UnavailableError
from kvctl.units import format_size

if TYPE_CHECKING:
    from kvctl.topo.model import Topology

_log = logging.getLogger("kvctl.bench")

#: Connections per initiator thread of the loopback TCP baseline (the kvctl engine's default
#: connections per peer).
TCP_STREAMS = 4
#: Most buffer the memcpy baseline allocates per side, all threads together (at least 1 MiB
#: per thread): no cache holds that much, so a larger working set measures the same.
MAX_BUFFER_BYTES = 256 << 20
#: Most bytes one connection of the TCP baseline sends before its acknowledgement, per
#: thread's share of this (at least 64 KiB; the kernel's copies dominate there).
MAX_TCP_BUFFER_BYTES = 32 << 20
#: Rounds per measurement (the best counts) and the least time of one round.
ROUNDS = 6
ROUND_S = 0.03
#: Most seconds one measurement may take (rounds stop early past it, after the first).
BUDGET_S = 0.6
#: Seconds a socket of the TCP baseline may block before the measurement fails.
_SOCKET_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class LineRate:
    """The expected ceiling of a path.

    Attributes:
        gbytes_per_s: bytes per second / 10^9 (GB/s: gigabytes, decimal).
        source: how it was obtained: ``memcpy 64 KiB x128``, ``tcp-loopback 64 KiB x128, 4
            streams``, ``nic mlx5_0 (200 Gbit/s port)``.
    """

    gbytes_per_s: float
    source: str

    @property
    def gbits_per_s(self) -> float:
        """The same rate in Gbit/s."""
        return self.gbytes_per_s * 8


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a row moves per batch: ``batch_size`` blocks of ``block_size_bytes`` in each of
    ``threads`` initiator threads."""

    block_size_bytes: int
    batch_size: int
    threads: int = 1

    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch of one thread."""
        return self.block_size_bytes * self.batch_size

    def label(self) -> str:
        """``64 KiB x128`` (and ``, 2 threads`` when more than one)."""
        text = f"{format_size(self.block_size_bytes)} x{self.batch_size}"
        return text + (f", {self.threads} threads" if self.threads > 1 else "")


def _rounds(run_round: Callable[[float], tuple[int, float]], rounds: int, round_s: float
            ) -> float:
    """The best GB/s of ``rounds`` calls of ``run_round(least_s)`` -> (bytes, seconds); rounds
    after the first stop once :data:`BUDGET_S` has passed."""
    best = 0.0
    started = time.perf_counter()
    for index in range(max(1, rounds)):
        if index and time.perf_counter() - started > BUDGET_S:
            break
        moved, elapsed = run_round(round_s)
        if elapsed > 0:
            best = max(best, moved / elapsed / 1e9)
    return best


def measure_memcpy(shape: Shape, *, rounds: int = ROUNDS, round_s: float = ROUND_S
                   ) -> LineRate:
    """Copy each batch's bytes between two buffers of that size, in ``shape.threads``
    threads at once, for rounds of at least ``round_s``; the best round is the rate."""
    size = min(shape.batch_bytes, max(1 << 20, MAX_BUFFER_BYTES // shape.threads))
    maps: list[mmap.mmap] = []
    addresses: list[tuple[int, int]] = []
    for _ in range(shape.threads):
        # the kinds of memory shm copies between: private (the initiator's region) and shared
        # (a /dev/shm segment is shmem, as MAP_SHARED anonymous memory is)
        src = mmap.mmap(-1, size)
        dst = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        maps += [src, dst]
        pair = (ctypes.addressof(ctypes.c_char.from_buffer(src)),
                ctypes.addressof(ctypes.c_char.from_buffer(dst)))
        ctypes.memset(pair[0], 0x5A, size)  # fault the pages in before timing, as a
        ctypes.memmove(pair[1], pair[0], size)  # row's warm-up batches do
        addresses.append(pair)

    def copy_batches(src: int, dst: int, until: float, moved: list[int]) -> None:
        while True:
            left = shape.batch_bytes
            while left > 0:  # a batch bigger than the buffers reuses them
                step = min(left, size)
                ctypes.memmove(dst, src, step)
                left -= step
            moved.append(shape.batch_bytes)
            if time.perf_counter() >= until:
                return

    def run_round(least_s: float) -> tuple[int, float]:
        moved: list[int] = []
        start = time.perf_counter()
        until = start + least_s
        workers = [threading.Thread(target=copy_batches, args=(src, dst, until, moved),
                                    daemon=True, name="kvctl-bench-memcpy")
                   for src, dst in addresses]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return sum(moved), time.perf_counter() - start

    try:
        rate = _rounds(run_round, rounds, round_s)
    finally:
        addresses.clear()
        for m in maps:
            with contextlib.suppress(BufferError):  # a ctypes view may still hold it
                m.close()
    _log.info("memcpy baseline %s: %.2f GB/s", shape.label(), rate)
    return LineRate(rate, f"memcpy {shape.label()}")


def measure_tcp_loopback(shape: Shape, *, streams: int = TCP_STREAMS, rounds: int = ROUNDS,
                         round_s: float = ROUND_S) -> LineRate:
    """Raw TCP over 127.0.0.1 in the row's rhythm: each of ``shape.threads`` threads' batch
    is split over ``streams`` connections, each with its own sender thread that sends its
    share and waits for the receiver's one-byte acknowledgement before the next (no barrier
    between connections: a ceiling), for rounds of at least ``round_s``; the best counts.

    Socket calls release the GIL, so senders and receivers run in parallel.

    Raises:
        UnavailableError: loopback TCP cannot be set up (no loopback interface) or failed.
    """
    # every stream carries a share (ceil); a share bigger than the buffer is acknowledged per
    # buffer (one round trip per 32 MiB is nothing next to moving them), so rounds stay short
    per_stream = min(-(-shape.batch_bytes // streams),
                     max(64 << 10, MAX_TCP_BUFFER_BYTES // shape.threads))
    total = shape.threads * streams
    try:
        listener = socket.create_server(("127.0.0.1", 0), backlog=total)
    except OSError as exc:
        raise UnavailableError(
            f"cannot listen on 127.0.0.1 for the TCP baseline: {exc}",
            "bring up the loopback interface (ip link set lo up)",
        ) from exc
    errors: list[BaseException] = []
    senders: list[socket.socket] = []
    receivers: list[socket.socket] = []
    stop = threading.Event()

    def sink(conn: socket.socket) -> None:
        view = memoryview(bytearray(per_stream))
        try:
            while not stop.is_set():
                left = per_stream
                while left > 0:
                    got = conn.recv_into(view[per_stream - left:])
                    if not got:
                        return
                    left -= got
                conn.sendall(b"\x01")
        except OSError as exc:
            if not stop.is_set():
                errors.append(exc)

    payload = memoryview(bytearray(b"\xa5") * per_stream)

    def send_batches(conn: socket.socket, until: float, moved: list[int]) -> None:
        ack = bytearray(1)
        try:
            while True:
                conn.sendall(payload)
                if conn.recv_into(ack) != 1:
                    raise OSError("the baseline's receiver went away")
                moved.append(per_stream)
                if time.perf_counter() >= until:
                    return
        except OSError as exc:
            errors.append(exc)

    sinks: list[threading.Thread] = []
    best = 0.0
    try:
        listener.settimeout(_SOCKET_TIMEOUT_S)
        for _ in range(total):
            conn = socket.create_connection(listener.getsockname(), timeout=_SOCKET_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            senders.append(conn)
            accepted, _ = listener.accept()
            accepted.settimeout(_SOCKET_TIMEOUT_S)
            accepted.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            receivers.append(accepted)
            sinks.append(threading.Thread(target=sink, args=(accepted,), daemon=True,
                                          name="kvctl-bench-tcp-sink"))
        for thread in sinks:
            thread.start()

        def run_round(least_s: float) -> tuple[int, float]:
            moved: list[int] = []
            start = time.perf_counter()
            pumps = [threading.Thread(target=send_batches, args=(c, start + least_s, moved),
                                      daemon=True, name="kvctl-bench-tcp-source")
                     for c in senders]
            for pump in pumps:
                pump.start()
            for pump in pumps:
                pump.join()
            return (0 if errors else sum(moved)), time.perf_counter() - start

        best = _rounds(run_round, rounds, round_s)
    except OSError as exc:
        errors.append(exc)
    finally:
        stop.set()
        for conn in senders + receivers:
            conn.close()
        for thread in sinks:
            thread.join(_SOCKET_TIMEOUT_S)
        listener.close()
    if errors:
        raise UnavailableError(f"TCP loopback baseline failed: {errors[0]}",
                               "check the loopback interface and local firewall rules")
    _log.info("tcp loopback baseline %s: %.2f GB/s (%d streams per thread)", shape.label(),
              best, streams)
    return LineRate(best, f"tcp-loopback {shape.label()}, {streams} streams")


def nic_line_rate(topology: Topology, location: str, *, rdma_only: bool) -> LineRate | None:
    """The port rate of the best ACTIVE NIC for a buffer at ``location``, from topology.

    The NIC ranking is topo's (link class to the buffer, NUMA, rate). ``None`` when no
    ranked NIC has an active port with a known rate.

    Raises:
        UsageError: ``location`` is malformed.
        NotFoundError: no such GPU or NUMA node.
    """
    from kvctl.topo.model import NicKind, PortState
    from kvctl.topo.rank import rank_nics

    kind = NicKind.RDMA if rdma_only else None
    for nic in rank_nics(topology, location, kind=kind):
        if nic.state is PortState.ACTIVE and nic.rate_gbps:
            # topo's rate_gbps is a link rate in Gbit/s; line rates here are GB/s.
            return LineRate(nic.rate_gbps / 8, f"nic {nic.name} ({nic.rate_gbps:g} Gbit/s port)")
    return None


class LineRates:
    """Baselines of one run, measured per path kind and :class:`Shape` on first use."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, Shape], LineRate] = {}
        self._remeasured: set[tuple[str, Shape]] = set()
        self._lock = threading.Lock()

    def memcpy(self, shape: Shape, *, beaten_by: float | None = None) -> LineRate:
        """The memcpy baseline of ``shape`` (see :meth:`measured` for ``beaten_by``)."""
        return self.measured("memcpy", shape, lambda: measure_memcpy(shape), beaten_by)

    def tcp_loopback(self, shape: Shape, *, beaten_by: float | None = None) -> LineRate:
        """The loopback TCP baseline of ``shape`` (see :meth:`measured`)."""
        return self.measured("tcp-loopback", shape, lambda: measure_tcp_loopback(shape),
                             beaten_by)

    def measured(self, kind: str, shape: Shape, measure: Callable[[], LineRate],
                 beaten_by: float | None) -> LineRate:
        """The cached ``kind`` baseline of ``shape``, measured on first use.

        ``beaten_by``: the GB/s of the row about to be judged; when it is above the cached
        rate the baseline is measured once more (the machine may have been busier then) and
        the higher of the two kept, its source marked ``re-measured``.
        """
        key = (kind, shape)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = measure()
            rate = self._cache[key]
            if (beaten_by is not None and beaten_by > rate.gbytes_per_s
                    and key not in self._remeasured):
                self._remeasured.add(key)
                again = measure()
                _log.info("%s baseline %s beaten by a row (%.2f > %.2f GB/s): re-measured "
                          "%.2f GB/s", kind, shape.label(), beaten_by, rate.gbytes_per_s,
                          again.gbytes_per_s)
                best = max(rate, again, key=lambda r: r.gbytes_per_s)
                rate = self._cache[key] = LineRate(best.gbytes_per_s,
                                                   f"{best.source} (re-measured)")
            return rate

    def for_path(self, transport: str, *, loopback: bool, shape: Shape,
                 nic_rate: LineRate | None = None, beaten_by: float | None = None
                 ) -> LineRate | None:
        """The line rate of a row of ``shape`` that used ``transport``; ``None`` when nothing
        is known.

        Args:
            transport: what the bytes crossed (``shm``, ``tcp``, ``rdma``; anything else, e.g.
                ``""`` for "the engine chose", has no known line rate on loopback).
            loopback: whether the peer is on this host over loopback.
            shape: the row's block size, batch size and threads.
            nic_rate: the NIC port rate for cross-host paths, when topology knows it.
            beaten_by: the row's GB/s (a measured baseline below it is measured again).
        """
        if transport == "shm":
            return self.memcpy(shape, beaten_by=beaten_by)
        if loopback:
            return (self.tcp_loopback(shape, beaten_by=beaten_by) if transport == "tcp"
                    else None)
        return nic_rate
