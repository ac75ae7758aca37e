"""kvctl's own block keys: ``key_0 = H(seed || block_0)``, ``key_i = H(key_{i-1} || block_i)``.

- A block is ``block_size`` token ids, each encoded as a little-endian uint32; only full
  blocks get keys (a trailing partial block has none).
- The seed is ``H(encode_seed(fields))``: a domain-separated, length-prefixed encoding of
  every setting that changes KV besides the tokens (:class:`SeedFields`). The encoding is
  injective, so different fields never give the same seed bytes, and with a
  collision-resistant ``H`` never the same keys.
- ``H`` is one of :data:`HASHES`: ``sha256`` (default), ``blake2b`` (BLAKE2b with a 32-byte
  digest) or ``xxh3-128`` (16 bytes, PyPI ``xxhash``; fast, not collision resistant against
  an adversary). A key is the raw digest; manifests show it as hex.

:func:`chain_keys` is the hot path: a prompt's tokens are packed once with :mod:`array` (no
copy of the list or of the packed bytes) and each block costs one hash call over
``digest || 4*block_size`` bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvctl.errors import UnavailableError, UsageError

HASHES = ("sha256", "blake2b", "xxh3-128")
DEFAULT_HASH = "sha256"
#: Domain-separation tag of the seed encoding; bump the version to change the encoding.
SEED_DOMAIN = b"kvctl/block-key-seed/v1\x00"
MAX_TOKEN_ID = 2**32 - 1

Digest = Callable[[bytes], bytes]


def _blake2b_256(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def digest_function(hash_name: str) -> Digest:
    """The one-shot digest ``bytes -> bytes`` named ``hash_name`` (one of :data:`HASHES`).

    Raises:
        UsageError: unknown name (the hint lists the known ones).
        UnavailableError: ``xxh3-128`` without the ``xxhash`` package.
    """
    if hash_name == "sha256":
        return _sha256
    if hash_name == "blake2b":
        return _blake2b_256
    if hash_name == "xxh3-128":
        try:
            import xxhash
        except ImportError as exc:
            raise UnavailableError(
                "unavailable: hash xxh3-128 needs the xxhash package",
                "pip install xxhash",
            ) from exc
        fn: Digest = xxhash.xxh3_128_digest
        return fn
    raise UsageError(f"unknown hash {hash_name!r}", f"known hashes: {', '.join(HASHES)}")


def pack_tokens(tokens: Sequence[int], *, what: str = "tokens") -> bytes:
    """Token ids as consecutive little-endian uint32 values.

    Raises:
        UsageError: a token id is not an integer in 0..2**32-1.
    """
    if isinstance(tokens, array) and tokens.typecode == "I" and sys.byteorder == "little":
        return tokens.tobytes()
    return _pack_array(tokens, len(tokens), what=what).tobytes()


def _pack_array(tokens: Sequence[int], count: int, *, what: str = "tokens") -> array[int]:
    """The first ``count`` token ids as an ``array('I')`` in little-endian byte order.

    The hot path of :func:`chain_keys`: a list is converted in one ``fromlist`` call (about
    6 ns per token, the floor for Python ints; the ``array`` constructor and ``struct.pack``
    are slower) without first copying the list; the tail past ``count`` is cut afterwards.
    Only the first ``count`` ids are validated (a trailing partial block never matters).

    Raises:
        UsageError: one of the first ``count`` ids is not an integer in 0..2**32-1.
    """
    packed = array("I")
    try:
        try:
            packed.fromlist(tokens if isinstance(tokens, list) else list(tokens))
        except (OverflowError, TypeError):
            if count == len(tokens):
                raise
            # The bad id may sit in the ignored tail: convert exactly the keyed part.
            packed = array("I")
            packed.fromlist(list(tokens[:count]))
    except (OverflowError, TypeError):
        bad = next(
            (t for t in tokens[:count] if isinstance(t, bool) or not isinstance(t, int)
             or not 0 <= t <= MAX_TOKEN_ID),
            None,
        )
        raise UsageError(
            f"{what}: token id {bad!r} is not an integer in 0..{MAX_TOKEN_ID}",
            "token ids are non-negative vocabulary indices",
        ) from None
    if len(packed) > count:
        del packed[count:]
    if sys.byteorder == "big":  # pragma: no cover - little-endian hosts only here
        packed.byteswap()
    return packed


def chain_keys(
    tokens: Sequence[int], *, block_size: int, seed: bytes, hash_name: str = DEFAULT_HASH
) -> list[bytes]:
    """Keys of every full block of ``tokens``, in block order (raw digest bytes).

    Args:
        tokens: token ids, each in 0..2**32-1.
        block_size: tokens per block (> 0).
        seed: the chain's first link, normally :func:`derive_seed` of the settings.
        hash_name: one of :data:`HASHES`.
    """
    if block_size <= 0:
        raise UsageError(f"block size {block_size} is not positive", "use e.g. 16")
    digest = digest_function(hash_name)
    full = len(tokens) // block_size * block_size
    if full == 0:
        return []
    if isinstance(tokens, array) and tokens.typecode == "I" and sys.byteorder == "little":
        data: array[int] | memoryview = memoryview(tokens)[:full]  # already packed: no copy
    else:
        data = _pack_array(tokens, full)
    # struct.iter_unpack cuts the blocks in C straight from the packed buffer (no copy of the
    # whole prompt), and a comprehension carrying the previous key in a walrus runs the chain
    # with the least interpreter work per block; sha256 and blake2b call the hashlib
    # constructors inline to save a function call per block.
    blocks = struct.iter_unpack(f"{block_size * 4}s", data)
    prev = bytes(seed)
    if hash_name == "sha256":
        sha256 = hashlib.sha256
        return [(prev := sha256(prev + b).digest()) for (b,) in blocks]
    if hash_name == "blake2b":
        blake2b = hashlib.blake2b
        return [(prev := blake2b(prev + b, digest_size=32).digest()) for (b,) in blocks]
    return [(prev := digest(prev + b)) for (b,) in blocks]


@dataclasses.dataclass(frozen=True)
class SeedFields:
    """Everything besides the tokens that changes a block's KV (and so must change its key).

    Attributes:
        model: model id, e.g. ``Qwen/Qwen3-8B``.
        revision: model revision (commit or tag); different weights make different KV.
        tenant: tenant whose cache must not be shared with others.
        lora_name: LoRA adapter name ('' for none).
        lora_path: LoRA adapter path or URI.
        kv_dtype: KV cache dtype, e.g. ``bfloat16``, ``fp8_e4m3``.
        kv_layout: KV layout, e.g. ``NHD``, ``HND``, ``mla``.
        cache_salt: per-request salt ('' for none).
        extra: any other fields as ``(name, value)`` pairs (names unique).
    """

    model: str = ""
    revision: str = ""
    tenant: str = ""
    lora_name: str = ""
    lora_path: str = ""
    kv_dtype: str = ""
    kv_layout: str = ""
    cache_salt: str = ""
    extra: tuple[tuple[str, str], ...] = ()

    def items(self) -> list[tuple[str, str]]:
        """Every field as ``(name, value)``; extra fields are named ``extra.<name>``."""
        fixed = [(f.name, str(getattr(self, f.name))) for f in dataclasses.fields(self)
                 if f.name != "extra"]
        names = [name for name, _ in self.extra]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise UsageError(f"seed field(s) {', '.join(dup)} given twice",
                             "give each --seed-field NAME=VALUE once")
        return fixed + [(f"extra.{name}", value) for name, value in self.extra]

    def replace(self, **changes: Any) -> SeedFields:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def encode_seed(fields: SeedFields, *, hash_name: str = DEFAULT_HASH) -> bytes:
    """The canonical, injective byte encoding of ``fields`` (before hashing).

    ``SEED_DOMAIN``, then the hash name, the field count, and every ``(name, value)`` in
    sorted name order, each UTF-8 and prefixed with its 4-byte big-endian length.
    """
    items = sorted(fields.items())
    out = [SEED_DOMAIN, _field(hash_name.encode()), len(items).to_bytes(4, "big")]
    for name, value in items:
        out.append(_field(name.encode("utf-8")))
        out.append(_field(value.encode("utf-8")))
    return b"".join(out)


def derive_seed(fields: SeedFields, *, hash_name: str = DEFAULT_HASH) -> bytes:
    """``H(encode_seed(fields))``: the first link of every chain under these settings."""
    return digest_function(hash_name)(encode_seed(fields, hash_name=hash_name))


def parse_extra_fields(pairs: Sequence[str] | Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``["lang=en", "ckpt=3"]`` (or a mapping) as sorted ``(name, value)`` pairs.

    Raises:
        UsageError: an entry without ``=`` or with an empty name.
    """
    if isinstance(pairs, Mapping):
        items = [(str(k), str(v)) for k, v in pairs.items()]
    else:
        items = []
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or not name.strip():
                raise UsageError(f"seed field {pair!r} is not NAME=VALUE",
                                 "write e.g. --seed-field rope_scaling=yarn")
            items.append((name.strip(), value))
    return tuple(sorted(items))
