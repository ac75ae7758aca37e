"""Compare key manifests of several instances and say why they diverge.

For each prompt and each pair of instances: the first block whose keys differ, and the
settings that explain it. A setting is blamed only if it differs between the two manifests
*and* the profile in use mixes it into its keys (vLLM keys do not depend on the model
revision, so a revision difference cannot explain a vLLM key mismatch; it is reported as a
hazard when keys are equal instead).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from kvctl.errors import UsageError
from kvctl.keys.manifest import Manifest, PromptKeys
from kvctl.keys.profiles import KeyProfile, known_profiles


@dataclasses.dataclass(frozen=True)
class Cause:
    """One setting that differs between two instances and changes keys.

    Attributes:
        setting: one of :data:`kvctl.keys.profiles.SETTINGS`, or ``unknown``.
        a: its value on the first instance (as text).
        b: its value on the second instance.
        detail: one sentence for people.
    """

    setting: str
    a: str
    b: str
    detail: str


@dataclasses.dataclass(frozen=True)
class PairResult:
    """One prompt on one pair of instances.

    Attributes:
        prompt: prompt id.
        a: first instance (manifest file).
        b: second instance.
        status: ``match``, ``mismatch`` or ``missing`` (the prompt is in one manifest only).
        first_diverging_block: index of the first block whose keys differ (``None`` if
            they match).
        blocks_a: number of keys on ``a``.
        blocks_b: number of keys on ``b``.
        causes: why they diverge (empty when they match).
        hazards: settings that differ although the keys are equal (shared KV across them).
    """

    prompt: str
    a: str
    b: str
    status: str
    first_diverging_block: int | None
    blocks_a: int
    blocks_b: int
    causes: tuple[Cause, ...] = ()
    hazards: tuple[Cause, ...] = ()


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every prompt on every pair of instances."""

    instances: tuple[str, ...]
    results: tuple[PairResult, ...]

    @property
    def ok(self) -> bool:
        """``True`` when every prompt has the same keys on every instance."""
        return all(r.status == "match" for r in self.results)


def _profile(manifest: Manifest) -> KeyProfile | None:
    return known_profiles().get(manifest.config.profile)


def _mixed(manifest: Manifest) -> frozenset[str]:
    profile = _profile(manifest)
    if profile is None:  # a profile this kvctl does not know: assume everything matters
        return frozenset(_DETAIL)
    return profile.mixed(manifest.config.key_format)


def _settings(manifest: Manifest, prompt: PromptKeys) -> dict[str, str]:
    """Every blamable setting of ``prompt`` under ``manifest``, as text."""
    c = manifest.config
    f = c.fields
    lora = manifest.config.fields.lora_name
    if prompt.lora is not None:
        lora = f"{prompt.lora.name} ({prompt.lora.path or 'no path'})"
    return {
        "model": f.model, "revision": f.revision, "tenant": f.tenant, "lora": lora or "none",
        "cache_salt": prompt.cache_salt if prompt.cache_salt is not None else "none",
        "extra_key": prompt.extra_key if prompt.extra_key is not None else "none",
        "kv_dtype": f.kv_dtype, "kv_layout": f.kv_layout,
        "extra": ", ".join(f"{k}={v}" for k, v in f.extra) or "none",
        "pythonhashseed": "unset" if c.pythonhashseed is None else repr(c.pythonhashseed),
        "world_size": str(c.world_size), "worker_id": str(c.worker_id),
        "tp_rank": str(c.tp_rank), "store_prefix": c.store_prefix or "none",
        "mm": ", ".join(f"{m.identifier}@{m.offset}+{m.length}" for m in prompt.mm) or "none",
        "prompt_embeds": prompt.prompt_embeds[:16] if prompt.prompt_embeds else "none",
        "lmcache_tags": ", ".join(f"{k}={v}" for k, v in prompt.lmcache_tags) or "none",
        **_options(manifest),
    }


def _options(manifest: Manifest) -> dict[str, str]:
    o = manifest.config.options
    return {
        "tp_size": "unset" if o.tp_size is None else str(o.tp_size),
        "num_kv_heads": "unset" if o.num_kv_heads is None else str(o.num_kv_heads),
        "mla": "yes" if o.mla else "no", "pp_rank": str(o.pp_rank), "pp_size": str(o.pp_size),
        "save_unfull_chunk": "yes" if o.save_unfull_chunk else "no",
        "layer_id": "none" if o.layer_id is None else str(o.layer_id),
        "lmcache_host": o.lmcache_host.value,
        "lora_paths": ", ".join(f"{n}={p}" for n, p in o.lora_paths) or "none",
    }


_DETAIL = {
    "model": "the model id differs",
    "revision": "the model revision differs",
    "tenant": "the tenant differs",
    "lora": "the LoRA adapter differs",
    "cache_salt": "the request's cache_salt differs",
    "extra_key": "the request's extra_key differs",
    "kv_dtype": "the KV cache dtype differs",
    "kv_layout": "the KV cache layout differs",
    "extra": "extra seed fields differ",
    "pythonhashseed": "PYTHONHASHSEED differs, so the chain's first link (NONE_HASH) differs",
    "world_size": "the world size in LMCache's key string differs",
    "worker_id": "the worker id in LMCache's key string differs",
    "tp_rank": "the tensor-parallel rank in the Mooncake key differs",
    "store_prefix": "the Mooncake key prefix differs",
    "mm": "the request's multimodal items (identifiers or placeholder ranges) differ",
    "prompt_embeds": "the request's prompt embeddings differ",
    "lmcache_tags": "the request's LMCache tags (kv_transfer_params lmcache.tag.*) differ",
    "tp_size": "the tensor-parallel size differs (it decides the rank in Mooncake keys)",
    "num_kv_heads": "the KV head count differs (it decides the rank in Mooncake keys)",
    "mla": "one instance runs the model as MLA, the other not",
    "pp_rank": "the pipeline-parallel rank in the Mooncake key differs",
    "pp_size": "the pipeline-parallel size differs (SGLang adds the PP rank from 2 on)",
    "save_unfull_chunk": "LMCache save_unfull_chunk differs (a partial last chunk is keyed "
                         "on one side only)",
    "layer_id": "the LMCache layer of the keys differs (layer-wise mode)",
    "lmcache_host": "LMCache runs inside vLLM on one side and without it on the other "
                    "(NONE_HASH and hash function differ)",
    "lora_paths": "SGLang's --lora-paths differ, so the LoRA ids differ",
}

