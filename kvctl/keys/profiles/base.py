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
        if config.key_format is KeyFormat.MOONCAKE and not self.mooncake_mixes:
            raise UsageError(f"profile {self.name} has no Mooncake key format",
                             "use --key-format raw, or an engine profile")

    @abc.abstractmethod
    def keyer(self, config: KeyConfig) -> Keyer:
        """A :class:`Keyer` for ``config`` (validated first)."""


#: Names of the settings a diagnosis can blame, in the order it reports them.
SETTINGS = (
    "profile", "block_size", "tokens", "model", "revision", "tenant", "lora", "cache_salt",
    "extra_key", "kv_dtype", "kv_layout", "extra", "pythonhashseed", "world_size",
    "worker_id", "tp_rank", "store_prefix", "key_format",
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
