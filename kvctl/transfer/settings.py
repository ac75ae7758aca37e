"""Settings of the ``segment`` section (``kvctl segment register`` and engines it starts).

::

    segment:
      size: 64MiB          # default size of a registered segment
      kind: shm            # shm | file
      listen: 127.0.0.1:0  # target server address (port 0: any free port; empty: auto)
      lease_ttl_s: 10s     # how long a crashed process's segments stay visible
      connections: 4       # TCP paths per peer for initiators
      slice_size: 1MiB     # requests above this are sliced over paths
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvctl.config import register_section


@register_section("segment")
@dataclasses.dataclass(frozen=True)
class SegmentSettings:
    """The ``segment`` section.

    Attributes:
        size: segment size in bytes (accepts ``64MiB``).
        kind: ``shm`` (host DRAM in shared memory) or ``file`` (needs ``path``).
        path: backing file of a ``file`` segment.
        listen: ``HOST:PORT`` of the target server; empty: loopback, or the address that
            routes to the metadata service when that is on another host.
        engine: engine name published with the segment (default ``<segment>-engine``).
        lease_ttl_s: lease TTL in seconds.
        connections: TCP paths (connections) per peer.
        slice_size: slice size in bytes for large requests.
    """

    size: int = dataclasses.field(default=64 << 20, metadata={"unit": "size"})
    kind: str = "shm"
    path: Path | None = None
    listen: str = ""
    engine: str = ""
    lease_ttl_s: float = dataclasses.field(default=10.0, metadata={"unit": "duration"})
    connections: int = 4
    slice_size: int = dataclasses.field(default=1 << 20, metadata={"unit": "size"})
