"""Typed errors of the KV store (all :class:`~kvctl.errors.KvctlError` subclasses).

Absence and failure are different results: :class:`ObjectNotFoundError` (the key is not
stored, or was evicted) is a :class:`~kvctl.errors.NotFoundError`; everything else that
goes wrong (node unreachable, checksum mismatch on every replica, store full, protocol
violation) is a :class:`StoreError` or :class:`StoreUnavailableError`.
"""

from __future__ import annotations

from kvctl.errors import KvctlError, NotFoundError, UnavailableError, UsageError


class StoreError(KvctlError):
    """A store operation failed (not an absence)."""


class ObjectNotFoundError(NotFoundError):
    """The key is not in the store.

    Attributes:
        key: the key asked for.
        evicted: ``True`` when the master remembers evicting it (or dropping it with a dead
            node or a corrupt SSD copy), ``False`` when it was never stored or was removed.
    """

    def __init__(self, key: str, *, evicted: bool = False, why: str = "") -> None:
        what = "was evicted" if evicted else "is not in the store"
        super().__init__(
            f"key {key!r} {what}{': ' + why if why else ''}",
            "put it again" if evicted else "check the key (kvctl store ls PREFIX)",
        )
        self.key = key
        self.evicted = evicted


class StoreFullError(UnavailableError):
    """No node has room for the object, even after evicting everything evictable."""


class StoreUnavailableError(UnavailableError):
    """The master or every node holding a replica cannot be reached or refused the request."""


class StoreBusyError(StoreUnavailableError):
    """Transient: room is being made (write-back eviction in flight) or another put of the
    same key is in flight. :meth:`StoreClient.batch_put` retries these until its timeout."""


class ChecksumMismatchError(StoreError):
    """Bytes read from a replica do not match the object's checksum."""


class ProtocolError(StoreError):
    """A peer sent a message that breaks the store protocol (malformed, oversized, version)."""


class BadRequestError(UsageError):
    """The master refused a request as invalid (bad key, bad size, unknown node)."""


class StoreForbiddenError(StoreError):
    """The master refused a key outside the tenant namespace the client's token confines it
    to (or a node-only request from a tenant)."""


class StoreAuthError(StoreUnavailableError):
    """The master or node refused the token (or one is required and none was given)."""
