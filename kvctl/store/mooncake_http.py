"""Read a ``mooncake_master``'s HTTP endpoint: health, mounted segments, capacity and usage.

``mooncake_master`` serves HTTP on ``--metrics_host``/``--metrics_port`` (default
``0.0.0.0:9003``), beside its RPC port (``--rpc_port``, default 50051). Three of its paths
are read here, all measured against Mooncake 0.3.13:

- ``/health``: JSON ``{"status": "ok", "role": "leader", "ha_state": "serving",
  "service_ready": true, ...}``.
- ``/get_segments_detail``: JSON ``{"total_segments": N, "segments": [{"segment_name",
  "te_endpoint", "protocol", "status", "size_bytes", "allocator_used_bytes",
  "allocator_capacity_bytes", ...}]}``: one entry per segment a storage process or client
  mounted with ``global_segment_size > 0``.
- ``/metrics``: Prometheus text; ``master_total_capacity_bytes``, ``master_allocated_bytes``,
  ``master_key_count`` and ``master_active_clients`` are used.

Only the standard library's ``urllib`` is used, with a short timeout: a master that does not
answer over HTTP is reported at once, not retried.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from kvctl.errors import CheckFailedError, UnavailableError, UsageError

#: ``mooncake_master --metrics_port`` default.
DEFAULT_METRICS_PORT = 9003


class MooncakeMetricsUnavailableError(UnavailableError):
    """The master's HTTP endpoint cannot be read (refused, timed out, not Mooncake's)."""


class MooncakeNoStorageError(CheckFailedError):
    """The master reports no storage capacity: no process mounted a segment."""


@dataclasses.dataclass(frozen=True)
class MooncakeSegment:
    """One mounted segment, as ``/get_segments_detail`` reports it.

    Attributes:
        name: the segment's name (``HOST:PORT`` of the process that mounted it).
        endpoint: its transfer-engine endpoint (where replicas on it are read from).
        protocol: ``tcp`` or ``rdma``.
        status: Mooncake's segment status (``OK`` when usable).
        capacity_bytes: bytes it offers, bytes.
        used_bytes: bytes allocated in it, bytes.
    """

    name: str
    endpoint: str
    protocol: str
    status: str
    capacity_bytes: int
    used_bytes: int


@dataclasses.dataclass(frozen=True)
class MooncakeMasterStatus:
    """What a ``mooncake_master`` says about itself over HTTP.

    Attributes:
        master: its RPC ``HOST:PORT`` (as given).
        metrics_url: the HTTP base URL read.
        health: ``/health``'s ``status`` (``ok`` when healthy).
        role: ``leader`` or ``follower``.
        ha_state: e.g. ``serving``.
        service_ready: whether it serves requests.
        segments: mounted segments.
        capacity_bytes: total memory capacity over all segments, bytes.
        used_bytes: memory allocated over all segments, bytes.
        keys: objects it holds.
        clients: clients it counts as active.
    """

    master: str
    metrics_url: str
    health: str
    role: str
    ha_state: str
    service_ready: bool
    segments: tuple[MooncakeSegment, ...]
    capacity_bytes: int
    used_bytes: int
    keys: int
    clients: int

    def segment_for_endpoint(self, endpoint: str) -> str | None:
        """The name of the segment whose transfer endpoint is ``endpoint``, if mounted."""
        return next((s.name for s in self.segments if s.endpoint == endpoint), None)


def default_metrics_url(master: str) -> str:
    """``http://<master host>:9003``: where ``mooncake_master`` serves HTTP by default."""
    host, _, _ = master.rpartition(":")
    host = host or master
    if ":" in host.strip("[]"):
        host = f"[{host.strip('[]')}]"
    return f"http://{host}:{DEFAULT_METRICS_PORT}"


