"""SGLang HiCache page keys (matches SGLang 0.5.23).

How SGLang builds them (``sglang/srt/mem_cache/utils.py`` ``get_hash_str`` /
``get_storage_hash_str``, native code in ``cpp_utils/hash_binding.cpp``):

- page ``i`` hash = ``SHA-256(prior_digest || token ids as little-endian uint32)``, written
  as 64 lowercase hex characters; ``prior_digest`` is the previous page's digest;
- the first page's prior is the *storage namespace*: ``None`` (no prior bytes at all) when
  the request has neither ``extra_key`` nor ``cache_salt``; otherwise
  ``SHA-256(b"sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))`` with
  ``part(None) = 00`` and ``part(s) = 01 || len(utf8(s)) as 8-byte little-endian || utf8(s)``;
- ``extra_key`` is the request's extra key with the LoRA id appended
  (``(extra_key or "") + lora_id``); kvctl uses the prompt's ``extra_key`` and
  ``lora.id`` (default the LoRA name);
- only full pages are written to the storage tier.

Mooncake (SGLang's Mooncake HiCache backend, ``mooncake_store.py``): each page is stored as
``<prefix>_<hash>_<tp_rank>_k`` and ``..._v`` (MHA, no pipeline parallelism), where
``<prefix>`` joins ``extra_backend_tag`` and the model path with ``/`` replaced by ``-``
using ``_``; kvctl reports the ``_k`` key.
"""

from __future__ import annotations

import hashlib

from kvctl.errors import UsageError
from kvctl.keys.chain import pack_tokens
from kvctl.keys.profiles.base import (
    KeyConfig,
    Keyer,
    KeyFormat,
    KeyProfile,
    SeedInfo,
    register_profile,
)
from kvctl.keys.prompts import Prompt

SGLANG_VERSION = "0.5.23"
NAMESPACE_DOMAIN = b"sglang-cache-namespace-v1"


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest SGLang seeds a storage chain with (``None``: unnamespaced)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(NAMESPACE_DOMAIN)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
        else:
            data = part.encode("utf-8")
            digest.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return digest.digest()


def request_extra_key(prompt: Prompt) -> str | None:
    """SGLang's ``Req.extra_key``: the caller's extra key plus the LoRA id."""
    if prompt.lora is None:
        return prompt.extra_key
    return (prompt.extra_key or "") + prompt.lora.lora_id


def mooncake_prefix(config: KeyConfig) -> str:
    """``config_prefix`` of SGLang's Mooncake store (with its trailing ``_``, or '')."""
    parts = [p for p in (config.store_prefix, "-".join(config.fields.model.split("/"))) if p]
    return "_".join(parts) + "_" if parts else ""


class _SglangKeyer(Keyer):
    def __init__(self, config: KeyConfig) -> None:
        self.config = config
        self.seed = SeedInfo("none", "")
        mooncake = config.key_format is KeyFormat.MOONCAKE
        self.head = mooncake_prefix(config) if mooncake else ""
        self.tail = f"_{config.tp_rank}_k" if mooncake else ""

    def page_digests(self, prompt: Prompt) -> list[bytes]:
        size = self.config.block_size
        full = len(prompt.tokens) // size * size
        data = pack_tokens(prompt.tokens[:full])
        prior = namespace_seed(request_extra_key(prompt), prompt.cache_salt) or b""
        out: list[bytes] = []
        step = size * 4
        for start in range(0, full * 4, step):
            prior = hashlib.sha256(prior + data[start : start + step]).digest()
            out.append(prior)
        return out

    def keys(self, prompt: Prompt) -> list[str]:
        return [f"{self.head}{d.hex()}{self.tail}" for d in self.page_digests(prompt)]


@register_profile
class SglangProfile(KeyProfile):
    """SGLang HiCache storage page hashes."""

    name = "sglang"
    engine = "sglang"
    engine_version = SGLANG_VERSION
    default_block_size = 64
    seed_doc = ("no seed: first page hashed alone, or after SHA-256('sglang-cache-namespace-"
                "v1', extra_key+lora_id, cache_salt) when either is set")
    mixes = frozenset({"lora", "cache_salt", "extra_key"})
    mooncake_mixes = frozenset({"model", "tp_rank", "store_prefix"})

    def keyer(self, config: KeyConfig) -> Keyer:
        self.validate(config)
        if config.key_format is KeyFormat.MOONCAKE and not config.fields.model:
            raise UsageError("SGLang's Mooncake keys start with the model path, but --model "
                             "is not set", "pass --model as given to SGLang's --model-path")
        return _SglangKeyer(config)
