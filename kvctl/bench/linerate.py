"""Line rate: the ceiling each path can reach, so results read as "% of line rate".

Sources, by path:

- ``shm`` (same host, shared memory): a measured ``memcpy`` between two buffers of this
  process (a copy is the most a shared-memory transport can do);
- ``tcp`` on loopback: a measured raw TCP stream over 127.0.0.1 (``sendall``/``recv_into``,
  no framing, no protocol), the most any TCP transport gets from this kernel;
- cross-host ``tcp``/``rdma``: the port rate of the best NIC for the local buffer, from
  :mod:`kvctl.topo` (:func:`nic_line_rate`).

Measured baselines take a fraction of a second each and are cached per process.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvctl.errors import UnavailableError

if TYPE_CHECKING:
    from kvctl.topo.model import Topology

_log = logging.getLogger("kvctl.bench")

_CHUNK_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class LineRate:
    """The expected ceiling of a path.

    Attributes:
        gbytes_per_s: bytes per second / 10^9 (GB/s: gigabytes, decimal).
        source: how it was obtained: ``memcpy``, ``tcp-loopback``, ``nic mlx5_0 (200 Gbit/s)``,
            ``given``.
    """

    gbytes_per_s: float
    source: str

    @property
    def gbits_per_s(self) -> float:
        """The same rate in Gbit/s."""
        return self.gbytes_per_s * 8


def measure_memcpy(size_bytes: int = 64 << 20, duration_s: float = 0.25) -> LineRate:
    """Copy ``size_bytes`` between two buffers for ``duration_s``; the best pass is the rate."""
    src = bytearray(b"\x5a") * size_bytes
    dst = bytearray(size_bytes)
    dst[:] = src  # fault the pages in before timing
    best = 0.0
    deadline = time.perf_counter() + duration_s
    passes = 0
    while passes < 3 or (time.perf_counter() < deadline and passes < 1000):
        start = time.perf_counter()
        dst[:] = src
        elapsed = time.perf_counter() - start
        best = max(best, size_bytes / elapsed / 1e9 if elapsed > 0 else 0.0)
        passes += 1
    _log.info("memcpy baseline: %.2f GB/s over %d passes of %d bytes", best, passes, size_bytes)
    return LineRate(best, "memcpy")


def measure_tcp_loopback(duration_s: float = 0.3, *, streams: int = 4,
                         chunk_bytes: int = _CHUNK_BYTES) -> LineRate:
    """Stream bytes over ``streams`` parallel 127.0.0.1 TCP connections for ``duration_s``.

    Raw sockets (``sendall``/``recv_into``, no framing): the most any TCP transport with that
    many connections gets from this kernel. Socket calls release the GIL, so sender and
    receiver threads run in parallel.

    Raises:
        UnavailableError: loopback TCP cannot be set up (no loopback interface).
    """
    try:
        listener = socket.create_server(("127.0.0.1", 0), backlog=streams)
    except OSError as exc:
        raise UnavailableError(
            f"cannot listen on 127.0.0.1 for the TCP baseline: {exc}",
            "bring up the loopback interface (ip link set lo up)",
        ) from exc
    errors: list[BaseException] = []
    sent = [0] * streams
    payload = memoryview(bytearray(b"\xa5") * chunk_bytes)

    def sink(conn: socket.socket) -> None:
        view = memoryview(bytearray(chunk_bytes))
        try:
            with conn:
                while conn.recv_into(view):
                    pass
        except OSError as exc:
            errors.append(exc)

    def source(index: int, conn: socket.socket, deadline: float) -> None:
        try:
            while time.perf_counter() < deadline:
                conn.sendall(payload)
                sent[index] += chunk_bytes
        except OSError as exc:
            errors.append(exc)

    senders: list[socket.socket] = []
    threads: list[threading.Thread] = []
    try:
        listener.settimeout(10)
        for _ in range(streams):
            conn = socket.create_connection(listener.getsockname(), timeout=10)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            senders.append(conn)
            accepted, _ = listener.accept()
            accepted.settimeout(10)
            threads.append(threading.Thread(target=sink, args=(accepted,), daemon=True,
                                            name="kvctl-bench-tcp-sink"))
        for thread in threads:
            thread.start()
        start = time.perf_counter()
        deadline = start + duration_s
        pumps = [threading.Thread(target=source, args=(i, c, deadline), daemon=True,
                                  name="kvctl-bench-tcp-source") for i, c in enumerate(senders)]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join(duration_s + 10)
        elapsed = time.perf_counter() - start
    except OSError as exc:
        errors.append(exc)
        elapsed = 0.0
    finally:
        for conn in senders:
            conn.close()
        for thread in threads:
            thread.join(10)
        listener.close()
    if errors:
        raise UnavailableError(f"TCP loopback baseline failed: {errors[0]}",
                               "check the loopback interface and local firewall rules")
    rate = sum(sent) / elapsed / 1e9 if elapsed > 0 else 0.0
    _log.info("tcp loopback baseline: %.2f GB/s (%d streams, %d bytes in %.3f s)", rate,
              streams, sum(sent), elapsed)
    return LineRate(rate, f"tcp-loopback x{streams}")


def best_tcp_loopback(rounds: int = 3, round_s: float = 0.12, *, streams: int = 4) -> LineRate:
    """The best of ``rounds`` short loopback streams: a busy host lowers single readings."""
    return max((measure_tcp_loopback(round_s, streams=streams) for _ in range(rounds)),
               key=lambda rate: rate.gbytes_per_s)


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
    """Per-process cache of measured baselines, keyed by path kind."""

    def __init__(self) -> None:
        self._cache: dict[str, LineRate] = {}
        self._lock = threading.Lock()

    def memcpy(self) -> LineRate:
        """The cached memcpy baseline (measured on first use)."""
        return self._get("memcpy", measure_memcpy)

    def tcp_loopback(self) -> LineRate:
        """The cached loopback TCP baseline (measured on first use)."""
        return self._get("tcp-loopback", best_tcp_loopback)

    def for_path(self, transport: str, *, loopback: bool,
                 nic_rate: LineRate | None = None) -> LineRate | None:
        """The line rate of a path that used ``transport``; ``None`` when nothing is known.

        Args:
            transport: what the bytes crossed (``shm``, ``tcp``, ``rdma``; anything else, e.g.
                ``""`` for "the engine chose", has no known line rate on loopback).
            loopback: whether the peer is on this host over loopback.
            nic_rate: the NIC port rate for cross-host paths, when topology knows it.
        """
        if transport == "shm":
            return self.memcpy()
        if loopback:
            return self.tcp_loopback() if transport == "tcp" else None
        return nic_rate

    def _get(self, key: str, measure: Callable[[], LineRate]) -> LineRate:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = measure()
            return self._cache[key]
