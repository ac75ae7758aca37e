"""The metadata client interface and the backend registry.

A metadata service is a small key/value store with leases: an entry put under a lease
disappears when the lease is not renewed within its TTL, so a crashed process's segments do
not linger. Keys are strings under ``kvctl/`` (optionally ``kvctl/<cluster_id>/``); values
are bytes (callers store JSON). ``get`` returns ``None`` for an absent key and raises
:class:`MetadataError` when the service cannot answer: absence and failure are distinct.
"""

from __future__ import annotations

import abc
import dataclasses
import urllib.parse
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import NewType, Self

from kvctl.errors import ExitCode, KvctlError, UsageError
from kvctl.metadata.watch import DEFAULT_POLL_S, PollingWatch, Watch

LeaseId = NewType("LeaseId", int)

#: Default time a client waits for one metadata request (connect + answer), in seconds.
DEFAULT_TIMEOUT_S = 5.0


class MetadataError(KvctlError):
    """The metadata service could not be reached or answered with an error."""

    exit_code = ExitCode.UNAVAILABLE


class LeaseExpiredError(MetadataError):
    """The service answered that a lease has expired or never existed (not a network failure).

    Raised by ``keepalive`` and by ``put(..., lease=...)``; the fix is to grant a new lease and
    publish again, which :class:`~kvctl.metadata.lease.LeaseKeeper` does on its own.
    """


@dataclasses.dataclass(frozen=True)
class MetadataOptions:
    """How a backend connects, beyond its URL.

    Attributes:
        token: shared secret for kvctl's own HTTP server (``KVCTL_TOKEN``); never logged.
        timeout_s: connect and per-request timeout, in seconds.
    """

    token: str | None = dataclasses.field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S


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

    def watch(self, prefixes: str | Sequence[str], *, poll_s: float = DEFAULT_POLL_S) -> Watch:
        """Follow every change under ``prefixes`` (see :mod:`kvctl.metadata.watch`):
        a snapshot of each prefix first, then each put and each deletion or expiry, in order.

        Backends that can push changes override this; the default polls: one ``list`` per
        prefix every ``poll_s`` seconds, diffed (``poll_s`` is also how late a pushed watch
        may report what its service cannot push, such as a Redis lease expiring).

        Raises:
            ValueError: no prefix, overlapping prefixes, or ``poll_s`` not positive.
        """
        return PollingWatch(self, prefixes, poll_s=poll_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


BackendFactory = Callable[[urllib.parse.SplitResult, str, MetadataOptions], MetadataClient]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(scheme: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: make ``factory(parsed_url, raw_url, options)`` the backend for ``scheme://``."""

    def decorate(factory: BackendFactory) -> BackendFactory:
        _BACKENDS[scheme] = factory
        return factory

    return decorate


def known_schemes() -> list[str]:
    """URL schemes with a registered backend."""
    _load_builtin_backends()
    return sorted(_BACKENDS)


def open_metadata(
    url: str, *, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> MetadataClient:
    """Open the metadata service named by ``url``.

    Args:
        url: ``memory://[name]``, ``file:///dir``, ``http://host:port``,
            ``etcd://host:2379[,host2:2379]`` or ``redis://[:password@]host:6379[/db]``.
        token: shared secret signing every request to kvctl's HTTP server (ignored by the
            other backends).
        timeout_s: connect and per-request timeout, in seconds.

    Opening does not contact the service: the first call does, and raises
    :class:`MetadataError` (naming the URL, with a hint) when it cannot be reached.

    Raises:
        UsageError: the URL is malformed or its scheme unknown (the hint lists known ones).
    """
    if timeout_s <= 0:
        raise UsageError(f"metadata timeout {timeout_s} s is not positive", "use e.g. 5s")
    _load_builtin_backends()
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise UsageError(f"metadata URL {url!r} is malformed: {exc}",
                         "write e.g. http://127.0.0.1:8080 or etcd://10.0.0.1:2379") from None
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
    return factory(parsed, url, MetadataOptions(token=token, timeout_s=timeout_s))


def service_host(url: str) -> str | None:
    """The (first) host a networked metadata URL names; ``None`` for ``memory://``,
    ``file://`` and URLs that do not parse (opening them reports the error)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme in ("", "memory", "file"):
            return None
        return split_endpoints(parsed, url, default_port=1)[0][0]
    except (ValueError, UsageError):
        return None


def split_endpoints(
    parsed: urllib.parse.SplitResult, url: str, *, default_port: int | None
) -> list[tuple[str, int]]:
    """The ``host:port`` endpoints of a URL's network location (comma-separated for etcd).

    Args:
        default_port: port used when one is not written, or ``None`` when it is required.

    Raises:
        UsageError: a host is missing or a port is not a number in 1..65535.
    """
    netloc = parsed.netloc.rpartition("@")[2]
    example = f"{parsed.scheme}://127.0.0.1:{default_port or 8080}"
    if not netloc:
        raise UsageError(f"metadata URL {url!r} names no host", f"write e.g. {example}")
    endpoints: list[tuple[str, int]] = []
    for part in netloc.split(","):
        part = part.strip()
        if part.startswith("["):  # [IPv6]:port
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else rest
        else:
            host, sep, port_text = part.rpartition(":")
            if not sep:
                host, port_text = part, ""
        if not host:
            raise UsageError(f"metadata URL {url!r} has an endpoint without a host",
                             f"write e.g. {example}")
        if not port_text:
            if default_port is None:
                raise UsageError(f"metadata URL {url!r} has no port for {host}",
                                 f"write e.g. {example}")
            port = default_port
        elif port_text.isascii() and port_text.isdigit() and 0 < int(port_text) <= 65535:
            port = int(port_text)
        else:
            raise UsageError(f"metadata URL {url!r} has a bad port {port_text!r}",
                             "use a port number from 1 to 65535")
        endpoints.append((host, port))
    return endpoints


def _load_builtin_backends() -> None:
    # Importing the modules registers them; each imports its client library lazily.
    from kvctl.metadata import (  # noqa: F401
        etcd,
        file,
        http_backend,
        memory,
        redis_backend,
    )
