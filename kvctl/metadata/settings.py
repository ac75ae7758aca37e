"""Settings of the ``metadata`` section, and opening the configured service.

The service URL itself is ``common.metadata`` (``KVCTL_METADATA``) and the token
``common.token`` (``KVCTL_TOKEN``); this section holds what the server and clients tune::

    metadata:
      listen: 127.0.0.1:7420      # kvctl metadata serve
      data_dir: /var/lib/kvctl/metadata
      timeout_s: 5s               # client connect and request timeout
      lease_ttl_s: 10s            # how long a crashed process's entries linger
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvctl.config import CommonSettings, register_section
from kvctl.metadata.base import DEFAULT_TIMEOUT_S, MetadataClient, open_metadata

#: Port ``kvctl metadata serve`` listens on when ``--listen`` names none.
DEFAULT_PORT = 7420


@register_section("metadata")
@dataclasses.dataclass(frozen=True)
class MetadataSettings:
    """The ``metadata`` section.

    Attributes:
        listen: ``HOST:PORT`` for ``kvctl metadata serve`` (loopback unless told otherwise;
            port 0 picks a free one).
        data_dir: keep the server's entries and leases in files here (survive restarts);
            unset keeps them in memory.
        request_timeout_s: the server drops a connection idle or stalled this long.
        max_body_bytes: largest request body the server accepts.
        timeout_s: clients' connect and per-request timeout.
        lease_ttl_s: lease TTL for entries kvctl publishes: how long a crashed process's
            entries stay visible.
        metrics_port: serve Prometheus metrics of ``kvctl metadata serve`` on this port of
            the listen host (0: any free port); unset serves none.
    """

    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    data_dir: Path | None = None
    request_timeout_s: float = dataclasses.field(default=10.0, metadata={"unit": "duration"})
    max_body_bytes: int = dataclasses.field(default=4 << 20, metadata={"unit": "size"})
    timeout_s: float = dataclasses.field(default=DEFAULT_TIMEOUT_S, metadata={"unit": "duration"})
    lease_ttl_s: float = dataclasses.field(default=10.0, metadata={"unit": "duration"})
    metrics_port: int | None = None


def open_configured(common: CommonSettings, settings: MetadataSettings | None = None
                    ) -> MetadataClient:
    """Open the service of ``common.metadata`` with the configured token and timeout."""
    timeout_s = (settings or MetadataSettings()).timeout_s
    return open_metadata(common.metadata, token=common.token, timeout_s=timeout_s)
