"""vLLM v1 prefix-caching block hashes (matches vLLM 0.33.0, and older releases by era).

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
- ``extra_keys`` is ``None`` or a tuple of, in this order: ``("lora", lora_name,
  lora_path)`` for a LoRA request; ``("mm", identifier, item offset - block start)`` for
  each multimodal item the block overlaps; ``("cache_salt", salt)`` on the first block only
  (an empty salt adds nothing); ``("prompt_embeds", SHA-256 of the block's embedding
  rows)`` when the request carries prompt embeddings;
- only full blocks are hashed.

Mooncake (vLLM's Mooncake store connector, ``mooncake/store/data.py`` ``PoolKey``) stores
a block under ``[cache_prefix@]<model basename>@tp_rank:<r>@pcp0@dcp0@pp_rank:<p>@group:0@
<hex>`` (no context parallelism, one KV cache group, store block = hash block). ``r`` is
the TP rank divided by the number of TP ranks that hold identical KV
(``store/worker.py`` ``_spec_tp_replication_factor``): ``tp_size`` under MLA (so always 0),
``max(1, tp_size // num_kv_heads)`` otherwise.

Older releases (each era a profile family ``vllm-<first release>:<algo>``; the shapes were
read from each release's ``kv_cache_utils.py`` and the first and last release of every era
were executed by scripts/record_key_vectors; see docs/keys.md):

================  ==============  ===============  ============  ==========  =============
family            releases        LoRA key         mm key        embeds      unset seed
================  ==============  ===============  ============  ==========  =============
``vllm-0.10.2``   0.10.2-0.11.0   ``lora_int_id``  identifier    not hashed  random
``vllm-0.11.1``   0.11.1-0.12.x   LoRA name        identifier    raw bytes   random
``vllm-0.13``     0.13.0-0.16.x   LoRA name        identifier    raw bytes   random
``vllm-0.17``     0.17.0-0.18.x   LoRA name        identifier    SHA-256     random
``vllm-0.19``     0.19.0-0.28.x   LoRA name        (id, offset)  SHA-256     random
``vllm-0.29``     0.29.0-0.30.x   LoRA name        (id, offset)  SHA-256     fixed default
``vllm``          0.31.0 on       tagged tuple     tagged tuple  tagged      fixed default
================  ==============  ===============  ============  ==========  =============

Before 0.31 the cache_salt key is the bare salt; before 0.29 an unset PYTHONHASHSEED gave
``NONE_HASH = os.urandom(32)`` for every algorithm; xxhash and xxhash_cbor exist from 0.13.
Only the current family has Mooncake key strings (older store connectors used other rank
rules, and there is none before 0.2x).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
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
from kvctl.keys.pyhash import parse_hash_seed

VLLM_VERSION = "0.33.0"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: vLLM's pickle protocol (``pickle.HIGHEST_PROTOCOL`` on Python 3.8-3.13).
PICKLE_PROTOCOL = 5
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

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


class Shape(enum.StrEnum):
    """How one kind of extra key is written in a release."""

    ABSENT = "absent"  # not mixed into block hashes
    BARE = "bare"  # the value alone
    OFFSET = "offset"  # mm: (identifier, offset in block)
    RAW = "raw"  # prompt embeds: the block's bytes themselves
    DIGEST = "digest"  # prompt embeds: SHA-256 of the block's bytes
    INT_ID = "int_id"  # LoRA: the request's lora_int_id
    TAGGED = "tagged"  # ("lora", name, path), ("mm", id, offset), ("cache_salt", s), ...


@dataclasses.dataclass(frozen=True)
class Era:
    """The releases that hash blocks one way.

    Attributes:
        family: profile name before ``:`` (``vllm``, ``vllm-0.29``).
        releases: the releases covered, in words.
        version: the release the shapes were read from (a profile's ``engine_version``).
        fixed_default_seed: an unset PYTHONHASHSEED gives ``H('vllm-none-hash')`` for the
            cryptographic hashes (0.29 on) instead of 32 random bytes.
        lora, mm, cache_salt, prompt_embeds: :class:`Shape` of each extra key.
        algos: the ``--prefix-caching-hash-algo`` values the releases offer.
        mooncake: whether kvctl writes this era's Mooncake store keys.
    """

    family: str
    releases: str
    version: str
    fixed_default_seed: bool
    lora: Shape
    mm: Shape
    cache_salt: Shape
    prompt_embeds: Shape
    algos: tuple[str, ...] = ALGOS
    mooncake: bool = False


ERAS = (
    Era("vllm", "0.31.0 and later", VLLM_VERSION, fixed_default_seed=True,
        lora=Shape.TAGGED, mm=Shape.TAGGED, cache_salt=Shape.TAGGED,
        prompt_embeds=Shape.TAGGED, mooncake=True),
    Era("vllm-0.29", "0.29.0-0.30.x", "0.30.0", fixed_default_seed=True,
        lora=Shape.BARE, mm=Shape.OFFSET, cache_salt=Shape.BARE, prompt_embeds=Shape.DIGEST),
    Era("vllm-0.19", "0.19.0-0.28.x", "0.28.0", fixed_default_seed=False,
        lora=Shape.BARE, mm=Shape.OFFSET, cache_salt=Shape.BARE, prompt_embeds=Shape.DIGEST),
    Era("vllm-0.17", "0.17.0-0.18.x", "0.18.1", fixed_default_seed=False,
        lora=Shape.BARE, mm=Shape.BARE, cache_salt=Shape.BARE, prompt_embeds=Shape.DIGEST),
    Era("vllm-0.13", "0.13.0-0.16.x", "0.16.0", fixed_default_seed=False,
        lora=Shape.BARE, mm=Shape.BARE, cache_salt=Shape.BARE, prompt_embeds=Shape.RAW),
    Era("vllm-0.11.1", "0.11.1-0.12.x", "0.12.0", fixed_default_seed=False,
        lora=Shape.BARE, mm=Shape.BARE, cache_salt=Shape.BARE, prompt_embeds=Shape.RAW,
        algos=("sha256", "sha256_cbor")),
    Era("vllm-0.10.2", "0.10.2-0.11.0", "0.11.0", fixed_default_seed=False,
        lora=Shape.INT_ID, mm=Shape.BARE, cache_salt=Shape.BARE, prompt_embeds=Shape.ABSENT,
        algos=("sha256", "sha256_cbor")),
)


def none_hash_seed(algo: str, pythonhashseed: str | None,
                   era: Era = ERAS[0]) -> tuple[str | None, str]:
    """``(seed string, source)`` as ``resolve_none_hash_seed`` picks it; a ``None`` seed
    means NONE_HASH is 32 random bytes themselves (releases before 0.29).

    Raises:
        UsageError: a PYTHONHASHSEED with which the engine's interpreter does not start.
    """
    parse_hash_seed(pythonhashseed)  # CPython refuses to start on a bad value: so do we
    if pythonhashseed is not None:
        return pythonhashseed, "PYTHONHASHSEED"
    if not era.fixed_default_seed:
        return None, "random"
    if algo.startswith("xxhash"):
        return os.urandom(32).hex(), "random"
    return DEFAULT_NONE_HASH_SEED, "default"


def _mm_keys(prompt: Prompt, start: int, end: int, era: Era) -> list[Any]:
    """``_gen_mm_extra_hash_keys``: one key per item overlapping tokens ``start..end-1``."""
    keys: list[Any] = []
    for item in prompt.mm:
        if item.offset >= end:
            break  # items are sorted by offset: none later can overlap
        if start >= item.offset + item.length:
            continue
        if era.mm is Shape.TAGGED:
            keys.append(("mm", item.identifier, item.offset - start))
        elif era.mm is Shape.OFFSET:
            keys.append((item.identifier, item.offset - start))
        else:
            keys.append(item.identifier)
    return keys


def _lora_keys(prompt: Prompt, era: Era) -> list[Any]:
    lora = prompt.lora
    if lora is None:
        return []
    if era.lora is Shape.TAGGED:
        if not lora.path:
            raise UsageError(
                f"prompt {prompt.id!r}: vLLM {era.releases} keys LoRA blocks by adapter name "
                f"and path, but {lora.name!r} has no path",
                'give "lora": {"name": ..., "path": ...} with the path vLLM loaded it from, '
                "or kvctl's --lora-paths NAME=PATH as in vLLM's --lora-modules")
        return [("lora", lora.name, lora.path)]
    if era.lora is Shape.INT_ID:
        if not lora.id.isdigit():
            raise UsageError(
                f"prompt {prompt.id!r}: vLLM {era.releases} keys LoRA blocks by the adapter's "
                f"lora_int_id, which {lora.name!r} does not give",
                'add "id": "N" to the prompt\'s lora: the OpenAI server numbers adapters 1, 2, '
                "... in the order it loads them (--lora-modules first, then runtime loads)")
        return [int(lora.id)]
    return [lora.name]


def _embeds_keys(prompt: Prompt, start: int, end: int, era: Era) -> list[Any]:
    embeds = prompt.prompt_embeds
    if embeds is None or era.prompt_embeds is Shape.ABSENT:
        return []
    data = embeds.block(start, end)
    if era.prompt_embeds is Shape.RAW:
        return [data]
    digest = hashlib.sha256(data).digest()
    return [("prompt_embeds", digest)] if era.prompt_embeds is Shape.TAGGED else [digest]


def extra_keys(prompt: Prompt, start: int, end: int, era: Era = ERAS[0]
               ) -> tuple[Any, ...] | None:
    """The ``extra_keys`` vLLM mixes into the block of tokens ``start..end-1``
    (``generate_block_hash_extra_keys``)."""
    salt: list[Any] = []
    if start == 0 and prompt.cache_salt:
        salt = [("cache_salt", prompt.cache_salt) if era.cache_salt is Shape.TAGGED
                else prompt.cache_salt]
    keys = (_lora_keys(prompt, era) + _mm_keys(prompt, start, end, era) + salt
            + _embeds_keys(prompt, start, end, era))
    return tuple(keys) if keys else None


def mooncake_tp_rank(config: KeyConfig) -> int:
    """The rank vLLM's Mooncake store writes into keys (``tp_rank // replication``).

    Raises:
        UsageError: ``--tp-size`` without ``--num-kv-heads`` (or ``--mla``), or a TP rank
            outside ``--tp-size``.
    """
    options = config.options
    if options.tp_size is None:
        return 0 if options.mla else config.tp_rank
    if not 0 <= config.tp_rank < options.tp_size:
        raise UsageError(f"--tp-rank {config.tp_rank} is outside 0..{options.tp_size - 1}",
                         "give this worker's rank within --tp-size")
    if options.mla:
        return 0
    if options.num_kv_heads is None:
        raise UsageError(
            "vLLM's Mooncake keys divide the TP rank by tp_size // num_kv_heads (ranks that "
            "hold the same KV heads share one object), but --num-kv-heads is not set",
            "pass --num-kv-heads (num_key_value_heads of the model's config.json), or --mla")
    return config.tp_rank // max(1, options.tp_size // options.num_kv_heads)


def mooncake_key_prefix(config: KeyConfig) -> str:
    """The ``PoolKey`` prefix vLLM's Mooncake store connector puts before a block hash."""
    model = config.fields.model.rstrip("/").split("/")[-1]
    prefix = f"{config.store_prefix}@" if config.store_prefix else ""
    return (f"{prefix}{model}@tp_rank:{mooncake_tp_rank(config)}@pcp0@dcp0"
            f"@pp_rank:{config.options.pp_rank}@group:0@")


class _VllmKeyer(Keyer):
    def __init__(self, algo: str, era: Era, config: KeyConfig) -> None:
        self.config = config
        self.era = era
        self.hash = object_hash(algo)
        seed, source = none_hash_seed(algo, config.pythonhashseed, era)
        self.none_hash = os.urandom(32) if seed is None else self.hash(seed)
        self.seed = SeedInfo(source, self.none_hash.hex())
        self.prefix = (mooncake_key_prefix(config)
                       if config.key_format is KeyFormat.MOONCAKE else "")

    def block_hashes(self, prompt: Prompt) -> list[bytes]:
        size = self.config.block_size
        lora = prompt.lora
        if lora is not None and not lora.path:  # --lora-modules NAME=PATH, as vLLM started
            path = dict(self.config.options.lora_paths).get(lora.name, "")
            prompt = dataclasses.replace(prompt, lora=dataclasses.replace(lora, path=path))
        tokens = prompt.tokens
        parent = self.none_hash
        out: list[bytes] = []
        for start in range(0, len(tokens) // size * size, size):
            block = tuple(tokens[start : start + size])
            parent = self.hash((parent, block, extra_keys(prompt, start, start + size,
                                                          self.era)))
            out.append(parent)
        return out

    def keys(self, prompt: Prompt) -> list[str]:
        return [self.prefix + h.hex() for h in self.block_hashes(prompt)]


class VllmProfile(KeyProfile):
    """vLLM v1 prefix caching with one ``--prefix-caching-hash-algo``, in one era."""

    engine = "vllm"
    default_block_size = 16

    def __init__(self, algo: str, era: Era = ERAS[0]) -> None:
        self.algo = algo
        self.era = era
        self.name = f"{era.family}:{algo}"
        self.engine_version = era.version
        seed = ("H($PYTHONHASHSEED) if set, else H('vllm-none-hash') for sha256*, random per "
                "process for xxhash*" if era.fixed_default_seed else
                "H($PYTHONHASHSEED) if set, else 32 random bytes per process")
        lora = {Shape.TAGGED: "('lora', name, path)", Shape.BARE: "the LoRA name",
                Shape.INT_ID: "lora_int_id"}[era.lora]
        salt = "('cache_salt', salt)" if era.cache_salt is Shape.TAGGED else "the bare salt"
        self.seed_doc = (f"vLLM {era.releases}: NONE_HASH = {seed}; extra keys: {lora} every "
                         f"block, {salt} first block, multimodal items"
                         + ("" if era.prompt_embeds is Shape.ABSENT else ", prompt embeds"))
        self.mixes = frozenset({"lora", "cache_salt", "pythonhashseed", "mm", "lora_paths"}
                               | ({"prompt_embeds"} if era.prompt_embeds is not Shape.ABSENT
                                  else set()))
        self.mooncake_mixes = (frozenset({"model", "tp_rank", "store_prefix", "tp_size",
                                          "num_kv_heads", "mla", "pp_rank"})
                               if era.mooncake else frozenset())

    def keyer(self, config: KeyConfig) -> Keyer:
        self.validate(config)
        if config.key_format is KeyFormat.MOONCAKE and not config.fields.model:
            raise UsageError("vLLM's Mooncake keys start with the model name, but --model "
                             "is not set", "pass --model as given to vLLM's --model")
        return _VllmKeyer(self.algo, self.era, config)


for _era in ERAS:
    for _algo in _era.algos:
        register_instance(VllmProfile(_algo, _era))
