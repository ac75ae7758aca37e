"""Drive a real Mooncake Store through ``MooncakeDistributedStore`` (TCP protocol).

The package is ``mooncake-transfer-engine-non-cuda`` (or ``mooncake-transfer-engine``),
imported lazily: when it is missing, :class:`MooncakeUnavailableError` says how to install
it. Every Mooncake process kvctl starts stays on loopback unless told otherwise, and a client
binds its transfer engine to the address it reaches the master from: ``MC_TCP_BIND_ADDRESS``
is set to that local hostname before the engine loads.

A client is client-only by default (``global_segment_bytes=0``): it mounts no segment, so
it adds nothing to a production pool and every object it puts lands in the cluster's own
storage. Before ``setup`` (which retries a dead or foreign master for ~30-90 s) the master's
address is probed with one round trip of mooncake_master's RPC (coro_rpc): a kvctl store
master, which greets first, or anything else that does not answer like coro_rpc, is reported
at once.

Mooncake's Python API returns ``b""`` from ``get`` both for a missing key and for a failed
read, and negative integers for errors. This adapter turns that into kvctl's contract:
``ObjectNotFoundError`` when ``is_exist`` says the key is absent, a ``StoreError`` naming
Mooncake's error code otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import KvctlError, UnavailableError, UsageError
from kvctl.nativelog import native_output_to_log
from kvctl.store.errors import (
    ObjectNotFoundError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)

_log = logging.getLogger("kvctl.store.mooncake")

Buffer = bytes | bytearray | memoryview

#: Mooncake's ``NO_AVAILABLE_HANDLE``: a put found no segment with room.
_NO_AVAILABLE_HANDLE = -200


class MooncakeUnavailableError(UnavailableError):
    """The Mooncake package or binary is not usable here."""


def _load() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MooncakeUnavailableError(
            f"Mooncake unavailable: cannot import mooncake.store ({exc})",
            "pip install 'kvctl[engines]' (mooncake-transfer-engine-non-cuda; it needs "
            "libibverbs1 from apt)") from None
    return MooncakeDistributedStore


def find_mooncake_binary(name: str) -> Path:
    """A Mooncake executable (``mooncake_master``, ``mooncake_client``): on PATH, next to
    this Python, then inside the installed ``mooncake`` package.

    Raises:
        MooncakeUnavailableError: not found.
    """
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return Path(found)
    with contextlib.suppress(ImportError):
        import mooncake

        candidate = Path(mooncake.__file__).parent / name
        if candidate.exists():
            return candidate
    raise MooncakeUnavailableError(f"{name} not found on PATH or in the mooncake package",
                                   "pip install mooncake-transfer-engine-non-cuda")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """A ``mooncake_master`` process on loopback (for smoke runs, tests and benchmarks).

    Args:
        host: bind address (loopback).
        eviction_high_watermark: Mooncake's ``eviction_high_watermark_ratio``.
        log_path: where its log goes (default: discarded).
        ready_timeout_s: how long to wait for its RPC port to accept connections.
        storage_bytes: when > 0, also start a :class:`MooncakeStorage` of that many bytes.

    Attributes:
        metrics_port: its HTTP metrics/health port (``--metrics_port``, a free one).
    """

    def __init__(self, *, host: str = "127.0.0.1", eviction_high_watermark: float = 0.95,
                 log_path: Path | None = None, ready_timeout_s: float = 15.0,
                 storage_bytes: int = 0) -> None:
        binary = find_mooncake_binary("mooncake_master")
        self.host = host
        self.port = _free_port(host)
        self.metrics_port = _free_port(host)
        args = [str(binary), f"--rpc_port={self.port}", f"--rpc_address={host}",
                f"--metrics_port={self.metrics_port}", f"--metrics_host={host}",
                "--enable_http_metadata_server=false",
                f"--eviction_high_watermark_ratio={eviction_high_watermark}"]
        log = log_path.open("wb") if log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        if log_path:
            log.close()  # type: ignore[union-attr]
        self.storage: MooncakeStorage | None = None
        try:
            _wait_listening(self._proc, host, self.port, "mooncake_master", ready_timeout_s)
            if storage_bytes:
                self.storage = MooncakeStorage(self.address, segment_bytes=storage_bytes,
                                               host=host)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """``host:port`` of its RPC service."""
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:port`` of its HTTP metrics/health service."""
        return f"http://{self.host}:{self.metrics_port}"

    def close(self) -> None:
        """Stop the storage process and the master (idempotent)."""
        if self.storage is not None:
            self.storage.close()
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, what: str,
                    timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise MooncakeUnavailableError(f"{what} exited with code {proc.returncode} at start",
                                           "run it by hand to see why")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise MooncakeUnavailableError(
                    f"{what} did not listen on {host}:{port} within {timeout_s:g} s",
                    "check its log") from None
            time.sleep(0.05)


