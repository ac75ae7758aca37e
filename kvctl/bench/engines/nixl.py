"""NVIDIA NIXL (``nixl_agent`` with the UCX backend) as a benchmark driver.

The ``nixl`` PyPI package is a meta package that pulls a CUDA build of torch; the variant
wheels (``nixl-cu12``, ``nixl-cu13``) import and run the UCX backend on host memory (DRAM)
without a GPU. This driver imports ``nixl._api`` or, failing that, ``nixl_cu12._api`` /
``nixl_cu13._api``.

Memory: ``cpu:N`` regions register as ``DRAM`` (device 0); ``cuda:N`` regions are GPU memory
(:mod:`kvctl.bench.region`) registered and addressed as ``VRAM`` of CUDA device N,
``register_memory([(addr, len, N, "")], "VRAM")`` and ``get_xfer_descs([(addr, len, N)],
"VRAM")``, as NIXL's own examples do with torch tensors; the target tells the initiator its
location, so remote descriptors carry the target's memory type and device.

Set-up follows nixlbench's two-agent shape: the target agent runs in a spawned process
(on loopback, or under ``--role target`` on another host), registers its region and hands over
its agent metadata and buffer address; the initiator adds the remote agent, prepares one
transfer handle per (op, block size, batch, thread) once and re-posts it for every batch,
polling ``check_xfer_state`` until ``DONE``.

Transports map to UCX transport lists (``UCX_TLS``) set when each agent is created:
``tcp`` → ``tcp``, ``shm`` → ``sm,self`` (same host only), ``auto`` → UCX's own choice. The
row's transport reads ``ucx-tcp``, ``ucx-sm`` or ``ucx``. Across hosts each agent's UCX is
held to the interface of its routable address (``UCX_NET_DEVICES``, unless already set), so
the address the target published is the one the bytes use.

NIXL 1.5.1 crashes at exit in any process that created an agent (exit 139): the target
process ends with ``os._exit`` after its teardown, and the session runs this driver in a
child process of its own (:mod:`kvctl.bench.isolated`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing.connection
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NoReturn

from kvctl.bench.engines.base import BatchOutcome, PathInfo
from kvctl.bench.engines.foreign import (
    ForeignDriver,
    ForeignTarget,
    interface_of,
    launch_target,
    local_host_toward,
    stdout_to_stderr,
)
from kvctl.bench.region import LocalRegion
from kvctl.bench.spec import Op, parse_location
from kvctl.bench.target.child import ChildProcess, serve_until_stopped
from kvctl.errors import KvctlError, UnavailableError, UsageError
from kvctl.net.bind import is_loopback

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
def _ucx_env(values: dict[str, str | None]) -> Iterator[None]:
    """Set UCX variables (``None``: unset) while an agent (and its UCX context) is created."""
    old = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _ucx_settings(tls: str | None, host: str, rdma_ports: Sequence[str] | None = None,
                  location: str = "cpu:0") -> dict[str, str | None]:
    """``UCX_TLS``, and across hosts ``UCX_NET_DEVICES``: the interface holding ``host``,
    after (with UCX's own transport choice) ``rdma_ports`` (``--nic``), else the RDMA ports
    ``kvctl topo`` ranks first for ``location``, so UCX may use them (``mlx5_0:1``) rather
    than only TCP."""
    values: dict[str, str | None] = {"UCX_TLS": tls}
    if not is_loopback(host) and "UCX_NET_DEVICES" not in os.environ:
        from kvctl.transfer.transports.rdma.devices import ranked_rdma_ports

        devices: list[str] = []
        if tls is None:
            devices += list(rdma_ports if rdma_ports is not None
                            else ranked_rdma_ports(location))
        device = interface_of(host)
        if device is not None:
            devices.append(device)
        if devices:
            values["UCX_NET_DEVICES"] = ",".join(devices)
    return values


_HINT = "check UCX on this host (ucx_info -d) or try another --transport"


def _new_agent(name: str, tls: str | None, host: str, location: str = "cpu:0",
               nics: Sequence[str] = ()) -> Any:
    api = _import_api()
    with _ucx_env(_ucx_settings(tls, host, list(nics) or None, location)):
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _used(tls: str | None) -> str:
    return "ucx" if tls is None else f"ucx-{tls.split(',')[0]}"


def _agent_name(role: str, transport: str) -> str:
    # Host name and pid: agents of two hosts may share a pid, never both.
    return f"kvctl-bench-nixl-{role}-{socket.gethostname()}-{os.getpid()}-{transport}"


def nixl_memory(location: str) -> tuple[str, int]:
    """NIXL's memory type and device id for a buffer at ``location``: ``("VRAM", N)`` for
    ``cuda:N``, ``("DRAM", 0)`` for host memory."""
    kind, _, index = location.partition(":")
    return ("VRAM", int(index or 0)) if kind == "cuda" else ("DRAM", 0)


def _target_main(region_bytes: int, transport: str, host: str, location: str,
                 nics: tuple[str, ...], conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the spawned NIXL target process (ends with ``os._exit``: NIXL 1.5.1
    crashes in the interpreter's own exit once an agent existed)."""
    stdout_to_stderr()
    tls = _UCX_TLS[transport]
    try:
        region = LocalRegion(region_bytes, parse_location(location, what="remote location"))
    except KvctlError as exc:
        conn.send(("error", exc.cause, exc.hint, isinstance(exc, UnavailableError)))
        _exit_now()
    mem, device = nixl_memory(location)
    name = _agent_name("target", transport)
    try:
        agent = _new_agent(name, tls, host, location, nics)
        registered = agent.register_memory([(region.address, region_bytes, device, "")], mem)
        metadata = agent.get_agent_metadata()
    except Exception as exc:  # noqa: BLE001 - NIXL's own error types, sent on as a typed error
        conn.send(("error", f"NIXL target failed to start with UCX_TLS={tls or 'default'}: "
                   f"{type(exc).__name__}: {exc}", _HINT, True))
        _exit_now()
    conn.send(("ready", ForeignTarget(
        engine="nixl", transport=transport, used=_used(tls), host=host, address=region.address,
        region_bytes=region_bytes, agent=name, agent_metadata=bytes(metadata),
        location=location)))
    serve_until_stopped(conn)
    # Tear down in reverse order: NIXL must let go of the memory before it is freed.
    agent.deregister_memory(registered)
    del agent
    region.close()
    _exit_now()


def _exit_now() -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class NixlDriver(ForeignDriver):
    """Drives a NIXL agent with the UCX backend (target agent in a spawned process)."""

    name: ClassVar[str] = "nixl"
    label: ClassVar[str] = "NIXL"
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

    @classmethod
    def check_transport(cls, transport: str, *, cross_host: bool) -> None:
        if transport not in _UCX_TLS:
            raise UnavailableError(f"the NIXL driver has no {transport!r} transport",
                                   "use --transport tcp, shm or auto")
        if cross_host and transport == "shm":
            raise UnavailableError("NIXL over UCX shared memory (sm) reaches same-host peers "
                                   "only", "use --transport tcp or auto across hosts")

    @classmethod
    def launch_target(cls, region_bytes: int, transport: str, host: str,
                      location: str = "cpu:0", nics: Sequence[str] = ()
                      ) -> tuple[ChildProcess, ForeignTarget]:
        cls.check_transport(transport, cross_host=not is_loopback(host))
        return launch_target(_target_main, (region_bytes, transport, host, location,
                                            tuple(nics)),
                             name="NIXL target",
                             hint="check UCX on this host (ucx_info -d)")

    def __init__(self) -> None:
        super().__init__()
        self._agent: Any = None
        self._remote_name = ""
        self._remote_address = 0
        self._local_address = 0
        self._local_mem: tuple[str, int] = ("DRAM", 0)
        self._remote_mem: tuple[str, int] = ("DRAM", 0)
        self._handles: dict[tuple[str, int, int, int], Any] = {}
        self._registered: Any = None

    def _connect(self, target: ForeignTarget) -> PathInfo:
        plan = self._require_plan()
        tls = _UCX_TLS[target.transport]
        size = plan.region_bytes + _POKE_BYTES
        region = self._local_region(_POKE_BYTES)
        self._local_address = region.address
        self._local_mem = mem, device = nixl_memory(str(plan.local))
        self._remote_mem = nixl_memory(target.location)
        try:
            agent = _new_agent(_agent_name("init", target.transport), tls,
                               local_host_toward(target.host), str(plan.local), plan.nics)
            self._agent = agent
            self._registered = agent.register_memory(
                [(self._local_address, size, device, "")], mem)
            remote = agent.add_remote_agent(target.agent_metadata)
        except KvctlError:
            raise
        except Exception as exc:  # NIXL's own error types, converted
            raise UnavailableError(
                f"NIXL agent failed with UCX_TLS={tls or 'default'}: {type(exc).__name__}: "
                f"{exc}", _HINT) from exc
        self._remote_name = remote.decode() if isinstance(remote, bytes) else str(remote)
        self._remote_address = target.address
        self._handles.clear()
        return PathInfo(target.used, f"UCX_TLS={tls or 'default'} -> {target.host} "
                        f"(agent {self._remote_name})", loopback=is_loopback(target.host),
                        medium=target.transport if tls is not None else "")

    def _handle(self, op: Op, block: int, batch: int, thread: int, *,
                local_base: int | None = None, remote_base: int | None = None) -> Any:
        key = (op.value, block, batch, thread)
        handle = self._handles.get(key) if local_base is None else None
        if handle is None:
            stride = self._require_plan().thread_stride_bytes
            base = thread * stride
            lbase = self._local_address + (base if local_base is None else local_base)
            rbase = self._remote_address + (base if remote_base is None else remote_base)
            (lmem, ldev), (rmem, rdev) = self._local_mem, self._remote_mem
            local = self._agent.get_xfer_descs(
                [(lbase + i * block, block, ldev) for i in range(batch)], lmem)
            remote = self._agent.get_xfer_descs(
                [(rbase + i * block, block, rdev) for i in range(batch)], rmem)
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
        self._ready(transport)
        ok = self._post(self._handle(op, block_size_bytes, batch_size, thread_index))
        if not ok:
            _log.warning("NIXL %s batch of %d failed or timed out", op.value, batch_size)
        if ok:
            return BatchOutcome(errors=0, retries=None)
        return BatchOutcome(errors=batch_size, retries=None,
                            cause=f"NIXL {op.value} batch failed or did not finish within "
                                  f"{self._require_plan().timeout_s:g} s")

    def poke_remote(self, transport: str, offset: int, data: bytes) -> None:
        self._ready(transport)
        if len(data) > _POKE_BYTES or self._region is None:
            raise UsageError(f"poke_remote writes at most {_POKE_BYTES} bytes", "split the data")
        plan = self._require_plan()
        self._region.write(plan.region_bytes, data)
        handle = self._handle(Op.WRITE, len(data), 1, 0, local_base=plan.region_bytes,
                              remote_base=offset)
        try:
            if not self._post(handle):
                raise NixlError(f"NIXL write of {len(data)} bytes failed",
                                "check that the target process is alive")
        finally:
            self._agent.release_xfer_handle(handle)

    def _release(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            for handle in self._handles.values():
                agent.release_xfer_handle(handle)
            self._handles.clear()
            if self._remote_name:
                with contextlib.suppress(RuntimeError, KeyError):
                    agent.remove_remote_agent(self._remote_name)
            if self._registered is not None:
                agent.deregister_memory(self._registered)
            del agent
        self._registered = None
        self._remote_name = ""
