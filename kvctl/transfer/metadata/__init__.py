"""Metadata service clients: leased key/value entries under the ``kvctl/`` prefix.

``open_metadata(url)`` picks a backend by URL scheme (``memory://``, ``file:///dir``,
``http://host:port``, ``etcd://host:2379[,host2:2379]``, ``redis://host:6379``).
"""

from kvctl.transfer.metadata.base import (
    LeaseId,
    MetadataClient,
    MetadataError,
    key_prefix,
    known_schemes,
    open_metadata,
    register_backend,
)

__all__ = [
    "LeaseId",
    "MetadataClient",
    "MetadataError",
    "key_prefix",
    "known_schemes",
    "open_metadata",
    "register_backend",
]
