"""CPython's builtin ``hash()`` of a ``str`` under a given ``PYTHONHASHSEED``.

LMCache's default chunk hash is Python's builtin ``hash``; its first link (``NONE_HASH``)
is ``hash(seed_string)``, which depends on the ``PYTHONHASHSEED`` the *engine's* interpreter
started with. kvctl cannot change its own interpreter's seed, so it recomputes that value:

- the variable is read as ``config_init_hash_seed`` (``Python/initconfig.c``) reads it
  (:func:`parse_hash_seed`): unset or empty, or exactly ``random``, means a random secret;
  anything else goes through C's ``strtoul(text, &end, 10)`` and must be consumed whole and
  be at most 4294967295, or the interpreter refuses to start. So leading whitespace, a sign
  and leading zeros are accepted (``+7``, `` 007`` and ``7`` are seed 7, ``-0`` is seed 0),
  while trailing whitespace, ``-7``, ``0x7`` and non-ASCII digits are refused;
- the hash secret comes from seed ``N``: ``N == 0`` means an all-zero secret,
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


#: What C's ``isspace`` skips before the number (C locale).
_C_SPACE = " \t\n\v\f\r"
_ASCII_DIGITS = frozenset("0123456789")


def parse_hash_seed(pythonhashseed: str | None) -> int | None:
    """The seed CPython takes from ``PYTHONHASHSEED`` (``None``: a random secret).

    Follows ``config_init_hash_seed`` in CPython's ``Python/initconfig.c``: an unset or
    empty variable (``_Py_GetEnv`` treats '' as unset) and the exact text ``random`` give a
    random secret; any other text is parsed by ``strtoul(text, &end, 10)``: leading C
    whitespace, then an optional ``+`` or ``-``, then ASCII digits. The whole text must be
    consumed and the value must not exceed 4294967295. ``strtoul`` negates a ``-`` value in
    ``unsigned long``, so ``-0`` is 0 and every other negative number is out of range.

    Raises:
        UsageError: text with which CPython refuses to start (it prints "PYTHONHASHSEED must
            be "random" or an integer in range [0; 4294967295]").
    """
    if pythonhashseed is None or pythonhashseed in ("", "random"):
        return None
    text = pythonhashseed.lstrip(_C_SPACE)
    sign = ""
    if text[:1] in ("+", "-"):
        sign, text = text[0], text[1:]
    digits = bool(text) and set(text) <= _ASCII_DIGITS
    significant = text.lstrip("0")  # also keeps int() clear of its 4300-digit limit
    value = int(significant) if digits and significant and len(significant) <= 10 else 0
    if not digits or len(significant) > 10 or value > MAX_HASH_SEED \
            or (sign == "-" and value != 0):
        raise UsageError(
            f"PYTHONHASHSEED={pythonhashseed!r} is refused by CPython: the engine's "
            "interpreter would not start",
            f"CPython accepts 'random' or an integer 0..{MAX_HASH_SEED} (optionally with "
            "leading spaces, a '+' and leading zeros; nothing after the digits)",
        )
    return value


def hash_secret(pythonhashseed: str) -> tuple[int, int]:
    """The SipHash key CPython derives from ``PYTHONHASHSEED`` (see :func:`parse_hash_seed`).

    Raises:
        UsageError: the value gives a random secret (unset, '' or ``random``: no fixed
            seed to reproduce) or is one CPython refuses.
    """
    seed = parse_hash_seed(pythonhashseed)
    if seed is None:
        raise UsageError(
            f"PYTHONHASHSEED={pythonhashseed!r} is not a fixed seed: CPython draws a random "
            "hash secret per process",
            f"set PYTHONHASHSEED to an integer 0..{MAX_HASH_SEED} on every instance",
        )
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
