"""Typed errors of the transfer engine (all :class:`~kvctl.errors.KvctlError` subclasses).

"Not found" (:class:`SegmentNotFoundError`) is distinct from "failed"
(:class:`TransferFailedError`); a busy resource (:class:`BusyError`) is distinct from both.
Their base :class:`~kvctl.errors.TransferError` and :class:`~kvctl.errors.AuthError` live in
:mod:`kvctl.errors`, where the metadata layer, the cluster and the bench drivers raise them
too without importing the transfer engine.
"""

from __future__ import annotations

from kvctl.errors import NotFoundError, TransferError, UnavailableError, UsageError


class SegmentNotFoundError(NotFoundError):
    """No segment of that name is registered here or published in the metadata service."""


class OutOfRangeError(UsageError):
    """A request falls (partly) outside every registered buffer of a segment."""


class BusyError(UsageError):
    """The resource has transfers in flight (free_batch, unregister_segment, close)."""


class TransportUnavailableError(UnavailableError):
    """The asked-for transport cannot run here or cannot reach that target."""


class TransferFailedError(TransferError):
    """One or more requests failed (the cause names the first failure)."""


class TransferTimeoutError(TransferError):
    """Waiting for a batch ran past its deadline; the requests may still be in flight."""
