"""The metadata client interface and the backend registry.

A metadata service is a small key/value store with leases: an entry put under a lease
disappears when the lease is not renewed within its TTL, so a crashed process's segments do
not linger. Keys are strings under ``kvctl/`` (optionally ``kvctl/<cluster_id>/``); values
are bytes (callers store JSON). ``get`` returns ``None`` for an absent key and raises
:class:`MetadataError` when the service cannot answer: absence and failure are distinct.
"""

from __future__ import annotations

import abc
import urllib.parse
from collections.abc import Callable
from types import TracebackType
from typing import NewType, Self

from kvctl.errors import KvctlError, UsageError

LeaseId = NewType("LeaseId", int)


class MetadataError(KvctlError):
    """The metadata service could not be reached or answered with an error."""


def key_prefix(cluster_id: str = "") -> str:
    """The prefix every kvctl key lives under: ``kvctl/`` or ``kvctl/<cluster_id>/``."""
    if cluster_id and ("/" in cluster_id or not cluster_id.isprintable()):
        raise UsageError(
            f"cluster id {cluster_id!r} contains '/' or unprintable characters",
            "use letters, digits, '-', '_' or '.'",
        )
    return f"kvctl/{cluster_id}/" if cluster_id else "kvctl/"


class MetadataClient(abc.ABC):
    """A connection to one metadata service. Thread-safe; ``close()`` is idempotent."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        """Create or replace ``key``; with ``lease`` it expires with the lease."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` when absent (or expired)."""

    @abc.abstractmethod
    def list(self, prefix: str) -> dict[str, bytes]:
        """Every live key starting with ``prefix`` and its value."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it existed."""

    @abc.abstractmethod
    def grant_lease(self, ttl_s: float) -> LeaseId:
        """A new lease that expires ``ttl_s`` seconds after its last renewal."""

    @abc.abstractmethod
    def keepalive(self, lease: LeaseId) -> None:
        """Renew ``lease``. Raises :class:`MetadataError` if it already expired."""

    @abc.abstractmethod
    def revoke(self, lease: LeaseId) -> None:
        """End ``lease`` now, deleting every key attached to it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Safe to call twice."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


BackendFactory = Callable[[urllib.parse.SplitResult, str], MetadataClient]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(scheme: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: make ``factory(parsed_url, raw_url)`` the backend for ``scheme://``."""

    def decorate(factory: BackendFactory) -> BackendFactory:
        _BACKENDS[scheme] = factory
        return factory

    return decorate


def known_schemes() -> list[str]:
    """URL schemes with a registered backend."""
    _load_builtin_backends()
    return sorted(_BACKENDS)


def open_metadata(url: str) -> MetadataClient:
    """Open the metadata service named by ``url``.

    Raises:
        UsageError: the URL is malformed or its scheme unknown (the hint lists known ones).
    """
    _load_builtin_backends()
    parsed = urllib.parse.urlsplit(url)
    if not parsed.scheme:
        raise UsageError(
            f"metadata URL {url!r} has no scheme",
            f"write e.g. memory://, file:///var/lib/kvctl, http://127.0.0.1:8080; "
            f"known schemes: {', '.join(sorted(_BACKENDS))}",
        )
    factory = _BACKENDS.get(parsed.scheme)
    if factory is None:
        raise UsageError(
            f"unknown metadata scheme {parsed.scheme!r} in {url!r}",
            f"known schemes: {', '.join(sorted(_BACKENDS))}",
        )
    return factory(parsed, url)


def _load_builtin_backends() -> None:
    # Importing the modules registers them; each imports its client library lazily.
    from kvctl.transfer.metadata import memory  # noqa: F401
