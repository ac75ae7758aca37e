"""Key profiles: kvctl's own scheme and engines' schemes reproduced byte for byte.

``get_profile("vllm:sha256_cbor")`` returns a registered :class:`KeyProfile`; an unknown
name is a :class:`~kvctl.errors.UsageError` listing the known ones.
"""

from kvctl.keys.profiles import kvctl_scheme, lmcache, sglang, vllm
from kvctl.keys.profiles.base import (
    SETTINGS,
    KeyConfig,
    Keyer,
    KeyFormat,
    KeyProfile,
    SeedInfo,
    get_profile,
    known_profiles,
)

__all__ = [
    "SETTINGS",
    "KeyConfig",
    "KeyFormat",
    "KeyProfile",
    "Keyer",
    "SeedInfo",
    "get_profile",
    "known_profiles",
    "kvctl_scheme",
    "lmcache",
    "sglang",
    "vllm",
]