class MooncakeStorage:
    """A standalone ``mooncake_client`` process contributing ``segment_bytes`` of DRAM.

    Args:
        master: Mooncake master ``HOST:PORT``.
        segment_bytes: memory it contributes to the pool.
        host: its address (loopback).
    """

    def __init__(self, master: str, *, segment_bytes: int = 1 << 30, host: str = "127.0.0.1",
                 ready_timeout_s: float = 15.0) -> None:
        port = _free_port(host)
        args = [str(find_mooncake_binary("mooncake_client")), f"--host={host}", f"--port={port}",
                f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE",
                f"--global_segment_size={segment_bytes // (1 << 20)}MB", "--protocol=tcp"]
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": host}
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=env)
        try:
            _wait_listening(self._proc, host, port, "mooncake_client", ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the process (idempotent)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)


#: The first byte of every coro_rpc header (yalantinglibs' RPC, which mooncake_master speaks).
CORO_RPC_MAGIC = 0x15
#: A coro_rpc request header for a function no server registers (magic, version 0,
#: serialization 0, message type 0, u32 sequence, u32 function id, u32 body length,
#: u32 attachment length, little endian). mooncake_master answers it at once with a reply
#: header (magic 0x15, error 11) and "the rpc function not registered".
CORO_RPC_PROBE = struct.pack("<BBBBIIII", CORO_RPC_MAGIC, 0, 0, 0, 1, 0x6B766374, 0, 0)
#: How long a kvctl store master may take to greet before a probe is sent, seconds.
_GREETING_WAIT_S = 0.25
#: The magic of kvctl's store frames (``kvctl.store.protocol.MAGIC``), which its master
#: sends first, unasked.
_KVCTL_MAGIC = b"KVSM"


def looks_like_coro_rpc(reply: bytes) -> bool:
    """Whether ``reply`` starts like a coro_rpc reply header (16 bytes, magic 0x15)."""
    return len(reply) >= 16 and reply[0] == CORO_RPC_MAGIC


def _split_master(master: str) -> tuple[str, int]:
    host, _, port = master.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        raise UsageError(f"Mooncake master {master!r} is not HOST:PORT",
                         "give the master's RPC address, e.g. 10.0.0.1:50051")
    return host.strip("[]"), int(port)


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    readable, _, _ = select.select([sock], [], [], max(0.0, timeout_s))
    return bool(readable)


def probe_master(master: str, timeout_s: float = 3.0) -> None:
    """Check that ``master`` is a ``mooncake_master`` before handing it to Mooncake, whose
    ``setup`` would retry a dead or foreign address for 30 s or more.

    One connection: wait briefly for an unasked greeting (a kvctl store master sends one),
    then send :data:`CORO_RPC_PROBE` and expect a coro_rpc reply.

    Raises:
        UsageError: ``master`` is not ``HOST:PORT``, or it is a kvctl store master.
        MooncakeUnavailableError: nothing listens there, or it does not answer coro_rpc.
    """
    host, port = _split_master(master)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise MooncakeUnavailableError(
            f"cannot reach mooncake_master at {master}: {exc.strerror or exc}",
            "check that mooncake_master runs there and the port is open "
            "(kvctl starts one when --master is not given)") from exc
    data: bytes | None = None  # None: nothing arrived in time; b"": the peer closed
    with sock:
        try:
            if not _readable(sock, _GREETING_WAIT_S):
                sock.sendall(CORO_RPC_PROBE)
            if _readable(sock, deadline - time.monotonic()):
                data = sock.recv(64)
        except OSError as exc:
            raise MooncakeUnavailableError(
                f"mooncake_master at {master} dropped the connection: {exc.strerror or exc}",
                "check that the address is mooncake_master's --rpc_port") from exc
    if data is not None and data.startswith(_KVCTL_MAGIC):
        raise UsageError(f"{master} is a kvctl store master; use --backend kvctl",
                         "or pass --master HOST:PORT of mooncake_master's --rpc_port")
    if data is None or not looks_like_coro_rpc(data):
        what = (f"did not answer within {timeout_s:g} s" if data is None else
                "closed the connection" if not data else f"sent {data[:8]!r}")
        raise MooncakeUnavailableError(
            f"{master} accepted a connection but does not speak mooncake_master's RPC "
            f"(it {what})",
            "pass --master HOST:PORT of mooncake_master's --rpc_port (default 50051)")


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (``127.0.0.1`` for a loopback one):
    what a Mooncake client must bind and call itself so that peers can reach it."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)  # no packet is sent: the kernel only picks a route
            except OSError:
                continue
            return str(s.getsockname()[0])
    return "127.0.0.1"