def normalize_metrics_url(text: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT[/...]`` as a base URL without a trailing path.

    Raises:
        UsageError: neither form.
    """
    url = text if "://" in text else f"http://{text}"
    scheme, _, rest = url.partition("://")
    hostport = rest.split("/", 1)[0]
    if scheme not in ("http", "https") or not hostport:
        raise UsageError(f"Mooncake metrics address {text!r} is not HOST:PORT or an http URL",
                         "give mooncake_master's --metrics_port address, e.g. 10.0.0.1:9003")
    return f"{scheme}://{hostport}"


def _fetch(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (http only)
            body: bytes = reply.read(16 << 20)
    except urllib.error.HTTPError as exc:
        raise MooncakeMetricsUnavailableError(
            f"{url} answered HTTP {exc.code}: not a mooncake_master metrics endpoint",
            "pass --metrics HOST:PORT of mooncake_master's --metrics_port") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MooncakeMetricsUnavailableError(
            f"cannot read mooncake_master's HTTP endpoint at {url}: {reason}",
            "pass --metrics HOST:PORT of mooncake_master's --metrics_port (default 9003), "
            "and check that port is open from here") from None
    return body.decode("utf-8", "replace")


def _json(url: str, timeout_s: float) -> dict[str, Any]:
    text = _fetch(url, timeout_s)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise MooncakeMetricsUnavailableError(
            f"{url} did not answer with a JSON object: not a mooncake_master endpoint",
            "pass --metrics HOST:PORT of mooncake_master's --metrics_port")
    return doc


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition as ``{"name{labels}": value}`` (comments dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def _int(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key, 0)
    return int(value) if isinstance(value, int | float) else 0


def read_master_status(master: str, metrics_url: str, *, timeout_s: float = 3.0
                       ) -> MooncakeMasterStatus:
    """Health, segments, capacity and usage of the master whose HTTP base is ``metrics_url``.

    Raises:
        MooncakeMetricsUnavailableError: the endpoint cannot be read or is not Mooncake's.
    """
    base = normalize_metrics_url(metrics_url)
    health = _json(f"{base}/health", timeout_s)
    detail = _json(f"{base}/get_segments_detail", timeout_s)
    metrics = parse_prometheus(_fetch(f"{base}/metrics", timeout_s))
    if "master_total_capacity_bytes" not in metrics:
        raise MooncakeMetricsUnavailableError(
            f"{base}/metrics has no master_total_capacity_bytes: not a mooncake_master",
            "pass --metrics HOST:PORT of mooncake_master's --metrics_port")
    raw = detail.get("segments")
    segments = tuple(
        MooncakeSegment(name=str(s.get("segment_name", "")), endpoint=str(s.get("te_endpoint", "")),
                        protocol=str(s.get("protocol", "")), status=str(s.get("status", "")),
                        capacity_bytes=_int(s, "allocator_capacity_bytes") or _int(s, "size_bytes"),
                        used_bytes=_int(s, "allocator_used_bytes"))
        for s in (raw if isinstance(raw, list) else []) if isinstance(s, dict))
    return MooncakeMasterStatus(
        master=master, metrics_url=base, health=str(health.get("status", "unknown")),
        role=str(health.get("role", "unknown")), ha_state=str(health.get("ha_state", "unknown")),
        service_ready=bool(health.get("service_ready", False)), segments=segments,
        capacity_bytes=int(metrics.get("master_total_capacity_bytes", 0)),
        used_bytes=int(metrics.get("master_allocated_bytes", 0)),
        keys=int(metrics.get("master_key_count", 0)),
        clients=int(metrics.get("master_active_clients", 0)))


def require_storage(status: MooncakeMasterStatus) -> None:
    """Raise unless the master is healthy and has storage mounted.

    Raises:
        MooncakeNoStorageError: no segment, or zero capacity.
        MooncakeMetricsUnavailableError: the master says it is not serving.
    """
    if status.health != "ok" or not status.service_ready:
        raise MooncakeMetricsUnavailableError(
            f"mooncake_master at {status.master} is not serving (health {status.health}, "
            f"role {status.role}, state {status.ha_state})",
            f"see {status.metrics_url}/health and the master's log")
    if not status.segments or status.capacity_bytes <= 0:
        raise MooncakeNoStorageError(
            f"the master at {status.master} has no storage mounted "
            f"({len(status.segments)} segments, {status.capacity_bytes} bytes of capacity at "
            f"{status.metrics_url})",
            "start a mooncake storage process / client with global_segment_size > 0 "
            "(e.g. mooncake_client --master_server_address=HOST:PORT "
            "--global_segment_size=4GB), then rerun")
