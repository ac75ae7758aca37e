"""kvctl's engine as a bench target: a transfer engine serving one segment, found by name or
address (the other engines' targets are their drivers'; all of them together for
``--role target`` are :mod:`kvctl.bench.target.serve`'s).

- With a metadata URL the target publishes its segment there and initiators find it by name.
- Without one it runs kvctl's own HTTP metadata server on its listen address, so an initiator
  needs only ``HOST:PORT`` (``--peer``): that address *is* the metadata URL.

:class:`BenchTarget` runs in the calling process (``kvctl bench transfer --role target``,
through :class:`~kvctl.bench.target.serve.TargetSet`); :class:`EmbeddedTarget` runs one in a
separate, spawned process on loopback for zero-setup runs (kvctl's driver), so the initiator
and the target never share an interpreter (or a GIL).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
from types import TracebackType
from typing import Any, Self

from kvctl.bench.spec import parse_location
from kvctl.bench.target.child import ChildProcess, serve_until_stopped
from kvctl.errors import ExitCode, KvctlError
from kvctl.net.advertise import check_reachable, host_of, join_host_port, warn_unresolvable
from kvctl.net.bind import parse_listen

_log = logging.getLogger("kvctl.bench")

DEFAULT_SEGMENT = "kvctl-bench"


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """How to run a target.

    Attributes:
        region_bytes: size of the served segment.
        location: ``cpu:N`` (shared memory), ``file:PATH`` or ``cuda:N``.
        listen: ``HOST:PORT`` (port 0: any free one). Without ``metadata`` this is the
            metadata server's address, which initiators pass as ``--peer`` (empty: loopback);
            with one, empty picks the address that routes to the metadata service.
        metadata: metadata URL to publish in; ``None`` runs an embedded metadata server.
        segment: name of the published segment.
        token: shared secret for the engine and metadata server, or ``None``.
        advertise: hosts (or ``HOST:PORT``) peers reach this target at; empty: the listen
            address, or this host's interface addresses when it is ``0.0.0.0``/``::``.
        nics / gid_index: RDMA NIC pins and RoCE GID index (``--nic``, ``--gid-index``).
        metrics_port: serve the target's Prometheus metrics (``kvctl_target_*``: READs and
            WRITEs served, latency, payload bytes) on this port of the listen host, loopback
            only with a token (0: any free port); ``None``: none.
    """

    region_bytes: int
    location: str = "cpu:0"
    listen: str = ""
    metadata: str | None = None
    segment: str = DEFAULT_SEGMENT
    token: str | None = dataclasses.field(default=None, repr=False)
    advertise: tuple[str, ...] = ()
    nics: tuple[str, ...] = ()
    gid_index: int | None = None
    metrics_port: int | None = None


def rdma_options(nics: tuple[str, ...], gid_index: int | None, timeout_s: float = 30.0
                 ) -> Any:
    """The :class:`~kvctl.transfer.transports.rdma.RdmaOptions` for a bench engine with
    these pins, or ``None`` (the engine's defaults) when nothing is pinned."""
    if not nics and gid_index is None:
        return None
    from kvctl.transfer.transports.rdma import RdmaOptions

    return RdmaOptions(nics=nics, gid_index=gid_index, timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    """Where a running target can be reached.

    Attributes:
        metadata_url: metadata service holding the segment descriptor.
        segment: the segment's name.
        address: the engine's data address (``host:port``).
        peer: what an initiator passes as ``--peer`` (address without a metadata URL).
        metrics: the target's metrics URL, when it serves one.
    """

    metadata_url: str
    segment: str
    address: str
    peer: str
    metrics: str | None = None


class BenchTarget:
    """A target in this process. ``start()`` serves; ``close()`` withdraws (idempotent)."""

    def __init__(self, spec: TargetSpec) -> None:
        self.spec = spec
        self._server: Any = None
        self._engine: Any = None
        self._metrics: Any = None
        self.info: TargetInfo | None = None

    def start(self) -> TargetInfo:
        """Start the metadata server (if needed) and the engine, register the segment.

        Raises:
            UsageError: bad listen address or location; the segment name is taken.
            UnavailableError: shared memory, file or GPU cannot be used.
        """
        from kvctl.metadata import MetadataServer
        from kvctl.metadata.base import service_host
        from kvctl.transfer.engine import TransferEngine

        spec = self.spec
        location = parse_location(spec.location, what="remote location")
        warn_unresolvable(spec.advertise, "the bench target")
        host, port = parse_listen(spec.listen)
        try:
            if spec.metadata is None:
                self._server = MetadataServer(host, port, token=spec.token,
                                              advertise=spec.advertise).start()
                metadata_url = self._server.url
                own_url = self._server.local_url
                listen: str | None = f"{host}:0"
            else:
                metadata_url = own_url = spec.metadata
                listen = spec.listen or None
                if listen is not None:
                    check_reachable(service_host(metadata_url), listen, spec.advertise,
                                    what="the bench target", flag="--listen")
            self._engine = TransferEngine(f"{spec.segment}-target-{os.getpid()}",
                                          metadata=own_url, listen=listen,
                                          token=spec.token,
                                          advertise=[host_of(a) for a in spec.advertise],
                                          rdma=rdma_options(spec.nics, spec.gid_index),
                                          metrics=self._serve_metrics(host))
            if location.kind == "file":
                self._engine.register_segment(spec.segment, spec.region_bytes, kind="file",
                                              path=location.path)
            elif location.kind == "cuda":
                self._engine.register_segment(spec.segment, spec.region_bytes, kind="gpu",
                                              location=str(location))
            else:
                self._engine.register_segment(spec.segment, spec.region_bytes, kind="shm",
                                              location=str(location))
        except BaseException:
            self.close()
            raise
        address = self._engine.advertised[0]
        peer = (self._server.url.removeprefix("http://") if self._server is not None
                else spec.segment)
        bound = self._metrics.address if self._metrics is not None else None
        self.info = TargetInfo(metadata_url, spec.segment, address, peer,
                               metrics=f"http://{join_host_port(*bound)}/metrics"
                               if bound is not None else None)
        _log.info("bench target serving %s (%d bytes) at %s, metadata %s", spec.segment,
                  spec.region_bytes, address, metadata_url)
        return self.info

    def _serve_metrics(self, host: str) -> Any:
        """The target's metrics, served per ``spec.metrics_port`` (``None``: not asked)."""
        if self.spec.metrics_port is None:
            return None
        from kvctl.metrics import ServerMetrics

        self._metrics = ServerMetrics("kvctl_target")
        self._metrics.serve_for(host, self.spec.metrics_port, token=self.spec.token)
        return self._metrics

    def close(self) -> None:
        """Withdraw the segment and stop serving. Safe to call twice."""
        engine, self._engine = self._engine, None
        server, self._server = self._server, None
        metrics, self._metrics = self._metrics, None
        if engine is not None:
            engine.close()
        if server is not None:
            server.stop()
        if metrics is not None:
            metrics.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _child_main(spec: TargetSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the embedded target process."""
    target = BenchTarget(spec)
    try:
        info = target.start()
    except KvctlError as exc:
        conn.send(("error", exc.cause, exc.hint, int(exc.exit_code)))
        return
    try:
        conn.send(("ready", info))
        serve_until_stopped(conn)
    finally:
        target.close()


class EmbeddedTarget:
    """A :class:`BenchTarget` in a spawned child process (a context manager).

    Args:
        spec: the target to run (listen should be loopback).
        start_timeout_s: how long the child may take to report ready.
    """

    def __init__(self, spec: TargetSpec, *, start_timeout_s: float = 30.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._child = ChildProcess(
            _child_main, (spec,), name="kvctl bench target",
            hint="rerun with KVCTL_DEBUG=1 -v to see its log, or start one with --role target")
        self.info: TargetInfo | None = None

    def start(self) -> TargetInfo:
        """Spawn the child and wait (bounded) until it serves.

        Raises:
            UnavailableError: the child did not come up in time or exited.
            KvctlError: the child's own error (bad location, no shared memory...).
        """
        message = self._child.start(self.start_timeout_s)
        if message[0] == "error":
            self.close()
            error = KvctlError(message[1], message[2])
            error.exit_code = ExitCode(message[3])
            raise error
        info: TargetInfo = message[1]
        self.info = info
        return info

    def close(self) -> None:
        """Stop the child and reap it. Safe to call twice."""
        self._child.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
