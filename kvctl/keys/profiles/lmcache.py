"""LMCache chunk keys (matches LMCache 0.5.6 running inside vLLM 0.33.0).

How LMCache builds them (``lmcache/v1/token_database.py`` ``ChunkedTokenDatabase``,
``lmcache/utils.py`` ``CacheEngineKey``):

- tokens are cut into chunks of ``chunk_size`` (default 256); with the default
  ``save_unfull_chunk: false`` only full chunks get keys;
- ``prefix = NONE_HASH``; per chunk ``prefix = H((prefix, tuple(chunk), ()))`` where ``H``
  is ``pre_caching_hash_algorithm``: ``builtin`` (default, Python's ``hash``) or a vLLM
  hash such as ``sha256_cbor``, whose 32-byte digest is folded to an int from its first
  8 bytes (big-endian);
- ``NONE_HASH`` comes from vLLM's ``init_none_hash(H)``: ``H($PYTHONHASHSEED)`` when set,
  else ``H("vllm-none-hash")``. With ``builtin`` that is ``hash(str)``, which itself depends
  on the interpreter's PYTHONHASHSEED: unset means a random value per process (LMCache
  warns: set PYTHONHASHSEED for cross-process sharing). kvctl recomputes CPython's
  ``hash(str)`` for a given seed (:mod:`kvctl.keys.pyhash`); ``hash`` of a tuple of ints
  does not depend on the seed;
- the key string is ``model_name@world_size@worker_id@<chunk hash hex>@<kv dtype>``, the
  hash in Python's ``'{:x}'`` form (negative values keep their ``-`` sign). LoRA and
  cache_salt are *not* mixed in (LMCache passes no extra keys);
- LMCache's Mooncake store connector stores each chunk under this same string.
"""

from __future__ import annotations

import os

from kvctl.errors import UsageError
from kvctl.keys.profiles.base import (
    KeyConfig,
    Keyer,
    KeyProfile,
    SeedInfo,
    register_instance,
)
from kvctl.keys.profiles.vllm import DEFAULT_NONE_HASH_SEED, object_hash
from kvctl.keys.prompts import Prompt
from kvctl.keys.pyhash import str_hash

LMCACHE_VERSION = "0.5.6"


def _fold(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


class _LmcacheKeyer(Keyer):
    def __init__(self, algo: str, config: KeyConfig) -> None:
        self.algo = algo
        self.config = config
        seed_text = config.pythonhashseed
        if algo == "builtin":
            if seed_text is None or seed_text == "random":
                # hash(<seed string>) under a random interpreter secret: any 64-bit value.
                self.none_hash = int.from_bytes(os.urandom(8), "big", signed=True)
                source = "random"
            else:
                # vLLM hashes the variable's text; CPython seeds hash() from the same text
                # ("" leaves hash() random, but hash("") is 0 under every secret).
                self.none_hash = str_hash(seed_text, seed_text) if seed_text else 0
                source = "PYTHONHASHSEED"
        else:
            self.hash = object_hash(algo)
            source = "PYTHONHASHSEED" if seed_text is not None else "default"
            self.none_hash = _fold(self.hash(seed_text if seed_text is not None
                                             else DEFAULT_NONE_HASH_SEED))
        self.seed = SeedInfo(source, str(self.none_hash))
        fields = config.fields
        self.head = f"{fields.model}@{config.world_size}@{config.worker_id}@"
        self.tail = f"@{fields.kv_dtype}"

    def chunk_hashes(self, prompt: Prompt) -> list[int]:
        size = self.config.block_size
        tokens = prompt.tokens
        prefix = self.none_hash
        out: list[int] = []
        for start in range(0, len(tokens) // size * size, size):
            chunk = tuple(tokens[start : start + size])
            if self.algo == "builtin":
                prefix = hash((prefix, chunk, ()))
            else:
                prefix = _fold(self.hash((prefix, chunk, ())))
            out.append(prefix)
        return out

    def keys(self, prompt: Prompt) -> list[str]:
        return [f"{self.head}{h:x}{self.tail}" for h in self.chunk_hashes(prompt)]


class LmcacheProfile(KeyProfile):
    """LMCache's chunked token database with one ``pre_caching_hash_algorithm``."""

    engine = "lmcache"
    engine_version = LMCACHE_VERSION
    default_block_size = 256
    seed_doc = ("NONE_HASH = H($PYTHONHASHSEED or 'vllm-none-hash') via vLLM; builtin hash "
                "needs PYTHONHASHSEED set to be reproducible; key string "
                "model@world_size@worker_id@hash@dtype; no LoRA/salt")
    mixes = frozenset({"pythonhashseed", "model", "world_size", "worker_id", "kv_dtype"})
    mooncake_mixes = mixes

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self.name = "lmcache" if algo == "builtin" else f"lmcache:{algo}"

    def keyer(self, config: KeyConfig) -> Keyer:
        self.validate(config)
        missing = [flag for flag, value in (("--model", config.fields.model),
                                            ("--kv-dtype", config.fields.kv_dtype)) if not value]
        if missing:
            raise UsageError(f"profile {self.name} writes the model and KV dtype into every key,"
                             f" but {' and '.join(missing)} is not set",
                             "pass e.g. --model Qwen/Qwen3-8B --kv-dtype bfloat16 "
                             "(LMCache dtype names: half, bfloat16, float, fp8_e4m3fn, ...)")
        return _LmcacheKeyer(self.algo, config)


for _algo in ("builtin", "sha256_cbor"):
    register_instance(LmcacheProfile(_algo))
