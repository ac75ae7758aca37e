"""The interface every benchmarked engine implements, and the driver registry.

A driver owns one side's memory (the *local region*) and reaches a target's memory (the
*remote region*) of the same size. Request ``i`` of a batch run by thread ``t`` uses offset
``t * thread_stride + i * block_size`` on both sides, so threads never overlap and a
verified block has exactly one place it may land.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from types import TracebackType
from typing import ClassVar, Self

from kvctl.bench.spec import CPU0, Location, Op
from kvctl.errors import UnavailableError, UsageError


@dataclasses.dataclass(frozen=True)
class DriverPlan:
    """What a driver must set up before running configurations.

    Attributes:
        region_bytes: bytes of buffer per side.
        thread_stride_bytes: bytes of the region each thread owns.
        threads: initiator threads.
        local / remote: buffer locations.
        timeout_s: seconds one batch may take.
        peer: for two-host runs, the target (segment name or ``HOST:PORT``); ``None`` runs an
            embedded target process on loopback.
        metadata: metadata URL of a two-host run, else ``None``.
        token: shared secret (``KVCTL_TOKEN``) for the target, the metadata service and the
            initiator's own engine, or ``None``.
        nics: RDMA NICs pinned with ``--nic`` (``mlx5_0``, ``mlx5_0:1``), best first; empty:
            topo's ranking.
        gid_index: RoCE GID index pinned with ``--gid-index``, else ``None``.
        local_addresses: local IP addresses the initiator's TCP connections leave from (a
            cluster bench's rail); empty: the kernel's route.
    """

    region_bytes: int
    thread_stride_bytes: int
    threads: int = 1
    local: Location = CPU0
    remote: Location = CPU0
    timeout_s: float = 30.0
    peer: str | None = None
    metadata: str | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    nics: tuple[str, ...] = ()
    gid_index: int | None = None
    local_addresses: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PathInfo:
    """How a transport reaches the target.

    Attributes:
        transport: the transport actually used (``shm``, ``tcp``, ``rdma``, ``ucx``...).
        path: a readable description of the path (addresses, device).
        loopback: whether the target is on this host over loopback (line rate is measured).
        medium: what the bytes cross, for the line rate: ``shm``, ``tcp`` or ``rdma``;
            ``None`` means "same as ``transport``".
    """

    transport: str
    path: str
    loopback: bool
    medium: str | None = None


@dataclasses.dataclass(frozen=True)
class BatchOutcome:
    """One batch's fate.

    Attributes:
        errors: requests that failed or timed out.
        retries: slices retried on another path, or ``None`` when the engine does not say.
        path: the path the batch used (may differ from :class:`PathInfo` when sliced).
        cause: why the first failed request failed, as the engine said (``None`` when
            nothing failed).
    """

    errors: int = 0
    retries: int | None = None
    path: str | None = None
    cause: str | None = None


class EngineDriver(abc.ABC):
    """One engine under test. Not thread-safe except :meth:`run_batch` across threads."""

    #: Name used by ``--engine``.
    name: ClassVar[str]
    #: How to install the engine when it is missing.
    install_hint: ClassVar[str]
    #: Whether the session runs this driver in a child process of its own (engines whose
    #: native libraries must stay out of kvctl's process: NIXL crashes at exit).
    isolated: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this engine cannot run here (``None`` when it can). Imports lazily."""
        return None

    @abc.abstractmethod
    def start(self, plan: DriverPlan) -> None:
        """Allocate and register the local region; start or reach the target.

        Raises:
            UnavailableError: the engine, target or location cannot be used.
            UsageError: the plan asks for something this engine does not support.
        """

    @abc.abstractmethod
    def prepare(self, transport: str) -> PathInfo:
        """Get ready to run batches over ``transport`` (``auto`` lets the engine pick).

        Raises:
            UnavailableError: this engine cannot use that transport here.
        """

    @abc.abstractmethod
    def run_batch(self, transport: str, op: Op, block_size_bytes: int, batch_size: int,
                  thread_index: int) -> BatchOutcome:
        """Move one batch and wait for it; per-request failures are counted, not raised.

        Raises:
            KvctlError: the batch could not be submitted or waited for at all.
        """

    @abc.abstractmethod
    def local_view(self, offset: int, length: int) -> memoryview:
        """Writable view of ``length`` bytes of the local region at ``offset`` (for verify)."""

    def sync_local(self, offset: int, length: int) -> None:  # noqa: B027 - optional hook
        """Make writes through :meth:`local_view` visible to the engine (regions the view
        only mirrors, such as GPU memory)."""

    def refresh_local(self, offset: int, length: int) -> None:  # noqa: B027 - optional hook
        """Make the engine's writes visible through :meth:`local_view` (regions the view
        only mirrors, such as GPU memory)."""

    @abc.abstractmethod
    def poke_remote(self, transport: str, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of the remote region (verification tests plant
        corruption with it)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the target (if embedded) and release everything. Safe to call twice."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_DRIVERS: dict[str, str] = {
    "kvctl": "kvctl.bench.engines.kvctl:KvctlDriver",
    "mooncake": "kvctl.bench.engines.mooncake:MooncakeDriver",
    "nixl": "kvctl.bench.engines.nixl:NixlDriver",
}


def known_engines() -> list[str]:
    """Engine names ``--engine`` accepts."""
    return list(_DRIVERS)


def driver_class(name: str) -> type[EngineDriver]:
    """The driver class of engine ``name`` (its module is imported, the engine is not).

    Raises:
        UsageError: unknown engine (the hint lists the known ones).
    """
    target = _DRIVERS.get(name.strip().lower())
    if target is None:
        raise UsageError(f"engine {name!r} is unknown",
                         f"known engines: {', '.join(_DRIVERS)}")
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, EngineDriver)):  # pragma: no cover
        raise TypeError(f"{target} is not an EngineDriver")
    return cls


def open_driver(name: str) -> EngineDriver:
    """An instance of engine ``name``'s driver.

    Raises:
        UsageError: unknown engine.
        UnavailableError: the engine is not installed or usable here (hint: how to install).
    """
    cls = driver_class(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise UnavailableError(f"engine {cls.name} unavailable: {reason}", cls.install_hint)
    return cls()
