"""Settings of ``kvctl verify-keys`` (config section ``keys``, ``KVCTL_KEYS_*``)."""

from __future__ import annotations

import dataclasses

from kvctl.config import register_section


@register_section("keys")
@dataclasses.dataclass(frozen=True)
class KeysSettings:
    """How this instance names KV blocks.

    Attributes:
        profile: key profile (``kvctl verify-keys profiles`` lists them).
        block_size: tokens per block; ``None`` takes the profile's default (vLLM 16,
            LMCache 256, SGLang 1, kvctl 16).
        model: model id as the engine is started with it.
        revision: model revision (commit or tag).
        tenant: tenant id.
        lora_name: LoRA adapter applied to every prompt without its own ``lora``.
        lora_path: that adapter's path.
        kv_dtype: KV cache dtype (LMCache names: half, bfloat16, float, fp8_e4m3fn, ...).
        kv_layout: KV cache layout (``NHD``, ``HND``, ``mla``, ...).
        world_size: LMCache key field.
        worker_id: LMCache key field.
        tp_rank: tensor-parallel rank written into Mooncake key strings.
        key_format: ``raw`` (the engine's key) or ``mooncake`` (the Mooncake object key).
        store_prefix: vLLM Mooncake ``cache_prefix`` / SGLang ``extra_backend_tag``.
        tp_size: tensor-parallel size (vLLM Mooncake rank rules; with num_kv_heads or mla).
        num_kv_heads: the model's total KV heads (vLLM Mooncake rank rule under GQA).
        mla: the model uses MLA (vLLM Mooncake rank 0; SGLang Mooncake ``__k``; LMCache
            world size 1).
        pp_rank: pipeline-parallel rank (Mooncake keys of vLLM and SGLang).
        pp_size: pipeline-parallel size.
        save_unfull_chunk: LMCache ``save_unfull_chunk`` (the last partial chunk is keyed).
        layer_id: LMCache layer-wise mode: the layer whose keys to write.
        lmcache_host: ``vllm`` (LMCache inside vLLM) or ``none`` (no vLLM: NONE_HASH 0,
            builtin hash).
        lora_paths: adapters as the engine was started with them (``NAME=PATH`` or
            ``PATH``: SGLang ``--lora-paths``, vLLM ``--lora-modules``).
    """

    profile: str = "kvctl:sha256"
    block_size: int | None = None
    model: str = ""
    revision: str = ""
    tenant: str = ""
    lora_name: str = ""
    lora_path: str = ""
    kv_dtype: str = ""
    kv_layout: str = ""
    world_size: int = 1
    worker_id: int = 0
    tp_rank: int = 0
    key_format: str = "raw"
    store_prefix: str = ""
    tp_size: int | None = None
    num_kv_heads: int | None = None
    mla: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    save_unfull_chunk: bool = False
    layer_id: int | None = None
    lmcache_host: str = "vllm"
    lora_paths: tuple[str, ...] = ()
