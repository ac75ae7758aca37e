"""The real Mooncake transfer engine (PyPI ``mooncake-transfer-engine[-non-cuda]``) as a driver.

Set-up mirrors how serving stacks use it: both sides call ``initialize(host, "P2PHANDSHAKE",
protocol, "")`` (no etcd), register their memory with ``register_memory``, and the initiator
addresses the target by its session id ``host:rpc_port`` plus the target buffer's address,
moving batches with ``batch_transfer_sync_read/write``. The target is a spawned process: on
127.0.0.1 for a loopback run, at the host's routable address under ``--role target``
(:mod:`kvctl.bench.target.serve`). ``host`` is that address on the target and the address
that routes to the target on the initiator; ``MC_TCP_BIND_ADDRESS`` is set to the same, since
Mooncake otherwise advertises its first active interface's address. ``MC_LOG_LEVEL``
defaults to ``ERROR`` to keep Mooncake's glog lines off the terminal.

Mooncake's ``initialize`` ignores its protocol argument (it only picks a buffer allocator):
it installs RDMA whenever it finds an active HCA, else TCP, unless ``MC_FORCE_TCP`` is set.
So ``--transport tcp`` sets ``MC_FORCE_TCP=1``; ``rdma`` and ``auto`` leave it unset and the
row is labelled with what Mooncake installed (read back from its topology: HCAs found means
RDMA); ``rdma`` is skipped when Mooncake installed TCP, and both sides must agree.

Memory: ``cpu:N`` regions are host mappings; ``cuda:N`` regions are GPU memory
(:mod:`kvctl.bench.region`) whose device pointer goes to ``register_memory`` as is:
Mooncake's CUDA build tells device memory by ``cudaPointerGetAttributes`` (its TCP transport
stages it with ``cudaMemcpy``, its RDMA transport registers it). The ``-non-cuda`` wheel
would treat the pointer as host memory, so GPU locations are refused with it. For ``rdma``
and ``auto`` Mooncake's ``device_name`` is ``--nic`` when given, else the NICs ``kvctl topo``
ranks first for the local buffer's location (a GPU's PIX/PXB NICs).

Mooncake's Python API reports a batch as a whole (0 or a negative code), so a failed batch
counts all its requests as errors; it does not report retries.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import logging
import multiprocessing.connection
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvctl.bench.engines.base import BatchOutcome, DriverPlan, PathInfo
from kvctl.bench.engines.foreign import (
    ForeignDriver,
    ForeignTarget,
    launch_target,
    local_host_toward,
    stdout_to_stderr,
)
from kvctl.bench.region import LocalRegion
from kvctl.bench.spec import Op, parse_location
from kvctl.bench.target.child import ChildProcess, serve_until_stopped
from kvctl.errors import KvctlError, UnavailableError, UsageError
from kvctl.net.advertise import join_host_port
from kvctl.net.bind import is_loopback

_log = logging.getLogger("kvctl.bench")

PACKAGE = "mooncake-transfer-engine-non-cuda"
_POKE_BYTES = 4096
#: Transports this driver runs, and the protocol argument each passes to ``initialize``.
_PROTOCOLS = {"tcp": "tcp", "auto": "tcp", "rdma": "rdma"}
_HINT = "rerun with MC_LOG_LEVEL=INFO to see Mooncake's log"


class MooncakeError(KvctlError):
    """Mooncake returned an error code."""


def _env_defaults() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _import_engine() -> Any:
    _env_defaults()  # Mooncake reads its logging settings when the module loads
    return importlib.import_module("mooncake.engine")


def installed_transport(topology_json: str, env: Mapping[str, str]) -> str:
    """The transport Mooncake's ``initialize`` installed, as its own rule decides it:
    ``tcp`` under ``MC_FORCE_TCP``, ``rdma`` when it found an HCA (or ``MC_FORCE_HCA``),
    else ``tcp``.

    Args:
        topology_json: ``TransferEngine.get_local_topology()`` (location: [[preferred HCAs],
            [other HCAs]]).
        env: the environment ``initialize`` ran with.

    Raises:
        MooncakeError: the topology is unreadable.
    """
    if env.get("MC_FORCE_TCP"):
        return "tcp"
    if env.get("MC_FORCE_HCA"):
        return "rdma"
    try:
        topology = json.loads(topology_json)
        hcas = {h for lists in topology.values() for hca_list in lists for h in hca_list}
    except (ValueError, AttributeError, TypeError) as exc:
        raise MooncakeError(f"cannot tell which transport Mooncake installed: its topology "
                            f"is unreadable ({exc})", _HINT) from None
    return "rdma" if hcas else "tcp"


def device_filter(transport: str, env: Mapping[str, str], ranked: Sequence[str]) -> str:
    """Mooncake's ``device_name`` (a comma list of HCAs; empty: every HCA it finds):
    ``MOONCAKE_DEVICE`` when set, else for ``rdma``/``auto`` the RDMA NICs ``kvctl topo``
    ranks first for the buffers (host memory here), else empty."""
    if env.get("MOONCAKE_DEVICE"):
        return env["MOONCAKE_DEVICE"]
    if transport == "tcp":
        return ""
    return ",".join(dict.fromkeys(name.partition(":")[0] for name in ranked))


def cuda_build() -> bool:
    """Whether the installed Mooncake wheel is a CUDA build (not ``...-non-cuda``)."""
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    return any(not name.lower().replace("_", "-").endswith("non-cuda") for name in names)


def _require_cuda_build(location: str) -> None:
    if location.startswith("cuda") and not cuda_build():
        raise UnavailableError(
            f"Mooncake cannot register {location} memory here: the installed wheel is the "
            "non-CUDA build (mooncake-transfer-engine-non-cuda), which would take a device "
            "pointer for host memory", "pip install mooncake-transfer-engine (the CUDA "
            "build) for GPU buffers, or use --local-location/--remote-location cpu:0")


def _new_engine(transport: str, host: str, location: str = "cpu:0",
                nics: Sequence[str] = ()) -> tuple[Any, str]:
    """A Mooncake engine initialised at ``host`` for ``transport``, and what it installed;
    its HCAs are ``nics`` when given, else topo's first choice for ``location``.

    Raises:
        MooncakeError: ``initialize`` failed.
        UnavailableError: ``rdma`` was asked and Mooncake installed TCP.
    """
    module = _import_engine()
    if transport == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"
    else:
        os.environ.pop("MC_FORCE_TCP", None)
    os.environ["MC_TCP_BIND_ADDRESS"] = host
    protocol = _PROTOCOLS[transport]
    from kvctl.transfer.transports.rdma.devices import ranked_rdma_ports

    ranked = list(nics) or ranked_rdma_ports(location)
    devices = device_filter(transport, os.environ, [] if transport == "tcp" else ranked)
    if devices:
        _log.info("Mooncake device_name %s (--nic, topo's ranking for %s, or "
                  "MOONCAKE_DEVICE)", devices, location)
    engine = module.TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, devices)
    if rc != 0:
        raise MooncakeError(f"Mooncake initialize({host}, P2PHANDSHAKE, {protocol}, "
                            f"{devices!r}) returned {rc}", _HINT)
    used = installed_transport(engine.get_local_topology(), os.environ)
    if transport == "rdma" and used != "rdma":
        raise UnavailableError("Mooncake rdma unavailable: it found no active RDMA device "
                               "(HCA) and installed tcp", "use --transport tcp on hosts "
                               "without RDMA, or check the HCAs with ibv_devinfo")
    return engine, used


def _register(engine: Any, region: LocalRegion) -> None:
    rc = engine.register_memory(region.address, region.size)
    if rc != 0:
        raise MooncakeError(f"Mooncake register_memory({region.size} bytes of "
                            f"{region.location}) returned {rc}",
                            "check memlock limits (ulimit -l) and free memory")


def _target_main(region_bytes: int, transport: str, host: str, location: str,
                 nics: tuple[str, ...], conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the spawned Mooncake target process."""
    stdout_to_stderr()
    _env_defaults()
    region: LocalRegion | None = None
    try:
        _require_cuda_build(location)
        region = LocalRegion(region_bytes, parse_location(location, what="remote location"))
        engine, used = _new_engine(transport, host, location, nics)
        _register(engine, region)
        port = engine.get_rpc_port()
    except KvctlError as exc:
        conn.send(("error", exc.cause, exc.hint, isinstance(exc, UnavailableError)))
        if region is not None:
            region.close()
        return
    conn.send(("ready", ForeignTarget(
        engine="mooncake", transport=transport, used=used, host=host, address=region.address,
        region_bytes=region_bytes, session=join_host_port(host, port), location=location)))
    serve_until_stopped(conn)
    engine.unregister_memory(region.address)
    del engine  # before the memory it served goes
    region.close()


