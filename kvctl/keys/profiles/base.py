"""What every key profile provides, the settings it reads, and the registry of profiles.

A *profile* is one way of naming KV blocks: kvctl's own chain or an engine's scheme
reproduced byte for byte. ``profile.keyer(config)`` fixes everything that does not depend
on the request (the chain's first link, drawn at random where the engine does so) and
returns a :class:`Keyer` that turns each :class:`~kvctl.keys.prompts.Prompt` into its key
strings, one per full block, in block order.
"""

from __future__ import annotations

import abc
import dataclasses
import enum

from kvctl.errors import UsageError
from kvctl.keys.chain import SeedFields
from kvctl.keys.prompts import Prompt


class KeyFormat(enum.StrEnum):
    """How a key is written: the engine's own form, or the string a Mooncake connector
    stores it under."""

    RAW = "raw"
    MOONCAKE = "mooncake"


class LmcacheHost(enum.StrEnum):
    """What LMCache finds to import where it runs (its NONE_HASH and hash functions)."""

    VLLM = "vllm"
    NONE = "none"


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Engine settings that change key strings in some profiles only.

    Every field has the engine's default; a manifest records only the fields that differ
    from it (so manifests and fingerprints of setups without them stay as they were).

    Attributes:
        tp_size: tensor-parallel size (vLLM Mooncake: with ``num_kv_heads`` or ``mla``,
            decides which TP ranks share one object). ``None``: the rank is written as given.
        num_kv_heads: the model's total KV heads (vLLM Mooncake under GQA: ranks
            ``tp_size // num_kv_heads`` apart hold the same KV and share the key rank).
        mla: the model uses multi-head latent attention (vLLM Mooncake: rank 0 on every TP
            rank; SGLang Mooncake: ``<hash>__k``; LMCache: world size 1 in keys).
        pp_rank: pipeline-parallel rank (vLLM Mooncake ``@pp_rank:N``; SGLang Mooncake
            ``_{tp}_{pp}_k`` when ``pp_size > 1``).
        pp_size: pipeline-parallel size.
        save_unfull_chunk: LMCache ``save_unfull_chunk``: the trailing partial chunk gets a
            key too.
        layer_id: LMCache layer-wise mode (``use_layerwise``): keys of this layer
            (``...@<dtype>@<layer_id>``); ``None``: whole-chunk keys.
        lmcache_host: :class:`LmcacheHost`: ``vllm`` (LMCache inside vLLM) or ``none``
            (no vLLM importable: NONE_HASH is 0 and Python's builtin hash is used whatever
            ``pre_caching_hash_algorithm`` says).
        lora_paths: the adapters the engine was started with, as ``(name, path)`` pairs
            (SGLang ``--lora-paths``: their ``lora_id`` is ``uuid5(NAMESPACE_URL, name +
            "\\0" + path)``; vLLM ``--lora-modules``: the path its LoRA key holds), for
            prompts that name an adapter without its path.
    """

    tp_size: int | None = None
    num_kv_heads: int | None = None
    mla: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    save_unfull_chunk: bool = False
    layer_id: int | None = None
    lmcache_host: LmcacheHost = LmcacheHost.VLLM
    lora_paths: tuple[tuple[str, str], ...] = ()

    def changed(self) -> dict[str, object]:
        """The fields that differ from the defaults, as JSON-ready values."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = ([list(pair) for pair in value] if f.name == "lora_paths"
                               else str(value) if isinstance(value, enum.Enum) else value)
        return out

    def validate(self) -> None:
        """Raise :class:`UsageError` for values no engine accepts."""
        for name in ("tp_size", "num_kv_heads", "pp_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name.replace('_', '-')} {value} is not positive",
                                 "give the engine's value (1 or more)")
        if self.pp_rank < 0 or self.pp_rank >= self.pp_size:
            raise UsageError(f"--pp-rank {self.pp_rank} is outside 0..{self.pp_size - 1}",
                             "give the rank within --pp-size")
        if self.layer_id is not None and self.layer_id < 0:
            raise UsageError(f"--layer-id {self.layer_id} is negative",
                             "LMCache numbers layers from 0")
        names = [name for name, _ in self.lora_paths]
        if len(set(names)) != len(names):
            raise UsageError("an adapter name appears twice in --lora-paths",
                             "give each NAME=PATH once, as SGLang's --lora-paths")


@dataclasses.dataclass(frozen=True)
class KeyConfig:
    """One instance's settings that decide its keys.

    Attributes:
        profile: profile name, e.g. ``vllm:sha256_cbor``.
        block_size: tokens per block (vLLM block, LMCache chunk, SGLang page).
        fields: seed fields (model, revision, tenant, LoRA, KV dtype/layout, extra).
        pythonhashseed: the ``PYTHONHASHSEED`` the engine process sees (``None``: unset).
        world_size: LMCache key field (tensor-parallel world size).
        worker_id: LMCache key field (this worker's rank).
        tp_rank: tensor-parallel rank in Mooncake key strings.
        key_format: :class:`KeyFormat`.
        store_prefix: Mooncake key prefix: vLLM's ``cache_prefix``, SGLang's
            ``extra_backend_tag``.
        options: :class:`EngineOptions` (parallelism, MLA, LMCache and SGLang settings).
    """

    profile: str = "kvctl:sha256"
    block_size: int = 16
    fields: SeedFields = dataclasses.field(default_factory=SeedFields)
    pythonhashseed: str | None = None
    world_size: int = 1
    worker_id: int = 0
    tp_rank: int = 0
    key_format: KeyFormat = KeyFormat.RAW
    store_prefix: str = ""
    options: EngineOptions = dataclasses.field(default_factory=EngineOptions)


