"""CPython's builtin ``hash()`` of a ``str`` under a given ``PYTHONHASHSEED``.

LMCache's default chunk hash is Python's builtin ``hash``; its first link (``NONE_HASH``)
is ``hash(seed_string)``, which depends on the ``PYTHONHASHSEED`` the *engine's* interpreter
started with. kvctl cannot change its own interpreter's seed, so it recomputes that value:

- the hash secret comes from ``PYTHONHASHSEED=N``: ``N == 0`` means an all-zero secret,
  otherwise 24 bytes from CPython's linear congruential generator (``lcg_urandom`` in
  ``Python/bootstrap_hash.c``) seeded with ``N``;
- the first 16 bytes are the SipHash key ``(k0, k1)`` (little-endian);
- a ``str`` is hashed as its internal buffer: 1, 2 or 4 bytes per code point (PEP 393),
  with SipHash-1-3 (CPython 3.11 and later; 3.4-3.10 used SipHash-2-4);
- the result is a signed 64-bit value, with ``-1`` mapped to ``-2``; ``""`` hashes to ``0``.

Tests compare this with a real interpreter started with each seed.
"""

from __future__ import annotations

from kvctl.errors import UsageError

_MASK = (1 << 64) - 1
MAX_HASH_SEED = 4294967295


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK


def _sipround(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & _MASK
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & _MASK
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & _MASK
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & _MASK
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash13(k0: int, k1: int, data: bytes) -> int:
    """SipHash-1-3 of ``data`` with key ``(k0, k1)``, as an unsigned 64-bit integer."""
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    size = len(data)
    full = size - size % 8
    for off in range(0, full, 8):
        m = int.from_bytes(data[off : off + 8], "little")
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    tail = int.from_bytes(data[full:], "little") | ((size & 0xFF) << 56)
    v3 ^= tail
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= tail
    v2 ^= 0xFF
    for _ in range(3):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def hash_secret(pythonhashseed: str) -> tuple[int, int]:
    """The SipHash key CPython derives from ``PYTHONHASHSEED`` (a decimal 0..4294967295).

    Raises:
        UsageError: the value is not one CPython accepts (``random`` means no fixed seed).
    """
    text = pythonhashseed.strip()
    if not text.isdigit() or int(text) > MAX_HASH_SEED:
        raise UsageError(
            f"PYTHONHASHSEED={pythonhashseed!r} is not a fixed seed",
            f"CPython accepts 'random' or an integer 0..{MAX_HASH_SEED}; "
            "only an integer makes hash() reproducible",
        )
    seed = int(text)
    if seed == 0:
        secret = bytes(24)
    else:
        out = bytearray(24)
        x = seed
        for i in range(24):
            x = (x * 214013 + 2531011) & 0xFFFFFFFF
            out[i] = (x >> 16) & 0xFF
        secret = bytes(out)
    return int.from_bytes(secret[0:8], "little"), int.from_bytes(secret[8:16], "little")


def _pep393_bytes(text: str) -> bytes:
    widest = max((ord(c) for c in text), default=0)
    if widest < 0x100:
        return text.encode("latin-1")
    if widest < 0x10000:
        return text.encode("utf-16-le")
    return text.encode("utf-32-le")


def str_hash(text: str, pythonhashseed: str) -> int:
    """``hash(text)`` as CPython >= 3.11 (64-bit) computes it under ``PYTHONHASHSEED``."""
    if not text:
        return 0
    k0, k1 = hash_secret(pythonhashseed)
    value = siphash13(k0, k1, _pep393_bytes(text))
    if value >= 1 << 63:
        value -= 1 << 64
    return -2 if value == -1 else value
