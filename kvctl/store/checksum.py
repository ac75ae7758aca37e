"""Object checksums: xxh3-64.

xxh3 runs at ~24 GiB/s on one core of the reference machine against ~2 GiB/s for
``zlib.crc32``; at 4 MiB that is 0.16 ms instead of 2 ms per verification, which matters
because every get verifies. It detects accidental corruption (torn writes, bit flips,
reused space), not tampering.
"""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3-64"


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 checksum of ``data`` (an unsigned 64-bit integer)."""
    return int(xxhash.xxh3_64_intdigest(data))
