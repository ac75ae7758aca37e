"""SGLang HiCache page keys (matches SGLang 0.5.23).

How SGLang builds them (``sglang/srt/mem_cache/utils.py`` ``get_hash_str`` /
``get_storage_hash_str``, native code in ``cpp_utils/hash_binding.cpp``):

- page ``i`` hash = ``SHA-256(prior_digest || token ids as little-endian uint32)``, written
  as 64 lowercase hex characters; ``prior_digest`` is the previous page's digest. A page
  holding an id above 2**32-1 is hashed wide instead: ``SHA-256(prior_digest || 0xff ||
  token ids as little-endian uint64)`` (ids are int64: 0..2**63-1);
- the first page's prior is the *storage namespace*: ``None`` (no prior bytes at all) when
  the request has neither ``extra_key`` nor ``cache_salt``; otherwise
  ``SHA-256(b"sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))`` with
  ``part(None) = 00`` and ``part(s) = 01 || len(utf8(s)) as 8-byte little-endian || utf8(s)``
  (``storage_namespace_seed``), taken from the scheduler's ``Req``;
- an empty ``extra_key`` or ``cache_salt`` in a request is no value at all: every request
  passes ``GenerateReqInput.normalize_batch_and_arguments`` (``io_struct.py``: ``""`` becomes
  ``None`` for both fields, single and batch) before it becomes a ``Req``. The hash itself
  would namespace an empty ``extra_key`` (``Req`` and ``RadixKey`` keep it as given, while
  they turn an empty ``cache_salt`` into ``None``), but no request path delivers one;
  :func:`namespace_seed` hashes what reaches it as SGLang's does;
- ``extra_key`` is the request's extra key with the LoRA id appended
  (``(extra_key or "") + lora_id``). The LoRA id of an adapter from ``--lora-paths`` is
  ``uuid5(NAMESPACE_URL, name + "\\0" + path).hex`` (``LoRARef.deterministic_id``; a bare
  ``PATH`` entry is its own name); an adapter loaded at runtime (``/load_lora_adapter``)
  gets a fresh ``uuid4`` that no other process or tool can know, so kvctl needs its id
  given explicitly;
- only full pages are written to the storage tier.

Mooncake (SGLang's Mooncake HiCache backend, ``mooncake_store.py``): each page is stored as
``<prefix>_<hash>_<tp_rank>_k`` and ``..._v`` (MHA), ``_<tp_rank>_<pp_rank>_k`` with pipeline
parallelism, and as one ``<prefix>_<hash>__k`` object under MLA (``_<pp_rank>_k`` with
pipeline parallelism), where ``<prefix>`` joins ``extra_backend_tag`` and the model path
with ``/`` replaced by ``-`` using ``_``; kvctl reports the ``_k`` key.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

from kvctl.errors import UsageError
from kvctl.keys.chain import MAX_TOKEN_ID, pack_tokens
from kvctl.keys.profiles.base import (
    KeyConfig,
    Keyer,
    KeyFormat,
    KeyProfile,
    SeedInfo,
    register_profile,
)
from kvctl.keys.prompts import LoraRef, Prompt

SGLANG_VERSION = "0.5.23"
NAMESPACE_DOMAIN = b"sglang-cache-namespace-v1"


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest SGLang seeds a storage chain with (``None``: unnamespaced).

    ``extra_key`` and ``cache_salt`` are the ``Req``'s (after io_struct and the LoRA id):
    ``None`` and ``""`` differ here, as in SGLang's ``storage_namespace_seed``.
    """
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


