"""NVIDIA NIXL (``nixl_agent`` with the UCX backend) as a benchmark driver.

The ``nixl`` PyPI package is a meta package that pulls a CUDA build of torch; the variant
wheels (``nixl-cu12``, ``nixl-cu13``) import and run the UCX backend on host memory (DRAM)
without a GPU. This driver imports ``nixl._api`` or, failing that, ``nixl_cu12._api`` /
``nixl_cu13._api``.

Set-up follows nixlbench's two-agent shape: the target agent runs in a spawned process,
registers its region and hands over its agent metadata and buffer address; the initiator
adds the remote agent, prepares one transfer handle per (op, block size, batch, thread) once
and re-posts it for every batch, polling ``check_xfer_state`` until ``DONE``.

Transports map to UCX transport lists (``UCX_TLS``) set when each agent is created:
``tcp`` → ``tcp``, ``shm`` → ``sm,self``, ``auto`` → UCX's own choice. The row's transport
reads ``ucx-tcp``, ``ucx-sm`` or ``ucx``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import mmap
import multiprocessing.connection
import os
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from kvctl.bench.child import ChildProcess, serve_until_stopped
from kvctl.bench.engines.base import BatchOutcome, DriverPlan, EngineDriver, PathInfo
from kvctl.bench.spec import Op
from kvctl.errors import KvctlError, UnavailableError, UsageError

_log = logging.getLogger("kvctl.bench")

_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_UCX_TLS = {"tcp": "tcp", "shm": "sm,self", "auto": None}
_POKE_BYTES = 4096


class NixlError(KvctlError):
    """NIXL reported an error state."""


def _import_api() -> Any:
    """The first importable NIXL Python API module.

    Raises:
        ImportError: none of them imports (the message lists why each failed).
    """
    # NIXL logs INFO lines to stdout unless told otherwise: keep stdout for results.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    reasons: list[str] = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            reasons.append(f"{name}: {exc}")
    raise ImportError("; ".join(reasons))


@contextlib.contextmanager
def _ucx_tls(value: str | None) -> Iterator[None]:
    """Set ``UCX_TLS`` while an agent (and its UCX context) is created."""
    old = os.environ.get("UCX_TLS")
    if value is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old


def _new_agent(name: str, tls: str | None) -> Any:
    api = _import_api()
    with _ucx_tls(tls):
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _address_of(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _target_main(region_bytes: int, tls: str | None,
                 conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the spawned NIXL target process."""
    mm = mmap.mmap(-1, region_bytes)
    address = _address_of(mm)
    try:
        agent = _new_agent(f"kvctl-bench-nixl-target-{os.getpid()}", tls)
        registered = agent.register_memory([(address, region_bytes, 0, "")], "DRAM")
        conn.send(("ready", agent.get_agent_metadata(), address))
    except Exception as exc:  # noqa: BLE001 - NIXL's own error types, sent on as a typed error
        conn.send(("error", f"NIXL target failed to start with UCX_TLS={tls or 'default'}: "
                   f"{type(exc).__name__}: {exc}",
                   "check UCX on this host (ucx_info -d) or try another --transport"))
        return
    serve_until_stopped(conn)
    # Tear down in reverse order: NIXL must let go of the memory before it is unmapped.
    agent.deregister_memory(registered)
    del agent


