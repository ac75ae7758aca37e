"""The embedded store: a master and one storage node in one process, found by clients
through a discovery file.

``kvctl store serve`` runs :class:`EmbeddedStore` on ``127.0.0.1:50051`` by default and
writes ``$XDG_RUNTIME_DIR/kvctl/store.json`` (else ``/tmp/kvctl-<uid>/store.json``) with
the master address and its pid; client commands without ``--master`` read it (ignoring it
when that pid is gone) and fall back to ``127.0.0.1:50051``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.errors import UsageError
from kvctl.fsafe import UnsafePathError, create_private, private_dir
from kvctl.net.bind import parse_listen
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode, default_capacity_bytes
from kvctl.store.server import MasterServer
from kvctl.store.settings import DEFAULT_MASTER, DEFAULT_PORT, StoreSettings
from kvctl.store.state import open_state
from kvctl.store.tenants import check_admin_token, parse_tenants
from kvctl.transfer.shmfiles import pid_alive

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvctl.metrics import ServerMetrics
    from kvctl.store.master.election import Election
    from kvctl.store.state.base import StateBackend

_log = logging.getLogger("kvctl.store")


def runtime_dir() -> Path:
    """Where the discovery file lives (the user's runtime directory)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Path(base) / "kvctl"
    return Path(f"/tmp/kvctl-{os.getuid()}")


def discovery_path() -> Path:
    """The embedded store's discovery file."""
    return runtime_dir() / "store.json"


def resolve_master(settings: StoreSettings) -> str:
    """The master address to use: the setting, else the discovery file, else the default."""
    if settings.master:
        return settings.master
    info = _discovered()
    return str(info["master"]) if info else DEFAULT_MASTER


def metrics_url(server: MasterServer) -> str | None:
    """``http://host:port/metrics`` where the master's metrics (and an in-process node's)
    are served, or ``None``: the address bound (loopback when a token kept them there;
    loopback for a wildcard bind)."""
    from kvctl.net.advertise import join_host_port
    from kvctl.net.bind import LOOPBACK, is_unspecified

    bound = server.metrics.address if server.metrics is not None else None
    if bound is None:
        return None
    host = LOOPBACK if is_unspecified(bound[0]) else bound[0]
    return f"http://{join_host_port(host, bound[1])}/metrics"


def discovered_metrics(master: str) -> str | None:
    """The metrics URL the local embedded store published, when ``master`` is its
    address and it serves metrics (else ``None``)."""
    info = _discovered()
    if info and info.get("master") == master and isinstance(info.get("metrics"), str):
        return str(info["metrics"])
    return None


def _discovered() -> dict[str, object] | None:
    """The discovery file's contents, when it is ours and its process runs."""
    path = discovery_path()
    try:
        private_dir(path.parent, what="discovery directory")
    except UnsafePathError as exc:
        _log.warning("%s; ignoring its discovery file", exc.cause)
        return None
    except OSError:
        return None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return None
            info = json.loads(f.read(65536))
        if isinstance(info, dict) and pid_alive(int(info["pid"])):
            return info
    return None


def master_config(settings: StoreSettings) -> MasterConfig:
    """Master policy from settings (validated)."""
    if not 0 < settings.high_watermark <= 1 or not (
            0 <= settings.evict_ratio < settings.high_watermark):
        raise UsageError(
            f"high_watermark {settings.high_watermark} / evict_ratio {settings.evict_ratio} "
            "are out of range", "use 0 < evict_ratio < high_watermark <= 1, e.g. 0.95 and 0.05")
    if not settings.node_timeout > 0 or settings.node_grace < settings.node_timeout:
        raise UsageError(
            f"node grace {settings.node_grace:g} s / node timeout {settings.node_timeout:g} s "
            "are out of range", "use 0 < node_timeout <= node_grace, e.g. 3 s and 60 s "
            "(--node-grace, KVCTL_STORE_NODE_GRACE)")
    if settings.replicas < 1:
        raise UsageError(f"replicas {settings.replicas} is below 1", "use 1 or more")
    return MasterConfig(node_grace_s=settings.node_grace, high_watermark=settings.high_watermark,
                        evict_ratio=settings.evict_ratio, lease_ttl_s=settings.lease_ttl,
                        node_timeout_s=settings.node_timeout,
                        default_replicas=settings.replicas)


def start_master(settings: StoreSettings, *, token: str | None, cluster_id: str = "",
                 fence: Callable[[StateBackend], None] | None = None) -> MasterServer:
    """A master listening on ``settings.listen`` with the configured state backend and
    tenants; ``fence`` is applied to the state before it is loaded (an elected master's
    writes fenced by its term from the first one, whatever thread makes it).

    Raises:
        ConfigError: bad tenants (or tenants without a shared token).
    """
    host, port = parse_listen(settings.listen, default_port=DEFAULT_PORT)
    config = master_config(settings)
    tenants = parse_tenants(settings.tenants, source="store tenants (--tenant)")
    check_admin_token(tenants, token)
    from kvctl.store.sharedtier.config import SharedTierConfig

    shared = SharedTierConfig.from_settings(settings)  # checked before any state is opened
    state = open_state(settings.state, cluster_id=cluster_id, token=token)
    try:
        if fence is not None:
            fence(state)
        core = MasterCore(config, state, shared_tier=shared)
    except BaseException:
        state.close()
        raise
    metrics = None
    if settings.metrics_port is not None:
        from kvctl.store.metrics import master_metrics

        metrics = master_metrics(core)
    try:
        server = MasterServer(core, host=host, port=port, token=token, metrics=metrics,
                              tenants=tenants)
    except BaseException:
        core.close()
        raise
    if metrics is not None and settings.metrics_port is not None:
        try:
            server.metrics_port = metrics.serve_for(host, settings.metrics_port,
                                                    token=token)[1]
        except BaseException:
            server.close()
            raise
    return server


def start_node(settings: StoreSettings, master: str, *, token: str | None,
               share: ServerMetrics | None = None) -> StorageNode:
    """A storage node for ``master`` with the configured capacity and SSD tier; with
    ``settings.metrics_port``, its metrics served on that port of its data path's host
    (loopback only with a token), or through ``share``'s endpoint (sets
    ``node.metrics_port`` to the port they are on)."""
    capacity = settings.capacity or default_capacity_bytes()
    metrics = None
    if settings.metrics_port is not None:
        from kvctl.store.metrics import node_metrics

        metrics = node_metrics(share=share)
    node = StorageNode(master, node_id=settings.node_id or None, capacity_bytes=capacity,
                       ssd_dir=settings.ssd, ssd_capacity_bytes=settings.ssd_capacity,
                       ssd_policy=settings.ssd_policy, listen=settings.node_listen or None,
                       token=token, heartbeat_s=min(0.5, settings.node_timeout / 4),
                       advertise=[a.strip() for a in settings.advertise.split(",") if a.strip()],
                       metrics=metrics)
    from kvctl.store.sharedtier.config import parse_map

    node.shared.path_map = parse_map(settings.shared_tier_map)
    if metrics is not None and settings.metrics_port is not None:
        from kvctl.net.advertise import host_of
        from kvctl.store.metrics import watch_node

        watch_node(metrics, node)
        if share is None:
            try:
                node.metrics_port = metrics.serve_for(host_of(node.engine.address or ""),
                                                      settings.metrics_port, token=token)[1]
            except BaseException:
                node.close()
                raise
    return node


class EmbeddedStore:
    """Master + one node in this process (``close()`` stops both; idempotent).

    Args:
        settings: store settings (``listen``, ``capacity``, ``ssd``...).
        token: shared secret, or ``None``.
        write_discovery: publish the master address in the discovery file.
        cluster_id: key namespace of the state (etcd, Redis).

    With etcd state the master takes the lead of the state at once or refuses to start
    (:func:`~kvctl.store.standby.lead_now`): its writes are fenced like an elected
    master's, so a ``kvctl store master`` started later stands by. :attr:`election` is
    then set; once it is deposed the master refuses requests.
    """

    def __init__(self, settings: StoreSettings, *, token: str | None = None,
                 write_discovery: bool = False, cluster_id: str = "") -> None:
        from kvctl.store.state import elects_leader

        self.election: Election | None = None
        if elects_leader(settings.state):
            from kvctl.store.standby import lead_now

            self.server, self.election = lead_now(settings, token=token,
                                                  cluster_id=cluster_id)
        else:
            self.server = start_master(settings, token=token, cluster_id=cluster_id)
        try:
            self.node = start_node(settings, self.server.address, token=token,
                                   share=self.server.metrics)
        except BaseException:
            self.server.close()
            if self.election is not None:
                self.election.close()
            raise
        # The node's memory is in this process: gets can take its bytes with the answer.
        self.server.serve_local(self.node.hold)
        self._discovery: Path | None = None
        if write_discovery:
            self._write_discovery()

    @property
    def address(self) -> str:
        """The master's ``host:port``."""
        return self.server.address

    def _write_discovery(self) -> None:
        path = discovery_path()
        try:
            private_dir(path.parent, what="discovery directory")
            fd, tmp = create_private(path.parent, "store.json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps({"master": self.address, "pid": os.getpid(),
                                    "metrics": metrics_url(self.server)}))
            tmp.replace(path)
            self._discovery = path
        except UnsafePathError as exc:
            _log.warning("not writing a discovery file: %s", exc.cause)
        except OSError as exc:
            _log.warning("could not write discovery file %s: %s", path, exc)

    def close(self) -> None:
        """Stop the node, then the master; remove the discovery file."""
        if self._discovery is not None:
            with contextlib.suppress(OSError):
                info = json.loads(self._discovery.read_text(encoding="utf-8"))
                if info.get("pid") == os.getpid():
                    self._discovery.unlink()
            self._discovery = None
        self.node.close()
        self.server.close()  # flushes the state while the leader key is still ours
        if self.election is not None:
            self.election.close()

    def __enter__(self) -> EmbeddedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
