"""The store master: object metadata, placement, allocation, leases, eviction, liveness.

:class:`MasterCore` is the state machine (see :mod:`kvctl.store.master.core` for where each
rule lives); :class:`MasterConfig` its knobs.
"""

from kvctl.store.master.config import (
    EVICTED_MEMORY,
    MIN_RESERVATION_BYTES,
    SSD_POLICIES,
    MasterConfig,
)
from kvctl.store.master.core import MasterCore

__all__ = ["EVICTED_MEMORY", "MIN_RESERVATION_BYTES", "SSD_POLICIES", "MasterConfig",
           "MasterCore"]
