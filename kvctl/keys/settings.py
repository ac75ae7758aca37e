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
            LMCache 256, SGLang 64, kvctl 16).
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
