"""Drive a real Mooncake Store through ``MooncakeDistributedStore`` (TCP protocol).

The package is ``mooncake-transfer-engine-non-cuda`` (or ``mooncake-transfer-engine``),
imported lazily: when it is missing, :class:`MooncakeUnavailableError` says how to install
it. Every Mooncake process kvctl starts or connects stays on loopback unless told otherwise:
``MC_TCP_BIND_ADDRESS`` is set to the local hostname before the engine loads.

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
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import KvctlError, UnavailableError, UsageError
from kvctl.store.errors import ObjectNotFoundError, StoreError, StoreUnavailableError

_log = logging.getLogger("kvctl.store.mooncake")

Buffer = bytes | bytearray | memoryview


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
    """

    def __init__(self, *, host: str = "127.0.0.1", eviction_high_watermark: float = 0.95,
                 log_path: Path | None = None, ready_timeout_s: float = 15.0,
                 storage_bytes: int = 0) -> None:
        binary = find_mooncake_binary("mooncake_master")
        self.host = host
        self.port = _free_port(host)
        metrics = _free_port(host)
        args = [str(binary), f"--rpc_port={self.port}", f"--rpc_address={host}",
                f"--metrics_port={metrics}", f"--metrics_host={host}",
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


def _check_reachable(master: str, timeout_s: float = 3.0) -> None:
    """Fail fast when nothing accepts connections at the master's ``HOST:PORT``."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"Mooncake master {master!r} is not HOST:PORT",
                         "give the master's RPC address, e.g. 10.0.0.1:50051")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise MooncakeUnavailableError(
            f"cannot reach mooncake_master at {master}: {exc.strerror or exc}",
            "check that mooncake_master runs there and the port is open "
            "(kvctl starts one when --master is not given)") from exc


class MooncakeStore:
    """A ``MooncakeDistributedStore`` client over TCP; with ``global_segment_bytes > 0`` it
    also contributes memory (objects placed there vanish when it closes).

    Args:
        master: Mooncake master ``HOST:PORT``.
        local_hostname: this client's address as peers see it (loopback by default).
        metadata_server: ``P2PHANDSHAKE`` (no metadata server) or an etcd/HTTP URL.
        global_segment_bytes: memory this client contributes to the pool.
        local_buffer_bytes: the client's registered transfer buffer.
        protocol: ``tcp`` (``rdma`` where the hardware has it).

    Raises:
        MooncakeUnavailableError: the package is missing or ``setup`` failed.
    """

    def __init__(self, master: str, *, local_hostname: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", global_segment_bytes: int = 256 << 20,
                 local_buffer_bytes: int = 128 << 20, protocol: str = "tcp") -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        cls = _load()
        _check_reachable(master)  # setup() retries a dead master for about 90 s
        self.master = master
        self._store = cls()
        rc = self._store.setup(local_hostname, metadata_server, global_segment_bytes,
                               local_buffer_bytes, protocol, "", master)
        if rc != 0:
            raise MooncakeUnavailableError(
                f"MooncakeDistributedStore.setup against {master} failed with code {rc}",
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
        self._store.close()

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
            StoreError: Mooncake returned an error code.
        """
        rc = self._store.put(key, value)
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