@dataclasses.dataclass(frozen=True)
class SeedInfo:
    """Where the first link of the chain came from.

    Attributes:
        source: ``fields`` (kvctl: hashed settings), ``PYTHONHASHSEED`` (the engine derived
            it from the variable), ``default`` (the engine's fixed default string),
            ``random`` (drawn per process: keys cannot match another process's),
            ``none`` (the engine has no seed).
        value: the seed material in hex or text (the ``NONE_HASH`` for vLLM/LMCache).
    """

    source: str
    value: str

    @property
    def reproducible(self) -> bool:
        """``False`` when another process can never compute the same keys."""
        return self.source != "random"


class Keyer(abc.ABC):
    """Keys of prompts under one fixed :class:`KeyConfig`."""

    seed: SeedInfo

    @abc.abstractmethod
    def keys(self, prompt: Prompt) -> list[str]:
        """One key string per full block of ``prompt``, in block order."""


class KeyProfile(abc.ABC):
    """A key scheme. Subclasses set the class attributes and implement :meth:`keyer`.

    Attributes:
        name: registry name (``vllm:sha256``).
        engine: ``kvctl``, ``vllm``, ``lmcache`` or ``sglang``.
        engine_version: the engine release whose keys this profile reproduces.
        default_block_size: the engine's default block/chunk/page size.
        seed_doc: how the engine builds the chain's first link (shown by ``profiles``).
        mixes: which settings change the keys (:data:`SETTINGS`).
        mooncake_mixes: settings that only the Mooncake key string adds.
    """

    name: str = ""
    engine: str = ""
    engine_version: str = ""
    default_block_size: int = 16
    seed_doc: str = ""
    mixes: frozenset[str] = frozenset()
    mooncake_mixes: frozenset[str] = frozenset()

    def mixed(self, key_format: KeyFormat) -> frozenset[str]:
        """Settings that change this profile's key strings in ``key_format``."""
        extra = self.mooncake_mixes if key_format is KeyFormat.MOONCAKE else frozenset()
        return self.mixes | extra | {"tokens", "block_size"}

    def validate(self, config: KeyConfig) -> None:
        """Raise :class:`UsageError` when ``config`` lacks what this profile needs."""
        if config.block_size <= 0:
            raise UsageError(f"block size {config.block_size} is not positive",
                             f"use e.g. --block-size {self.default_block_size}")
        config.options.validate()
        if config.key_format is KeyFormat.MOONCAKE and not self.mooncake_mixes:
            raise UsageError(f"profile {self.name} has no Mooncake key format",
                             "use --key-format raw, or an engine profile")

    def keyed_blocks(self, num_tokens: int, config: KeyConfig) -> int:
        """How many keys a prompt of ``num_tokens`` tokens gets (full blocks only, unless
        the profile keys a trailing partial block too)."""
        return num_tokens // config.block_size

    @abc.abstractmethod
    def keyer(self, config: KeyConfig) -> Keyer:
        """A :class:`Keyer` for ``config`` (validated first)."""


#: Names of the settings a diagnosis can blame, in the order it reports them.
SETTINGS = (
    "profile", "block_size", "tokens", "model", "revision", "tenant", "lora", "cache_salt",
    "extra_key", "mm", "prompt_embeds", "lmcache_tags", "kv_dtype", "kv_layout", "extra",
    "pythonhashseed", "world_size", "worker_id", "tp_rank", "tp_size", "num_kv_heads", "mla",
    "pp_rank", "pp_size", "save_unfull_chunk", "layer_id", "lmcache_host", "lora_paths",
    "store_prefix", "key_format",
)

_PROFILES: dict[str, KeyProfile] = {}


def register_profile(cls: type[KeyProfile]) -> type[KeyProfile]:
    """Class decorator: make a profile available by its ``name``."""
    _PROFILES[cls.name] = cls()
    return cls


def register_instance(profile: KeyProfile) -> None:
    """Register an already-built profile (parametrised families, e.g. per hash)."""
    _PROFILES[profile.name] = profile


def known_profiles() -> dict[str, KeyProfile]:
    """Every registered profile by name, sorted."""
    return dict(sorted(_PROFILES.items()))


def get_profile(name: str) -> KeyProfile:
    """The profile called ``name``.

    Raises:
        UsageError: unknown name; the hint lists the known ones.
    """
    try:
        return _PROFILES[name]
    except KeyError:
        raise UsageError(f"unknown key profile {name!r}",
                         f"known profiles: {', '.join(sorted(_PROFILES))}") from None