class NixlDriver(EngineDriver):
    """Drives a NIXL agent with the UCX backend (target agent in a spawned process)."""

    name: ClassVar[str] = "nixl"
    install_hint: ClassVar[str] = (
        "pip install --no-deps nixl-cu12 numpy (the 'nixl' meta package pulls a CUDA torch; "
        "the cu12 wheel runs UCX on host memory without a GPU)")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            _import_api()
        except ImportError as exc:
            return f"no NIXL Python API is importable ({exc})"
        return None

    def __init__(self) -> None:
        self._plan: DriverPlan | None = None
        self._transport: str | None = None
        self._agent: Any = None
        self._remote_name = ""
        self._remote_address = 0
        self._mm: mmap.mmap | None = None
        self._local_address = 0
        self._child: ChildProcess | None = None
        self._handles: dict[tuple[str, int, int, int], Any] = {}
        self._registered: Any = None

    def start(self, plan: DriverPlan) -> None:
        plan.require_loopback_host_memory("NIXL")
        self._plan = plan

    def prepare(self, transport: str) -> PathInfo:
        if transport not in _UCX_TLS:
            raise UnavailableError(f"the NIXL driver has no {transport!r} transport",
                                   "use --transport tcp, shm or auto")
        if transport != self._transport:
            self._stop()
            self._launch(transport)
        tls = _UCX_TLS[transport]
        used = "ucx" if tls is None else f"ucx-{tls.split(',')[0]}"
        return PathInfo(used, f"UCX_TLS={tls or 'default'} -> {self._remote_name}",
                        loopback=True, medium=transport if tls is not None else "")

    def _launch(self, transport: str) -> None:
        plan = self._require_plan()
        tls = _UCX_TLS[transport]
        self._child = ChildProcess(_target_main, (plan.region_bytes, tls), name="NIXL target",
                                   hint="check UCX on this host (ucx_info -d)")
        message = self._child.start(60)
        if message[0] == "error":
            self._stop()
            raise UnavailableError(message[1], message[2])
        _, metadata, self._remote_address = message
        size = plan.region_bytes + _POKE_BYTES
        mm = mmap.mmap(-1, size)
        address = _address_of(mm)
        try:
            agent = _new_agent(f"kvctl-bench-nixl-init-{os.getpid()}-{transport}", tls)
            self._registered = agent.register_memory([(address, size, 0, "")], "DRAM")
            self._remote_name = agent.add_remote_agent(metadata)
        except Exception as exc:  # NIXL's own error types, converted
            self._stop()
            raise UnavailableError(
                f"NIXL agent failed with UCX_TLS={tls or 'default'}: {type(exc).__name__}: "
                f"{exc}", "check UCX on this host (ucx_info -d) or try another --transport"
            ) from exc
        if isinstance(self._remote_name, bytes):
            self._remote_name = self._remote_name.decode()
        self._agent, self._mm, self._local_address = agent, mm, address
        self._transport = transport
        self._handles.clear()

    def _handle(self, op: Op, block: int, batch: int, thread: int, *,
                local_base: int | None = None, remote_base: int | None = None) -> Any:
        key = (op.value, block, batch, thread)
        handle = self._handles.get(key) if local_base is None else None
        if handle is None:
            stride = self._require_plan().thread_stride_bytes
            base = thread * stride
            lbase = self._local_address + (base if local_base is None else local_base)
            rbase = self._remote_address + (base if remote_base is None else remote_base)
            local = self._agent.get_xfer_descs(
                [(lbase + i * block, block, 0) for i in range(batch)], "DRAM")
            remote = self._agent.get_xfer_descs(
                [(rbase + i * block, block, 0) for i in range(batch)], "DRAM")
            handle = self._agent.initialize_xfer(op.name, local, remote, self._remote_name)
            if local_base is None:
                self._handles[key] = handle
        return handle

    def _post(self, handle: Any) -> bool:
        state = self._agent.transfer(handle)
        deadline = time.monotonic() + self._require_plan().timeout_s
        polls = 0
        while state == "PROC":
            polls += 1
            if polls % 1024 == 0 and time.monotonic() > deadline:
                return False
            state = self._agent.check_xfer_state(handle)
        return bool(state == "DONE")

    def run_batch(self, transport: str, op: Op, block_size_bytes: int, batch_size: int,
                  thread_index: int) -> BatchOutcome:
        if self._agent is None or transport != self._transport:
            self.prepare(transport)
        ok = self._post(self._handle(op, block_size_bytes, batch_size, thread_index))
        if not ok:
            _log.warning("NIXL %s batch of %d failed or timed out", op.value, batch_size)
        return BatchOutcome(errors=0 if ok else batch_size, retries=None)

    def local_view(self, offset: int, length: int) -> memoryview:
        if self._mm is None:
            raise UsageError("NIXL driver not prepared", "call prepare() first")
        return memoryview(self._mm)[offset : offset + length]

    def poke_remote(self, transport: str, offset: int, data: bytes) -> None:
        if self._agent is None or transport != self._transport:
            self.prepare(transport)
        if len(data) > _POKE_BYTES or self._mm is None:
            raise UsageError(f"poke_remote writes at most {_POKE_BYTES} bytes", "split the data")
        plan = self._require_plan()
        self._mm[plan.region_bytes : plan.region_bytes + len(data)] = data
        handle = self._handle(Op.WRITE, len(data), 1, 0, local_base=plan.region_bytes,
                              remote_base=offset)
        try:
            if not self._post(handle):
                raise NixlError(f"NIXL write of {len(data)} bytes failed",
                                "check that the target process is alive")
        finally:
            self._agent.release_xfer_handle(handle)

    def _require_plan(self) -> DriverPlan:
        if self._plan is None:
            raise UsageError("NIXL driver not started", "call start() first")
        return self._plan

    def _stop(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            for handle in self._handles.values():
                agent.release_xfer_handle(handle)
            self._handles.clear()
            with contextlib.suppress(RuntimeError, KeyError):
                agent.remove_remote_agent(self._remote_name)
            if self._registered is not None:
                agent.deregister_memory(self._registered)
            self._registered = None
            del agent
        self._transport = None
        child, self._child = self._child, None
        if child is not None:
            child.stop()

    def close(self) -> None:
        self._stop()
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                _log.debug("local mapping still exported; left to the garbage collector")
