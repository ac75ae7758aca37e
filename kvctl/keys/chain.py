"""Prefix-chained block keys: ``key_0 = H(seed, block_0)``, ``key_i = H(key_{i-1}, block_i)``.

Only full blocks get keys. This is kvctl's own scheme; engine profiles live beside it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvctl.errors import UsageError

HASHES = ("sha256", "blake2b")


def chain_keys(
    tokens: Sequence[int], *, block_size: int, seed: bytes, hash_name: str = "sha256"
) -> list[bytes]:
    """Keys of every full block of ``tokens`` (token ids as little-endian uint32)."""
    if block_size <= 0:
        raise UsageError(f"block size {block_size} is not positive", "use e.g. 16")
    if hash_name not in HASHES:
        raise UsageError(f"unknown hash {hash_name!r}", f"known: {', '.join(HASHES)}")
    full = len(tokens) // block_size * block_size
    data = array("I", tokens[:full]).tobytes()
    step = block_size * 4
    prev = seed
    keys: list[bytes] = []
    for start in range(0, len(data), step):
        h = hashlib.new(hash_name)
        h.update(prev)
        h.update(data[start : start + step])
        prev = h.digest()
        keys.append(prev)
    return keys
