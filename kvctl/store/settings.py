"""Settings of the ``store`` command family (section ``store`` / ``KVCTL_STORE_*``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvctl.config import register_section

#: The well-known loopback port of the embedded store's master.
DEFAULT_PORT = 50051
DEFAULT_MASTER = f"127.0.0.1:{DEFAULT_PORT}"


@register_section("store")
@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """Store settings.

    Attributes:
        master: master ``HOST:PORT`` for clients and nodes; empty means the local embedded
            store (its discovery file, else ``127.0.0.1:50051``).
        listen: where ``store serve`` / ``store master`` listen (loopback by default).
        capacity: DRAM a node contributes, bytes (0: 1 GiB or 1/8 of RAM, the smaller).
        ssd: SSD tier directory of a node (none: no SSD tier).
        ssd_capacity: most bytes a node keeps on SSD.
        ssd_policy: ``write-through`` (copy to SSD soon after each put) or ``write-back``
            (copy to SSD only when evicted from DRAM).
        shared_tier: the master's shared tier: a directory on a distributed file system
            every node and client mounts (none: no shared tier).
        shared_tier_policy: ``write-back`` (copy to the shared tier on DRAM eviction) or
            ``write-through`` (also soon after each put, off the put's path).
        shared_tier_capacity: most bytes of files in the shared tier.
        shared_tier_files: most files in the shared tier.
        shared_tier_map: where this host mounts the shared tier when not at the master's
            path: ``MASTER_DIR=LOCAL_DIR[,...]`` (nodes and clients).
        shared_tier_orphan_grace: a shared-tier file no index names is purged once it is
            this old (a write whose report is on its way is not an orphan).
        shared_tier_sweep_interval: seconds between the starts of two purge sweeps.
        shared_tier_pack_below: shared-tier copies of objects smaller than this are
            written several to a file (one fsync and one name per pack); 0: off.
        state: master state: ``none``, a directory (journal + snapshot) or a metadata URL
            such as ``etcd://127.0.0.1:2379`` (a standby master can take over).
        ha_ttl: lease of the leader key, seconds, for masters on etcd state (they elect
            one leader; a standby takes over about this long after the leader died).
        replicas: copies each put stores, on distinct nodes.
        transport: client data path: ``auto`` (shm on the same host, else tcp), ``shm``,
            ``tcp``.
        node_listen: data-path ``HOST:PORT`` of a node (port 0: any free port); empty: on
            loopback for a master on loopback, else on the address that reaches the master.
        advertise: ``HOST`` clients reach a node's data path at (default: where it listens,
            or the interface addresses for ``0.0.0.0``).
        node_id: node name (default: the host's name and a random suffix, see
            :func:`kvctl.store.node.default_node_id`).
        node_grace: seconds of heartbeat silence after which a *suspect* node (silent
            past ``node_timeout``: no placements, reads go to other replicas, its objects
            kept) is dropped with its objects' copies on it (at least ``node_timeout``;
            ``kvctl store node rm`` drops one at once).
        high_watermark: usage fraction of a node that starts eviction.
        evict_ratio: eviction brings usage down to ``high_watermark - evict_ratio``.
        lease_ttl: seconds a get protects an object from eviction.
        node_timeout: seconds of heartbeat silence after which a node is dead.
        metrics_port: serve the master's Prometheus metrics on this port of the listen host
            (0: any free port); unset serves none.
        tenants: ``NAME=TOKEN`` pairs; a client logging in with a tenant's token is confined
            to keys under ``NAME/`` (needs the shared ``KVCTL_TOKEN``; never printed).
    """

    master: str = ""
    listen: str = DEFAULT_MASTER
    capacity: int = dataclasses.field(default=0, metadata={"unit": "size"})
    ssd: Path | None = None
    ssd_capacity: int = dataclasses.field(default=64 << 30, metadata={"unit": "size"})
    ssd_policy: str = "write-through"
    shared_tier: Path | None = None
    shared_tier_policy: str = "write-back"
    shared_tier_capacity: int = dataclasses.field(default=1 << 40, metadata={"unit": "size"})
    shared_tier_files: int = 10_000_000
    shared_tier_map: str = ""
    shared_tier_orphan_grace: float = dataclasses.field(default=60.0,
                                                        metadata={"unit": "duration"})
    shared_tier_sweep_interval: float = dataclasses.field(default=30.0,
                                                          metadata={"unit": "duration"})
    shared_tier_pack_below: int = dataclasses.field(default=0, metadata={"unit": "size"})
    state: str = "none"
    ha_ttl: float = dataclasses.field(default=5.0, metadata={"unit": "duration"})
    replicas: int = 1
    transport: str = "auto"
    node_listen: str = ""
    advertise: str = ""
    node_id: str = ""
    node_grace: float = dataclasses.field(default=60.0, metadata={"unit": "duration"})
    high_watermark: float = 0.95
    evict_ratio: float = 0.05
    lease_ttl: float = dataclasses.field(default=2.0, metadata={"unit": "duration"})
    node_timeout: float = dataclasses.field(default=3.0, metadata={"unit": "duration"})
    metrics_port: int | None = None
    tenants: tuple[str, ...] = dataclasses.field(default=(), metadata={"secret": True})
