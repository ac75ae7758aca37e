"""Drivers for the engines ``kvctl bench transfer`` measures: kvctl, Mooncake, NIXL."""

from kvctl.bench.engines.base import (
    BatchOutcome,
    DriverPlan,
    EngineDriver,
    PathInfo,
    driver_class,
    known_engines,
    open_driver,
)

__all__ = [
    "BatchOutcome",
    "DriverPlan",
    "EngineDriver",
    "PathInfo",
    "driver_class",
    "known_engines",
    "open_driver",
]
