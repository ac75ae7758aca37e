"""Metadata service clients: leased key/value entries under the ``kvctl/`` prefix.

``open_metadata(url)`` picks a backend by URL scheme (``memory://``, ``file:///dir``,
``http://host:port``, ``etcd://host:2379[,host2:2379]``, ``redis://host:6379``).
:class:`LeaseKeeper` keeps a lease and its entries alive; :class:`MetadataServer` is kvctl's
own server behind ``http://``.
"""

from kvctl.metadata.base import (
    DEFAULT_TIMEOUT_S,
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
    MetadataOptions,
    key_prefix,
    known_schemes,
    open_metadata,
    register_backend,
)
from kvctl.metadata.lease import LeaseKeeper
from kvctl.metadata.server import MetadataServer
from kvctl.metadata.settings import MetadataSettings, open_configured

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LeaseExpiredError",
    "LeaseId",
    "LeaseKeeper",
    "MetadataClient",
    "MetadataError",
    "MetadataOptions",
    "MetadataServer",
    "MetadataSettings",
    "key_prefix",
    "known_schemes",
    "open_configured",
    "open_metadata",
    "register_backend",
]
