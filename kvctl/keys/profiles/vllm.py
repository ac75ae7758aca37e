"""vLLM v1 prefix-caching block hashes (matches vLLM 0.33.0).

How vLLM builds them (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

- ``hash_block_tokens``: ``block_hash = H((parent, tuple(block_tokens), extra_keys))``
  where ``parent`` is the previous block's hash, or ``NONE_HASH`` for the first block;
- ``H`` is ``--prefix-caching-hash-algo``: ``sha256`` = SHA-256 of
  ``pickle.dumps(obj, protocol=5)``; ``sha256_cbor`` = SHA-256 of ``cbor2.dumps(obj,
  canonical=True)``; ``xxhash``/``xxhash_cbor`` = XXH3-128 of the same serialisations;
- ``init_none_hash``: ``NONE_HASH = H(seed)`` where ``seed`` is ``$PYTHONHASHSEED`` (the
  string) when set; otherwise the fixed ``"vllm-none-hash"`` for sha256/sha256_cbor, and
  32 random bytes in hex *per process* for xxhash/xxhash_cbor (so those keys never match
  across processes unless PYTHONHASHSEED is set);
- ``extra_keys`` is ``None`` or a tuple of: ``("lora", lora_name, lora_path)`` for a LoRA
  request, then multimodal keys, then ``("cache_salt", salt)`` on the first block only,
  then prompt-embeds keys. kvctl covers LoRA and cache_salt (text-only prompts);
- only full blocks are hashed.

Mooncake (vLLM's Mooncake store connector, ``mooncake/store/data.py`` ``PoolKey``) stores
a block under ``[cache_prefix@]<model basename>@tp_rank:<r>@pcp0@dcp0@pp_rank:0@group:0@<hex>``
(no pipeline/context parallelism, one KV cache group, store block = hash block).

Older vLLM releases differ: before 0.11 the LoRA extra key was the bare name and an unset
PYTHONHASHSEED gave a random NONE_HASH for every algorithm.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.keys.chain import digest_function
from kvctl.keys.profiles.base import (
    KeyConfig,
    Keyer,
    KeyFormat,
    KeyProfile,
    SeedInfo,
    register_instance,
)
from kvctl.keys.prompts import Prompt

VLLM_VERSION = "0.33.0"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: vLLM's pickle protocol (``pickle.HIGHEST_PROTOCOL`` on Python 3.8-3.13).
PICKLE_PROTOCOL = 5

ObjectHash = Callable[[Any], bytes]


def _cbor_dumps() -> Callable[[Any], bytes]:
    try:
        import cbor2
    except ImportError as exc:
        raise UnavailableError("unavailable: the CBOR profiles need the cbor2 package",
                               "pip install cbor2") from exc

    def dumps(obj: Any) -> bytes:
        out: bytes = cbor2.dumps(obj, canonical=True)
        return out

    return dumps


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def object_hash(algo: str) -> ObjectHash:
    """vLLM's hash function ``algo`` (``sha256``, ``sha256_cbor``, ``xxhash``,
    ``xxhash_cbor``) as ``object -> digest bytes``."""
    dumps = _cbor_dumps() if algo.endswith("_cbor") else _pickle_dumps
    digest = digest_function("xxh3-128" if algo.startswith("xxhash") else "sha256")

    def hash_object(obj: Any) -> bytes:
        return digest(dumps(obj))

    return hash_object


def none_hash_seed(algo: str, pythonhashseed: str | None) -> tuple[str, str]:
    """``(seed string, source)`` as ``resolve_none_hash_seed`` picks it."""
    if pythonhashseed is not None:
        return pythonhashseed, "PYTHONHASHSEED"
    if algo.startswith("xxhash"):
        return os.urandom(32).hex(), "random"
    return DEFAULT_NONE_HASH_SEED, "default"


def extra_keys(prompt: Prompt, first_block: bool) -> tuple[Any, ...] | None:
    """The ``extra_keys`` vLLM mixes into one block of ``prompt``."""
    keys: list[Any] = []
    if prompt.lora is not None:
        keys.append(("lora", prompt.lora.name, prompt.lora.path))
    if first_block and prompt.cache_salt:
        keys.append(("cache_salt", prompt.cache_salt))
    return tuple(keys) if keys else None


def mooncake_key_prefix(config: KeyConfig) -> str:
    """The ``PoolKey`` prefix vLLM's Mooncake store connector puts before a block hash."""
    model = config.fields.model.rstrip("/").split("/")[-1]
    prefix = f"{config.store_prefix}@" if config.store_prefix else ""
    return f"{prefix}{model}@tp_rank:{config.tp_rank}@pcp0@dcp0@pp_rank:0@group:0@"


class _VllmKeyer(Keyer):
    def __init__(self, algo: str, config: KeyConfig) -> None:
        self.config = config
        self.hash = object_hash(algo)
        seed, source = none_hash_seed(algo, config.pythonhashseed)
        self.none_hash = self.hash(seed)
        self.seed = SeedInfo(source, self.none_hash.hex())
        self.prefix = (mooncake_key_prefix(config)
                       if config.key_format is KeyFormat.MOONCAKE else "")

    def block_hashes(self, prompt: Prompt) -> list[bytes]:
        size = self.config.block_size
        tokens = prompt.tokens
        parent = self.none_hash
        out: list[bytes] = []
        for start in range(0, len(tokens) // size * size, size):
            block = tuple(tokens[start : start + size])
            parent = self.hash((parent, block, extra_keys(prompt, start == 0)))
            out.append(parent)
        return out

    def keys(self, prompt: Prompt) -> list[str]:
        return [self.prefix + h.hex() for h in self.block_hashes(prompt)]


class VllmProfile(KeyProfile):
    """vLLM v1 prefix caching with one ``--prefix-caching-hash-algo``."""

    engine = "vllm"
    engine_version = VLLM_VERSION
    default_block_size = 16
    seed_doc = ("NONE_HASH = H($PYTHONHASHSEED) if set, else H('vllm-none-hash') for sha256*,"
                " random per process for xxhash*; extra keys: ('lora', name, path) every "
                "block, ('cache_salt', salt) first block")
    mixes = frozenset({"lora", "cache_salt", "pythonhashseed"})
    mooncake_mixes = frozenset({"model", "tp_rank", "store_prefix"})

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self.name = f"vllm:{algo}"

    def keyer(self, config: KeyConfig) -> Keyer:
        self.validate(config)
        if config.key_format is KeyFormat.MOONCAKE and not config.fields.model:
            raise UsageError("vLLM's Mooncake keys start with the model name, but --model "
                             "is not set", "pass --model as given to vLLM's --model")
        return _VllmKeyer(self.algo, config)


for _algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
    register_instance(VllmProfile(_algo))