class MooncakeDriver(ForeignDriver):
    """Drives ``mooncake.engine.TransferEngine`` (target in a spawned process)."""

    name: ClassVar[str] = "mooncake"
    label: ClassVar[str] = "Mooncake"
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

    @classmethod
    def check_transport(cls, transport: str, *, cross_host: bool) -> None:
        if transport not in _PROTOCOLS:
            raise UnavailableError(
                f"Mooncake's Python TransferEngine has no {transport!r} transport here",
                "compare engines with --transport tcp (or auto, rdma)")

    @classmethod
    def check_locations(cls, plan: DriverPlan) -> None:
        for where in (plan.local, plan.remote):
            _require_cuda_build(str(where))
        super().check_locations(plan)

    @classmethod
    def launch_target(cls, region_bytes: int, transport: str, host: str,
                      location: str = "cpu:0", nics: Sequence[str] = ()
                      ) -> tuple[ChildProcess, ForeignTarget]:
        cls.check_transport(transport, cross_host=not is_loopback(host))
        return launch_target(_target_main, (region_bytes, transport, host, location,
                                            tuple(nics)),
                             name="Mooncake target", hint=_HINT)

    def __init__(self) -> None:
        super().__init__()
        self._engine: Any = None
        self._local_address = 0
        self._session = ""
        self._remote_address = 0
        self._lists: dict[tuple[int, int, int], tuple[list[int], list[int], list[int]]] = {}

    def _connect(self, target: ForeignTarget) -> PathInfo:
        plan = self._require_plan()
        engine, used = _new_engine(target.transport, local_host_toward(target.host),
                                   str(plan.local), plan.nics)
        self._engine = engine
        if used != target.used:
            raise UnavailableError(
                f"Mooncake installed {used} here but {target.used} on the target "
                f"({target.session})", f"use --transport tcp on both hosts, or {target.used} "
                "on both")
        region = self._local_region(_POKE_BYTES)
        _register(engine, region)
        self._local_address = region.address
        self._session, self._remote_address = target.session, target.address
        self._lists.clear()
        return PathInfo(used, f"{used} -> {target.session}", loopback=is_loopback(target.host))

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
        self._ready(transport)
        local, remote, lengths = self._addresses(block_size_bytes, batch_size, thread_index)
        if op is Op.WRITE:
            rc = self._engine.batch_transfer_sync_write(self._session, local, remote, lengths)
        else:
            rc = self._engine.batch_transfer_sync_read(self._session, local, remote, lengths)
        if rc != 0:
            _log.warning("Mooncake batch_transfer_sync_%s returned %d", op.value, rc)
            return BatchOutcome(errors=batch_size, retries=None,
                                cause=f"Mooncake batch_transfer_sync_{op.value} returned {rc}")
        return BatchOutcome(errors=0, retries=None)

    def poke_remote(self, transport: str, offset: int, data: bytes) -> None:
        self._ready(transport)
        if len(data) > _POKE_BYTES or self._region is None:
            raise UsageError(f"poke_remote writes at most {_POKE_BYTES} bytes", "split the data")
        plan = self._require_plan()
        self._region.write(plan.region_bytes, data)
        rc = self._engine.batch_transfer_sync_write(
            self._session, [self._local_address + plan.region_bytes],
            [self._remote_address + offset], [len(data)])
        if rc != 0:
            raise MooncakeError(f"Mooncake write of {len(data)} bytes returned {rc}",
                                "check that the target process is alive")

    def _release(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None and self._local_address:
            engine.unregister_memory(self._local_address)
        self._local_address = 0
        del engine  # Mooncake tears down when the engine object goes (the region stays)