class MooncakeStore:
    """A ``MooncakeDistributedStore`` client over TCP. Client-only by default: with
    ``global_segment_bytes > 0`` it also mounts that much memory into the pool (objects
    placed there vanish when it closes), which a check against a production master must not.

    Args:
        master: Mooncake master ``HOST:PORT``.
        local_hostname: this client's address as peers see it (default: this host's
            address on the route to the master; loopback for a loopback master).
        metadata_server: ``P2PHANDSHAKE`` (no metadata server) or an etcd/HTTP URL.
        global_segment_bytes: memory this client mounts into the pool (0: none).
        local_buffer_bytes: the client's registered transfer buffer.
        protocol: ``tcp`` (``rdma`` where the hardware has it).

    Raises:
        UsageError: ``master`` is a kvctl store master (see :func:`probe_master`).
        MooncakeUnavailableError: the package is missing, the master does not answer as
            mooncake_master, or ``setup`` failed.
    """

    def __init__(self, master: str, *, local_hostname: str | None = None,
                 metadata_server: str = "P2PHANDSHAKE", global_segment_bytes: int = 0,
                 local_buffer_bytes: int = 128 << 20, protocol: str = "tcp") -> None:
        if local_hostname is None:
            local_hostname = local_address_towards(_split_master(master)[0])
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        cls = _load()
        probe_master(master)  # setup() retries a dead or foreign master for 30-90 s
        self.master = master
        self.local_hostname = local_hostname
        self.global_segment_bytes = global_segment_bytes
        # Mooncake's glog lines (dozens per client start) go to a file for the client's life.
        self._native_log = contextlib.ExitStack()
        self.log_path = self._native_log.enter_context(native_output_to_log("mooncake-store"))
        try:
            self._store = cls()
            rc = self._store.setup(local_hostname, metadata_server, global_segment_bytes,
                                   local_buffer_bytes, protocol, "", master)
        except BaseException:
            self._native_log.close()
            raise
        if rc != 0:
            self._native_log.close()
            seen = f" (Mooncake's log: {self.log_path})" if self.log_path else ""
            raise MooncakeUnavailableError(
                f"MooncakeDistributedStore.setup against {master} failed with code {rc}{seen}",
                "check that mooncake_master runs there (kvctl starts one when --master "
                "is not given)")
        self._closed = False
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int, Any]] = []

    def close(self) -> None:
        """Unmount and close (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._store.close()
        finally:
            self._native_log.close()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- kvctl's contract on top of Mooncake's return codes ---------------------

    def _absent_or_error(self, key: str, what: str, code: int | None = None) -> KvctlError:
        exists = self._store.is_exist(key)
        if exists == 0:
            return ObjectNotFoundError(key)
        suffix = f" (code {code})" if code is not None else ""
        if exists < 0:
            return StoreUnavailableError(f"Mooncake {what} of {key!r} failed{suffix}; is_exist "
                                         f"failed too ({exists})", "check the Mooncake master")
        return StoreError(f"Mooncake {what} of {key!r} failed{suffix} although the key exists",
                          "see the Mooncake client log")

    def put(self, key: str, value: Buffer) -> None:
        """Store ``value``.

        Raises:
            StoreFullError: no room (Mooncake's ``NO_AVAILABLE_HANDLE``, -200): no storage
                mounted, or all of it full.
            StoreError: Mooncake returned another error code.
        """
        rc = self._store.put(key, value)
        if rc == _NO_AVAILABLE_HANDLE:
            raise StoreFullError(f"Mooncake put of {key!r} failed with code {rc} (no segment "
                                 "has room, or none is mounted)",
                                 "mount storage (global_segment_size > 0) or free some")
        if rc != 0:
            raise StoreError(f"Mooncake put of {key!r} failed with code {rc}",
                             "see the Mooncake client log (code -200s: no space)")

    def get(self, key: str) -> bytes:
        """The value of ``key``.

        Raises:
            ObjectNotFoundError: the key is absent.
            StoreError: Mooncake failed to read it.
        """
        data = self._store.get(key)
        if data:
            return bytes(data)
        size = self._store.get_size(key)
        if size == 0:
            return b""
        raise self._absent_or_error(key, "get")

    def batch_put(self, items: Sequence[tuple[str, Buffer]]) -> list[KvctlError | None]:
        """Store many objects; per item ``None`` or its error."""
        out: list[KvctlError | None] = []
        for key, value in items:
            try:
                self.put(key, value)
                out.append(None)
            except KvctlError as exc:
                out.append(exc)
        return out

    def batch_get(self, keys: Sequence[str]) -> list[bytes | KvctlError]:
        """Values of many keys; per key bytes or its error."""
        values = self._store.get_batch(list(keys))
        out: list[bytes | KvctlError] = []
        for key, data in zip(keys, values, strict=True):
            if data:
                out.append(bytes(data))
            else:
                try:
                    out.append(self.get(key))
                except KvctlError as exc:
                    out.append(exc)
        return out

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored.

        Raises:
            StoreUnavailableError: Mooncake could not tell.
        """
        rc = self._store.is_exist(key)
        if rc < 0:
            raise StoreUnavailableError(f"Mooncake is_exist({key!r}) failed with code {rc}",
                                        "check the Mooncake master")
        return bool(rc == 1)

    def remove(self, key: str) -> bool:
        """Remove ``key`` (ignoring Mooncake's read lease); ``True`` if it existed."""
        existed = self.exists(key)
        if not existed:
            return False
        rc = self._store.remove(key, True)
        if rc != 0 and self.exists(key):
            raise StoreError(f"Mooncake remove of {key!r} failed with code {rc}",
                             "the object may be under a lease; retry later")
        return True

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored.

        Raises:
            StoreUnavailableError: Mooncake could not tell for one of them.
        """
        codes = list(self._store.batch_is_exist(list(keys))) if keys else []
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if bad:
            raise StoreUnavailableError(
                f"Mooncake batch_is_exist failed for {len(bad)} of {len(keys)} keys "
                f"(first {bad[0][0]!r}: code {bad[0][1]})", "check the Mooncake master")
        return [c == 1 for c in codes]

    def remove_prefix(self, prefix: str) -> int:
        """Remove every key that starts with ``prefix`` (ignoring read leases); how many
        Mooncake removed.

        Raises:
            UsageError: an empty prefix (that would be every key of the cluster).
            StoreError: Mooncake returned an error code.
        """
        if not prefix:
            raise UsageError("refusing to remove every key of a Mooncake cluster",
                             "give a non-empty key prefix")
        rc = int(self._store.remove_by_regex("^" + re.escape(prefix), True))
        if rc < 0:
            raise StoreError(f"Mooncake remove_by_regex of prefix {prefix!r} failed with "
                             f"code {rc}", "see the Mooncake client log")
        return rc

    def replica_endpoints(self, keys: Sequence[str]) -> dict[str, list[str]]:
        """The transfer endpoints holding each stored key's memory replicas (``disk`` for
        a replica on a disk tier); keys that are absent are left out."""
        if not keys:
            return {}
        descs = self._store.batch_get_replica_desc(list(keys))
        out: dict[str, list[str]] = {}
        for key, replicas in descs.items():
            places: list[str] = []
            for replica in replicas:
                if replica.is_memory_replica():
                    desc = replica.get_memory_descriptor().buffer_descriptor
                    places.append(str(desc.transport_endpoint))
                else:
                    places.append("disk")
            if places:
                out[str(key)] = places
        return out

    # -- zero-copy (registered buffers), used by the benchmark ------------------

    def register_buffer(self, buffer: Any) -> int:
        """Register a writable buffer with Mooncake; returns its address."""
        view = memoryview(buffer).cast("B")
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        rc = self._store.register_buffer(address, view.nbytes)
        if rc != 0:
            raise StoreError(f"Mooncake register_buffer failed with code {rc}",
                             "register fewer or smaller buffers")
        self._registered.append((address, view.nbytes, buffer))
        return address

    def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Mooncake's ``batch_get_into``: bytes read per key (negative: error code)."""
        return list(self._store.batch_get_into(list(keys), list(addresses), list(sizes)))

    def batch_put_from(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Mooncake's ``batch_put_from``: 0 per key on success (negative: error code)."""
        return list(self._store.batch_put_from(list(keys), list(addresses), list(sizes)))