#: Settings that change KV itself: equal keys across them mean wrongly shared KV.
_KV_SETTINGS = ("model", "revision", "tenant", "lora", "kv_dtype", "kv_layout", "extra")


def _first_divergence(a: Sequence[str], b: Sequence[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diagnose(ma: Manifest, mb: Manifest, pa: PromptKeys, pb: PromptKeys,
             first: int) -> list[Cause]:
    """Why ``pa`` (on ``ma``) and ``pb`` (on ``mb``) diverge at block ``first``."""
    ca, cb = ma.config, mb.config
    causes: list[Cause] = []
    if ca.profile != cb.profile:
        engine_a, engine_b = ca.profile.split(":")[0], cb.profile.split(":")[0]
        detail = ("the hash function differs" if engine_a == engine_b
                  else "the key schemes differ (different engines or profiles)")
        causes.append(Cause("profile", ca.profile, cb.profile, detail))
    if ca.key_format != cb.key_format:
        causes.append(Cause("key_format", ca.key_format.value, cb.key_format.value,
                            "one manifest has engine keys, the other Mooncake object keys"))
    if ca.block_size != cb.block_size:
        causes.append(Cause("block_size", str(ca.block_size), str(cb.block_size),
                            "the block size differs, so blocks hold different tokens"))
    elif pa.token_blocks != pb.token_blocks or pa.num_tokens != pb.num_tokens:
        j = _first_divergence(pa.token_blocks, pb.token_blocks)
        if j is not None and j <= first:
            size = ca.block_size
            causes.append(Cause("tokens", f"{pa.num_tokens} tokens", f"{pb.num_tokens} tokens",
                                f"the token ids themselves differ from block {j} "
                                f"(tokens {j * size}..{(j + 1) * size - 1}): check the "
                                "tokenizer, chat template and special tokens"))
    mixed = _mixed(ma) | _mixed(mb)
    sa, sb = _settings(ma, pa), _settings(mb, pb)
    for name, value in sa.items():
        if name in mixed and value != sb[name]:
            causes.append(Cause(name, value, sb[name], _DETAIL[name]))
    for m, label in ((ma, "first"), (mb, "second")):
        if not m.seed.reproducible:
            causes.append(Cause(
                "pythonhashseed", sa["pythonhashseed"], sb["pythonhashseed"],
                f"PYTHONHASHSEED is unset on the {label} instance and {m.config.profile} then "
                "draws a random first link per process: set the same PYTHONHASHSEED on every "
                "instance"))
            break
    if not causes:
        if ma.engine_version != mb.engine_version:
            causes.append(Cause("engine_version", ma.engine_version, mb.engine_version,
                                "the manifests were made for different engine versions"))
        else:
            causes.append(Cause("unknown", ma.fingerprint, mb.fingerprint,
                                "settings and tokens agree: a setting kvctl does not record "
                                "differs (multimodal inputs, prompt embeddings), or a manifest "
                                "was edited"))
    return causes


def _hazards(ma: Manifest, mb: Manifest, pa: PromptKeys, pb: PromptKeys) -> list[Cause]:
    sa, sb = _settings(ma, pa), _settings(mb, pb)
    mixed = _mixed(ma) & _mixed(mb)
    return [
        Cause(name, sa[name], sb[name],
              f"{_DETAIL[name]} but {ma.config.profile} does not mix it into keys: instances "
              "sharing a cache would exchange KV across it")
        for name in _KV_SETTINGS if sa[name] != sb[name] and name not in mixed
    ]


def compare(manifests: Sequence[Manifest]) -> Comparison:
    """Compare every prompt across every pair of ``manifests`` (at least two).

    Raises:
        UsageError: fewer than two manifests.
    """
    if len(manifests) < 2:
        raise UsageError("compare needs at least two manifests",
                         "kvctl verify-keys compare host-a.json host-b.json")
    labels = tuple(m.source or f"#{i}" for i, m in enumerate(manifests))
    ids: list[str] = []
    for m in manifests:
        ids.extend(p.id for p in m.prompts if p.id not in ids)
    by_id = [{p.id: p for p in m.prompts} for m in manifests]
    results = []
    for pid in ids:
        for (i, ma), (j, mb) in itertools.combinations(enumerate(manifests), 2):
            pa, pb = by_id[i].get(pid), by_id[j].get(pid)
            if pa is None or pb is None:
                results.append(PairResult(pid, labels[i], labels[j], "missing", None,
                                          len(pa.keys) if pa else 0, len(pb.keys) if pb else 0))
                continue
            first = _first_divergence(pa.keys, pb.keys)
            if first is None:
                results.append(PairResult(pid, labels[i], labels[j], "match", None,
                                          len(pa.keys), len(pb.keys),
                                          hazards=tuple(_hazards(ma, mb, pa, pb))))
            else:
                results.append(PairResult(pid, labels[i], labels[j], "mismatch", first,
                                          len(pa.keys), len(pb.keys),
                                          causes=tuple(diagnose(ma, mb, pa, pb, first))))
    return Comparison(labels, tuple(results))

