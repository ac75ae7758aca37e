"""The real Mooncake transfer engine (PyPI ``mooncake-transfer-engine[-non-cuda]``) as a driver.

Set-up mirrors how serving stacks use it: both sides call ``initialize(host, "P2PHANDSHAKE",
protocol, "")`` (no etcd), register their memory with ``register_memory``, and the initiator
addresses the target by its session id ``host:rpc_port`` plus the target buffer's address,
moving batches with ``batch_transfer_sync_read/write``. The target runs in a separate,
spawned process on 127.0.0.1; ``MC_TCP_BIND_ADDRESS=127.0.0.1`` keeps Mooncake from
advertising the first active interface's address instead. ``MC_LOG_LEVEL`` defaults to
``ERROR`` to keep Mooncake's glog lines off the terminal.

Mooncake's Python API reports a batch as a whole (0 or a negative code), so a failed batch
counts all its requests as errors; it does not report retries.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import mmap
import multiprocessing.connection
import os
from typing import Any, ClassVar

from kvctl.bench.child import ChildProcess, serve_until_stopped
from kvctl.bench.engines.base import BatchOutcome, DriverPlan, EngineDriver, PathInfo
from kvctl.bench.spec import Op
from kvctl.errors import KvctlError, UnavailableError, UsageError

_log = logging.getLogger("kvctl.bench")

PACKAGE = "mooncake-transfer-engine-non-cuda"
_POKE_BYTES = 4096
_PROTOCOLS = {"tcp": "tcp", "auto": "tcp", "rdma": "rdma"}


class MooncakeError(KvctlError):
    """Mooncake returned an error code."""


def _env_defaults() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _address_of(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _import_engine() -> Any:
    _env_defaults()  # Mooncake reads its logging settings when the module loads
    return importlib.import_module("mooncake.engine")


def _new_engine(protocol: str) -> Any:
    module = _import_engine()
    engine = module.TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise MooncakeError(f"Mooncake initialize(127.0.0.1, P2PHANDSHAKE, {protocol}) "
                            f"returned {rc}",
                            "see Mooncake's log (MC_LOG_LEVEL=INFO) for the cause")
    return engine


def _target_main(region_bytes: int, protocol: str,
                 conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the spawned Mooncake target process."""
    _env_defaults()
    try:
        engine = _new_engine(protocol)
        mm = mmap.mmap(-1, region_bytes)
        address = _address_of(mm)
        rc = engine.register_memory(address, region_bytes)
        if rc != 0:
            raise MooncakeError(f"Mooncake register_memory({region_bytes} bytes) returned {rc}",
                                "check memlock limits (ulimit -l) and free memory")
        session = f"127.0.0.1:{engine.get_rpc_port()}"
    except KvctlError as exc:
        conn.send(("error", exc.cause, exc.hint))
        return
    conn.send(("ready", session, address))
    serve_until_stopped(conn)
    engine.unregister_memory(address)


