"""The store master: object metadata, placement, allocation, leases, eviction, liveness.

:class:`MasterCore` is the state machine (see :mod:`kvctl.store.master.core` for where each
rule lives); :class:`MasterConfig` its knobs.
"""

from typing import TYPE_CHECKING

from kvctl.store.master.config import EVICTED_MEMORY, MIN_RESERVATION_BYTES, MasterConfig
from kvctl.store.protocol import SSD_POLICIES

if TYPE_CHECKING:
    from kvctl.store.master.core import MasterCore


def __getattr__(name: str) -> object:
    # MasterCore on first use: its mixins (the shared tier's among them) import
    # kvctl.store.master.records, which runs this package first; importing the core here
    # eagerly made "import kvctl.store.sharedtier.mixin" on its own a circular import.
    if name == "MasterCore":
        from kvctl.store.master.core import MasterCore

        return MasterCore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EVICTED_MEMORY", "MIN_RESERVATION_BYTES", "SSD_POLICIES", "MasterConfig",
           "MasterCore"]
