"""LMCache chunk keys (matches LMCache 0.5.6 running inside vLLM 0.33.0, or without vLLM).

How LMCache builds them (``lmcache/v1/token_database.py`` ``ChunkedTokenDatabase``,
``lmcache/utils.py`` ``CacheEngineKey`` and ``LayerCacheEngineKey``):

- tokens are cut into chunks of ``chunk_size`` (default 256); with the default
  ``save_unfull_chunk: false`` only full chunks get keys, with ``true`` the trailing partial
  chunk gets one too;
- ``prefix = NONE_HASH``; per chunk ``prefix = H((prefix, tuple(chunk), ()))`` where ``H``
  is ``pre_caching_hash_algorithm``: ``builtin`` (default, Python's ``hash``) or a vLLM
  hash function (``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``), whose digest is
  folded to an int from its first 8 bytes (big-endian);
- inside vLLM, ``NONE_HASH`` comes from vLLM's ``init_none_hash(H)``: ``H($PYTHONHASHSEED)``
  when set, else ``H("vllm-none-hash")`` (xxhash*: random per process). With ``builtin``
  that is ``hash(str)``, which itself depends on the interpreter's PYTHONHASHSEED: unset
  (or ``random``) means a random value per process (LMCache warns: set PYTHONHASHSEED for
  cross-process sharing). kvctl recomputes CPython's ``hash(str)`` for a given seed
  (:mod:`kvctl.keys.pyhash`); ``hash`` of a tuple of ints does not depend on the seed;
- without vLLM (LMCache under SGLang or standalone, ``--lmcache-host none``) nothing of
  vLLM can be imported: ``NONE_HASH = 0`` and every ``pre_caching_hash_algorithm`` falls
  back to the builtin ``hash`` (LMCache logs a warning), so keys do not depend on
  PYTHONHASHSEED at all;
- the key string is ``model_name@world_size@worker_id@<chunk hash hex>@<kv dtype>``, the
  hash in Python's ``'{:x}'`` form (negative values keep their ``-`` sign); layer-wise
  mode (``use_layerwise``) writes one key per layer with ``@<layer_id>`` after the dtype;
  the request's tags (``kv_transfer_params`` entries ``lmcache.tag.<k>``) follow as
  ``@k%v`` in request order. Under MLA (``save_only_first_rank``, on by default with MLA)
  the world size in keys is 1. LoRA and cache_salt are *not* mixed in;
- LMCache's Mooncake store connector stores each chunk under this same string.
"""

from __future__ import annotations

import os

from kvctl.errors import UsageError
from kvctl.keys.profiles.base import (
    KeyConfig,
    Keyer,
    KeyProfile,
    LmcacheHost,
    SeedInfo,
    register_instance,
)
from kvctl.keys.profiles.vllm import none_hash_seed, object_hash
from kvctl.keys.prompts import Prompt
from kvctl.keys.pyhash import parse_hash_seed, str_hash

LMCACHE_VERSION = "0.5.6"
ALGOS = ("builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _fold(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


def _builtin_none_hash(seed_text: str | None) -> tuple[int, str]:
    """vLLM's ``init_none_hash(hash)``: ``hash(seed string)`` under the interpreter's seed."""
    if seed_text == "":
        return 0, "PYTHONHASHSEED"  # vLLM hashes '', and hash('') is 0 under every secret
    if seed_text is None or parse_hash_seed(seed_text) is None:
        # hash(<seed string>) under a random interpreter secret: any 64-bit value.
        return int.from_bytes(os.urandom(8), "big", signed=True), "random"
    return str_hash(seed_text, seed_text), "PYTHONHASHSEED"


class _LmcacheKeyer(Keyer):
    def __init__(self, algo: str, config: KeyConfig) -> None:
        self.config = config
        seed_text = config.pythonhashseed
        parse_hash_seed(seed_text)  # the engine's interpreter must be able to start
        options = config.options
        if options.lmcache_host is LmcacheHost.NONE:
            self.algo = "builtin"  # LMCache finds no vLLM hash function and falls back
            self.none_hash, source = 0, "default"
        elif algo == "builtin":
            self.algo = algo
            self.none_hash, source = _builtin_none_hash(seed_text)
        else:
            self.algo = algo
            self.hash = object_hash(algo)
            seed, source = none_hash_seed(algo, seed_text)  # current vLLM: never None
            self.none_hash = _fold(self.hash(seed if seed is not None else os.urandom(32)))
        self.seed = SeedInfo(source, str(self.none_hash))
        fields = config.fields
        world_size = 1 if options.mla else config.world_size
        self.head = f"{fields.model}@{world_size}@{config.worker_id}@"
        layer = "" if options.layer_id is None else f"@{options.layer_id}"
        self.tail = f"@{fields.kv_dtype}{layer}"

    def chunk_hashes(self, prompt: Prompt) -> list[int]:
        size = self.config.block_size
        tokens = prompt.tokens
        end = len(tokens) if self.config.options.save_unfull_chunk else len(tokens) // size * size
        prefix = self.none_hash
        out: list[int] = []
        for start in range(0, end, size):
            chunk = tuple(tokens[start : start + size])
            if self.algo == "builtin":
                prefix = hash((prefix, chunk, ()))
            else:
                prefix = _fold(self.hash((prefix, chunk, ())))
            out.append(prefix)
        return out

    def keys(self, prompt: Prompt) -> list[str]:
        tags = "".join(f"@{k}%{v}" for k, v in prompt.lmcache_tags)
        return [f"{self.head}{h:x}{self.tail}{tags}" for h in self.chunk_hashes(prompt)]


class LmcacheProfile(KeyProfile):
    """LMCache's chunked token database with one ``pre_caching_hash_algorithm``."""

    engine = "lmcache"
    engine_version = LMCACHE_VERSION
    default_block_size = 256
    seed_doc = ("NONE_HASH = H($PYTHONHASHSEED or 'vllm-none-hash') via vLLM (0 and builtin "
                "hash without vLLM); builtin hash needs PYTHONHASHSEED set to be reproducible;"
                " key string model@world_size@worker_id@hash@dtype[@layer][@tag%value]; "
                "no LoRA/salt")
    mixes = frozenset({"pythonhashseed", "model", "world_size", "worker_id", "kv_dtype",
                       "lmcache_tags", "mla", "layer_id", "save_unfull_chunk",
                       "lmcache_host"})
    mooncake_mixes = mixes

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self.name = "lmcache" if algo == "builtin" else f"lmcache:{algo}"

    def keyed_blocks(self, num_tokens: int, config: KeyConfig) -> int:
        size = config.block_size
        if config.options.save_unfull_chunk:
            return -(-num_tokens // size)
        return num_tokens // size

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


for _algo in ALGOS:
    register_instance(LmcacheProfile(_algo))