def deterministic_lora_id(name: str, path: str) -> str:
    """``LoRARef.deterministic_id``: the id of a ``--lora-paths`` adapter."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


def lora_id(prompt: Prompt, lora: LoraRef, config: KeyConfig) -> str:
    """The ``lora_id`` SGLang gives ``lora``, the adapter of ``prompt``.

    The adapter's explicit ``id`` wins; otherwise it must come from ``--lora-paths`` (its
    path from the prompt, or from the configured ``lora_paths``).

    Raises:
        UsageError: no id and no path: the id cannot be known.
    """
    if lora.id:
        return lora.id
    path = lora.path or dict(config.options.lora_paths).get(lora.name)
    if path:
        return deterministic_lora_id(lora.name, path)
    raise UsageError(
        f"prompt {prompt.id!r}: SGLang keys LoRA pages by the adapter's lora_id, and kvctl "
        f"cannot derive it from the name {lora.name!r} alone",
        "for an adapter from SGLang's --lora-paths give its path (the prompt's \"path\", or "
        "--lora-paths NAME=PATH as SGLang was started; the id is uuid5(name, path)); an "
        "adapter loaded at runtime (/load_lora_adapter) has a random uuid4 id that no tool "
        "can reproduce: give it as the prompt's lora \"id\" if you know it")


def request_extra_key(prompt: Prompt, config: KeyConfig) -> str | None:
    """SGLang's ``Req.extra_key``: the request's extra key plus the LoRA id.

    ``prompt.extra_key`` is the request's field as sent; io_struct turns ``""`` into
    ``None`` before ``Req.__init__`` appends the LoRA id (``(extra_key or "") + lora_id``).
    """
    extra = prompt.extra_key or None  # io_struct.py: an empty extra_key is none
    if prompt.lora is None:
        return extra
    return (extra or "") + lora_id(prompt, prompt.lora, config)


def _wide_page(prior: bytes, page: Sequence[int]) -> bytes:
    """``hash_wide_page``: a page holding an id above 2**32-1."""
    data = b"".join(t.to_bytes(8, "little") for t in page)
    return hashlib.sha256(prior + b"\xff" + data).digest()


def mooncake_suffix(config: KeyConfig) -> str:
    """What SGLang's Mooncake store appends to a page key for its K object."""
    options = config.options
    pp = options.pp_size > 1
    if options.mla:
        return f"_{options.pp_rank if pp else ''}_k"
    return f"_{config.tp_rank}_{options.pp_rank}_k" if pp else f"_{config.tp_rank}_k"


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
        self.tail = mooncake_suffix(config) if mooncake else ""

    def page_digests(self, prompt: Prompt) -> list[bytes]:
        size = self.config.block_size
        tokens = prompt.tokens
        full = len(tokens) // size * size
        prior = namespace_seed(request_extra_key(prompt, self.config),
                               prompt.cache_salt or None) or b""  # io_struct, Req: "" is none
        out: list[bytes] = []
        if full and max(tokens[:full]) > MAX_TOKEN_ID:
            for start in range(0, full, size):
                page = tokens[start : start + size]
                if max(page) > MAX_TOKEN_ID:
                    prior = _wide_page(prior, page)
                else:
                    prior = hashlib.sha256(prior + pack_tokens(page)).digest()
                out.append(prior)
            return out
        data = pack_tokens(tokens[:full])
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
    #: ``--page-size`` defaults to 1 on CUDA and HIP and to 64 on MUSA (``arg_groups/
    #: overrides.py`` ``_page_size_default``); some attention backends and models force
    #: another size (SGLang logs the one in force at start).
    default_block_size = 1
    seed_doc = ("no seed: first page hashed alone, or after SHA-256('sglang-cache-namespace-"
                "v1', extra_key+lora_id, cache_salt) when either is set (an empty one in a "
                "request is unset); "
                "lora_id = uuid5(name, path) for --lora-paths adapters")
    mixes = frozenset({"lora", "cache_salt", "extra_key", "lora_paths"})
    mooncake_mixes = frozenset({"model", "tp_rank", "store_prefix", "mla", "pp_rank",
                                "pp_size"})

    def keyer(self, config: KeyConfig) -> Keyer:
        self.validate(config)
        if config.key_format is KeyFormat.MOONCAKE and not config.fields.model:
            raise UsageError("SGLang's Mooncake keys start with the model path, but --model "
                             "is not set", "pass --model as given to SGLang's --model-path")
        return _SglangKeyer(config)