class MooncakeDriver(EngineDriver):
    """Drives ``mooncake.engine.TransferEngine`` (target in a spawned process)."""

    name: ClassVar[str] = "mooncake"
    install_hint: ClassVar[str] = (
        f"pip install {PACKAGE} (or 'pip install kvctl[engines]'); it needs libibverbs1 "
        "(apt-get install libibverbs1)")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("mooncake") is None:
            return f"the Python package {PACKAGE} is not installed"
        try:
            _import_engine()
        except ImportError as exc:
            return f"mooncake.engine does not load ({exc})"
        return None

    def __init__(self) -> None:
        self._plan: DriverPlan | None = None
        self._protocol: str | None = None
        self._engine: Any = None
        self._mm: mmap.mmap | None = None
        self._local_address = 0
        self._session = ""
        self._remote_address = 0
        self._child: ChildProcess | None = None
        self._lists: dict[tuple[int, int, int], tuple[list[int], list[int], list[int]]] = {}

    def start(self, plan: DriverPlan) -> None:
        plan.require_loopback_host_memory("Mooncake")
        self._plan = plan

    def prepare(self, transport: str) -> PathInfo:
        protocol = _PROTOCOLS.get(transport)
        if protocol is None:
            raise UnavailableError(
                f"Mooncake's Python TransferEngine has no {transport!r} transport here",
                "compare engines with --transport tcp (or auto)")
        if protocol == "rdma":
            from kvctl.transfer.transports.rdma import rdma_unavailable_reason

            reason = rdma_unavailable_reason()
            if reason is not None:
                raise UnavailableError(f"Mooncake rdma unavailable: {reason}",
                                       "use --transport tcp on hosts without RDMA")
        if protocol != self._protocol:
            self._stop()
            self._launch(protocol)
        return PathInfo(protocol, f"{protocol} -> {self._session}", loopback=True)

    def _launch(self, protocol: str) -> None:
        plan = self._require_plan()
        _env_defaults()
        self._child = ChildProcess(_target_main, (plan.region_bytes, protocol),
                                   name="Mooncake target",
                                   hint="rerun with MC_LOG_LEVEL=INFO to see Mooncake's log")
        message = self._child.start(60)
        if message[0] == "error":
            self._stop()
            raise MooncakeError(message[1], message[2])
        _, self._session, self._remote_address = message
        engine = _new_engine(protocol)
        size = plan.region_bytes + _POKE_BYTES
        mm = mmap.mmap(-1, size)
        address = _address_of(mm)
        rc = engine.register_memory(address, size)
        if rc != 0:
            self._stop()
            raise MooncakeError(f"Mooncake register_memory({size} bytes) returned {rc}",
                                "check memlock limits (ulimit -l) and free memory")
        self._engine, self._mm, self._local_address = engine, mm, address
        self._protocol = protocol
        self._lists.clear()

    def _addresses(self, block: int, batch: int, thread: int
                   ) -> tuple[list[int], list[int], list[int]]:
        key = (block, batch, thread)
        got = self._lists.get(key)
        if got is None:
            base = thread * self._require_plan().thread_stride_bytes
            offsets = [base + i * block for i in range(batch)]
            got = ([self._local_address + o for o in offsets],
                   [self._remote_address + o for o in offsets], [block] * batch)
            self._lists[key] = got
        return got

    def run_batch(self, transport: str, op: Op, block_size_bytes: int, batch_size: int,
                  thread_index: int) -> BatchOutcome:
        if self._engine is None or _PROTOCOLS.get(transport) != self._protocol:
            self.prepare(transport)
        local, remote, lengths = self._addresses(block_size_bytes, batch_size, thread_index)
        if op is Op.WRITE:
            rc = self._engine.batch_transfer_sync_write(self._session, local, remote, lengths)
        else:
            rc = self._engine.batch_transfer_sync_read(self._session, local, remote, lengths)
        if rc != 0:
            _log.warning("Mooncake batch_transfer_sync_%s returned %d", op.value, rc)
            return BatchOutcome(errors=batch_size, retries=None)
        return BatchOutcome(errors=0, retries=None)

    def local_view(self, offset: int, length: int) -> memoryview:
        if self._mm is None:
            raise UsageError("Mooncake driver not prepared", "call prepare() first")
        return memoryview(self._mm)[offset : offset + length]

    def poke_remote(self, transport: str, offset: int, data: bytes) -> None:
        if self._engine is None or _PROTOCOLS.get(transport) != self._protocol:
            self.prepare(transport)
        if len(data) > _POKE_BYTES or self._mm is None:
            raise UsageError(f"poke_remote writes at most {_POKE_BYTES} bytes", "split the data")
        plan = self._require_plan()
        self._mm[plan.region_bytes : plan.region_bytes + len(data)] = data
        rc = self._engine.batch_transfer_sync_write(
            self._session, [self._local_address + plan.region_bytes],
            [self._remote_address + offset], [len(data)])
        if rc != 0:
            raise MooncakeError(f"Mooncake write of {len(data)} bytes returned {rc}",
                                "check that the target process is alive")

    def _require_plan(self) -> DriverPlan:
        if self._plan is None:
            raise UsageError("Mooncake driver not started", "call start() first")
        return self._plan

    def _stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None and self._local_address:
            engine.unregister_memory(self._local_address)
        self._local_address = 0
        self._protocol = None
        child, self._child = self._child, None
        if child is not None:
            child.stop()
        del engine  # Mooncake tears down when the engine object goes

    def close(self) -> None:
        self._stop()
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                _log.debug("local mapping still exported; left to the garbage collector")
