"""Recompute the hashes of a ``BlockStored`` the way its engine did, from its own fields.

vLLM (``hash_block_tokens``): ``digest = H((parent digest or NONE_HASH, tuple(tokens),
extra_keys))``. The event publishes each block's extra keys *untagged* (LoRA name,
``(mm id, offset)`` pairs, the cache_salt string, prompt-embeds digests, in that order); the
hash uses them tagged (``("lora", name, path)``, ``("mm", id, offset)``, ``("cache_salt",
salt)``, ``("prompt_embeds", digest)``), so :func:`vllm_extra_keys` puts the tags back and
takes the LoRA path, which the event does not carry, from the configuration. A published int
is the low 8 bytes of the digest, big-endian and unsigned.

SGLang (``get_storage_hash_str`` + ``hash_str_to_int64``): ``digest = SHA-256(parent digest
|| tokens as little-endian uint32)`` from an empty prior; the published int is the *first*
8 bytes, signed. Events of namespaced requests (cache_salt, LoRA) are hashed under seeds
kvctl does not reproduce: they are reported unverifiable, never as mismatches.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import pickle
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

from kvctl.errors import UsageError
from kvctl.keys.chain import MAX_TOKEN_ID, pack_tokens
from kvctl.keys.profiles import KeyConfig, get_profile
from kvctl.keys.profiles.vllm import (
    PICKLE_PROTOCOL,
    Shape,
    VllmProfile,
    none_hash_seed,
    object_hash,
)

_U64 = (1 << 64) - 1


class Unverifiable(Exception):  # noqa: N818 - a verdict on one block, not a failure
    """A block kvctl cannot recompute: ``reason`` in words (counted per reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventHasher(abc.ABC):
    """One engine's block hash, from the event's own fields.

    Attributes:
        profile: the key profile it reproduces.
        block_size: tokens per block the configuration says.
        root_unverifiable: why no chain can be checked at all (a random seed), or ``None``.
    """

    profile: str
    block_size: int
    root_unverifiable: str | None = None

    @abc.abstractmethod
    def block(self, parent: bytes | None, tokens: Sequence[int], extra: Any,
              lora_name: str | None, salt: str | None) -> bytes:
        """The full digest of one block after ``parent`` (``None``: the chain's root).

        Raises:
            Unverifiable: this block cannot be recomputed (why).
        """

    @abc.abstractmethod
    def published(self, digest: bytes, like: int | bytes) -> int | bytes:
        """``digest`` in the form the engine publishes, the form of ``like`` (int or bytes)."""

    @abc.abstractmethod
    def published_int(self, digest: bytes) -> int:
        """``digest`` as the engine publishes it as an int (the hot path's form)."""


class VllmEventHasher(EventHasher):
    """vLLM's ``hash_block_tokens`` under one ``--prefix-caching-hash-algo`` and seed."""

    def __init__(self, profile: VllmProfile, config: KeyConfig) -> None:
        self.profile = profile.name
        self.algo = profile.algo
        self.block_size = config.block_size
        self.hash = _direct_hash(profile.algo)
        seed, source = none_hash_seed(profile.algo, config.pythonhashseed, profile.era)
        self.seed_source = source
        self.root_unverifiable = (
            f"{profile.name} draws NONE_HASH at random per process when PYTHONHASHSEED is "
            "unset: no other process can recompute its hashes" if source == "random" else None)
        self.none_hash = self.hash(seed) if seed is not None else b""
        paths = dict(config.options.lora_paths)
        if config.fields.lora_name:
            paths.setdefault(config.fields.lora_name, config.fields.lora_path)
        self.lora_paths = paths
        self.tagged = profile.era.lora is Shape.TAGGED

    def block(self, parent: bytes | None, tokens: Sequence[int], extra: Any,
              lora_name: str | None, salt: str | None) -> bytes:
        parent = parent or self.none_hash
        if extra is None:
            return self.hash((parent, tuple(tokens), None))
        keys = (vllm_extra_keys(extra, lora_name, self.lora_paths) if self.tagged
                else _tuples(extra))
        return self.hash((parent, tuple(tokens), keys))

    def published(self, digest: bytes, like: int | bytes) -> int | bytes:
        if isinstance(like, bytes):
            return digest
        return int.from_bytes(digest[-8:], "big")

    def published_int(self, digest: bytes) -> int:
        return int.from_bytes(digest[-8:], "big")


def _tuples(value: Any) -> Any:
    """msgpack lists back to the tuples vLLM hashed (pickle tells them apart)."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    return value


def _direct_hash(algo: str) -> Callable[[Any], bytes]:
    """:func:`~kvctl.keys.profiles.vllm.object_hash` in one call frame (the hot path):
    the same serialisation and digest, checked equal to it on first use."""
    generic = object_hash(algo)
    if algo.endswith("_cbor"):
        import cbor2

        dumps: Callable[[Any], bytes] = functools.partial(cbor2.dumps, canonical=True)
    else:
        dumps = functools.partial(pickle.dumps, protocol=PICKLE_PROTOCOL)
    if algo.startswith("xxhash"):
        import xxhash

        def direct(obj: Any) -> bytes:
            out: bytes = xxhash.xxh3_128_digest(dumps(obj))
            return out
    else:
        sha256 = hashlib.sha256

        def direct(obj: Any) -> bytes:
            return sha256(dumps(obj)).digest()
    probe = ("kvctl", (1, 2, 3), None)
    return direct if direct(probe) == generic(probe) else generic


def vllm_extra_keys(entry: Sequence[Any], lora_name: str | None,
                    lora_paths: dict[str, str]) -> tuple[Any, ...] | None:
    """One block's published extra keys, tagged back as vLLM hashes them.

    Raises:
        Unverifiable: a LoRA block whose adapter path is not configured.
    """
    out: list[Any] = []
    items = list(entry)
    if lora_name is not None and items and isinstance(items[0], str):
        name = items.pop(0)
        path = lora_paths.get(name)
        if path is None:
            raise Unverifiable(f"LoRA adapter {reprlib.repr(name)}: vLLM hashes its path, "
                               "which the event does not carry (give --lora-paths "
                               "NAME=PATH as in vLLM's --lora-modules)")
        out.append(("lora", name, path))
    for item in items:
        if isinstance(item, list | tuple):
            out.append(("mm", *item))
        elif isinstance(item, str):
            out.append(("cache_salt", item))
        elif isinstance(item, bytes):
            out.append(("prompt_embeds", item))
        else:
            raise Unverifiable(f"extra key {reprlib.repr(item)} of a type vLLM does not "
                               "publish")
    return tuple(out) if out else None


class SglangEventHasher(EventHasher):
    """SGLang's page hash as its events publish it (first 8 bytes, signed)."""

    def __init__(self, config: KeyConfig) -> None:
        self.profile = "sglang"
        self.block_size = config.block_size

    def block(self, parent: bytes | None, tokens: Sequence[int], extra: Any,
              lora_name: str | None, salt: str | None) -> bytes:
        if salt is not None or lora_name is not None:
            raise Unverifiable("SGLang namespaces the hashes of salted and LoRA requests "
                               "with seeds kvctl does not reproduce")
        prior = parent or b""
        if tokens and max(tokens) > MAX_TOKEN_ID:
            wide = b"".join(t.to_bytes(8, "little") for t in tokens)
            return hashlib.sha256(prior + b"\xff" + wide).digest()
        return hashlib.sha256(prior + pack_tokens(tokens)).digest()

    def published(self, digest: bytes, like: int | bytes) -> int | bytes:
        if isinstance(like, bytes):
            return digest
        return int.from_bytes(digest[:8], "big", signed=True)

    def published_int(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "big", signed=True)


def event_hasher(config: KeyConfig) -> EventHasher:
    """The hasher of ``config``'s profile.

    Raises:
        UsageError: a profile whose engine publishes no KV events (kvctl's own, LMCache).
    """
    profile = get_profile(config.profile)
    profile.validate(config)
    if isinstance(profile, VllmProfile):
        return VllmEventHasher(profile, config)
    if profile.name == "sglang":
        return SglangEventHasher(config)
    raise UsageError(f"profile {config.profile} belongs to no engine that publishes KV events",
                     "use a vllm:* profile (e.g. vllm:sha256_cbor) or sglang")


def alternatives(config: KeyConfig) -> list[tuple[str, str, EventHasher]]:
    """Other settings to try on a mismatching block, as ``(setting, value, hasher)``: each
    hash algorithm of the same engine, and the default seed, for the diagnosis."""
    out: list[tuple[str, str, EventHasher]] = []
    profile = get_profile(config.profile)
    if not isinstance(profile, VllmProfile):
        return out
    family = profile.era.family
    for algo in profile.era.algos:
        if algo != profile.algo:
            other = get_profile(f"{family}:{algo}")
            if not isinstance(other, VllmProfile):
                continue
            hasher = VllmEventHasher(other, config)
            if hasher.root_unverifiable is None:
                out.append(("profile", other.name, hasher))
    if config.pythonhashseed is not None:
        unset = dataclasses.replace(config, pythonhashseed=None)
        hasher = VllmEventHasher(profile, unset)
        if hasher.root_unverifiable is None:
            out.append(("pythonhashseed", "unset", hasher))
    return out
