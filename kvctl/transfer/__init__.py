"""Embedded transfer engine: segments, batched READ/WRITE transports (the metadata service
they publish in is :mod:`kvctl.metadata`, a layer of its own).

The public API (see ``docs/transfer.md``)::

    from kvctl.transfer import OpCode, TransferEngine, TransferRequest

Names are imported lazily, so ``import kvctl.transfer.errors`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvctl.errors import AuthError, TransferError
    from kvctl.transfer.batch import (
        Batch,
        BatchResult,
        OpCode,
        RequestStatus,
        TransferRequest,
        TransferState,
    )
    from kvctl.transfer.engine import Notification, SegmentHandle, TransferEngine
    from kvctl.transfer.errors import (
        BusyError,
        OutOfRangeError,
        SegmentNotFoundError,
        TransferFailedError,
        TransferTimeoutError,
        TransportUnavailableError,
    )
    from kvctl.transfer.paths import RetryPolicy
    from kvctl.transfer.segments import BufferInfo, SegmentInfo

_EXPORTS = {
    "Batch": "batch", "BatchResult": "batch", "OpCode": "batch", "RequestStatus": "batch",
    "TransferRequest": "batch", "TransferState": "batch",
    "Notification": "engine", "SegmentHandle": "engine", "TransferEngine": "engine",
    "AuthError": "kvctl.errors", "BusyError": "errors", "OutOfRangeError": "errors",
    "SegmentNotFoundError": "errors", "TransferError": "kvctl.errors",
    "TransferFailedError": "errors", "TransferTimeoutError": "errors",
    "TransportUnavailableError": "errors",
    "RetryPolicy": "paths", "BufferInfo": "segments", "SegmentInfo": "segments",
}

__all__ = [
    "AuthError",
    "Batch",
    "BatchResult",
    "BufferInfo",
    "BusyError",
    "Notification",
    "OpCode",
    "OutOfRangeError",
    "RequestStatus",
    "RetryPolicy",
    "SegmentHandle",
    "SegmentInfo",
    "SegmentNotFoundError",
    "TransferEngine",
    "TransferError",
    "TransferFailedError",
    "TransferRequest",
    "TransferState",
    "TransferTimeoutError",
    "TransportUnavailableError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvctl.transfer' has no attribute {name!r}")
    if not module.startswith("kvctl."):  # a module of this package
        module = f"kvctl.transfer.{module}"
    return getattr(importlib.import_module(module), name)
