"""Model shapes that size KV caches: a built-in table and a HuggingFace ``config.json`` reader.

KV bytes per token (every layer's K and V for one token):

- standard attention (MHA/GQA/MQA): ``layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes``;
- multi-head latent attention (MLA, DeepSeek-V2/V3): one compressed latent per layer per token,
  ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes``.

A 70B-class model (80 layers, 8 KV heads, head dim 128, fp16) holds 80 x 8 x 128 x 2 x 2 =
327,680 bytes = 320 KiB per token.

Use :func:`resolve_model` with a table name (case-insensitive: ``llama-3-70b``), a HuggingFace
repo id from the table (``meta-llama/Meta-Llama-3-70B``), or a path to a ``config.json`` (or to
the directory holding it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from kvctl.errors import UsageError

log = logging.getLogger(__name__)

#: Bytes per element of the dtypes a ``config.json`` names in ``torch_dtype``.
DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a model's KV cache and prefill cost depend on.

    Attributes:
        name: table name (``Llama-3-70B``) or the config file's model name / path.
        layers: transformer layers that keep KV (``num_hidden_layers``).
        kv_heads: key/value heads per layer (GQA groups); unused for MLA models.
        head_dim: dimension of one head, in elements; unused for MLA models.
        kv_dtype_bytes: bytes per KV element (fp16/bf16: 2, fp8: 1).
        params: total parameter count, or ``None`` when unknown.
        active_params: parameters used per token (MoE: the activated ones; dense: ``params``),
            or ``None`` when unknown. Prefill FLOPs ≈ 2 x active_params per token.
        mla_latent_dim: ``kv_lora_rank + qk_rope_head_dim`` for MLA models, else ``None``.
        source: ``"built-in"`` or the path of the ``config.json`` read.
        hf_id: HuggingFace repository id of the table entry, if any.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2
    params: int | None = None
    active_params: int | None = None
    mla_latent_dim: int | None = None
    source: str = "built-in"
    hf_id: str | None = None

    @property
    def is_mla(self) -> bool:
        """Whether KV is one MLA latent per layer instead of K and V heads."""
        return self.mla_latent_dim is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers."""
        if self.mla_latent_dim is not None:
            return self.layers * self.mla_latent_dim * self.kv_dtype_bytes
        return self.layers * self.kv_heads * self.head_dim * 2 * self.kv_dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        """KV-cache bytes of ``tokens`` tokens."""
        return tokens * self.kv_bytes_per_token

    def block_bytes(self, page_tokens: int) -> int:
        """Bytes of one KV block (page) of ``page_tokens`` tokens.

        Raises:
            UsageError: ``page_tokens`` is not positive.
        """
        if page_tokens <= 0:
            raise UsageError(
                f"page size {page_tokens} tokens is not positive", "use e.g. --page-tokens 16"
            )
        return page_tokens * self.kv_bytes_per_token

    @property
    def prefill_flops_per_token(self) -> float | None:
        """≈ 2 x active parameters (one multiply-add per weight); ignores attention's n² term."""
        return None if self.active_params is None else 2.0 * self.active_params


def _dense(
    name: str, hf_id: str, layers: int, kv_heads: int, head_dim: int, params: int
) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, kv_heads=kv_heads, head_dim=head_dim, kv_dtype_bytes=2,
        params=params, active_params=params, hf_id=hf_id,
    )


#: Built-in models (bf16/fp16 KV). Parameter counts are the published totals.
BUILTIN_MODELS: tuple[ModelSpec, ...] = (
    _dense("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", 32, 8, 128, 8_030_000_000),
    _dense("Llama-3-70B", "meta-llama/Meta-Llama-3-70B", 80, 8, 128, 70_550_000_000),
    _dense("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 32, 8, 128, 8_030_000_000),
    _dense("Llama-3.1-70B", "meta-llama/Llama-3.1-70B", 80, 8, 128, 70_550_000_000),
    _dense("Llama-3.1-405B", "meta-llama/Llama-3.1-405B", 126, 8, 128, 405_850_000_000),
    _dense("Mistral-7B", "mistralai/Mistral-7B-v0.1", 32, 8, 128, 7_240_000_000),
    _dense("Qwen2.5-7B", "Qwen/Qwen2.5-7B", 28, 4, 128, 7_620_000_000),
    _dense("Qwen2.5-32B", "Qwen/Qwen2.5-32B", 64, 8, 128, 32_760_000_000),
    _dense("Qwen2.5-72B", "Qwen/Qwen2.5-72B", 80, 8, 128, 72_710_000_000),
    ModelSpec(
        name="DeepSeek-V3", layers=61, kv_heads=1, head_dim=576, kv_dtype_bytes=2,
        params=671_000_000_000, active_params=37_000_000_000, mla_latent_dim=512 + 64,
        hf_id="deepseek-ai/DeepSeek-V3",
    ),
)


def known_model_names() -> list[str]:
    """Names of the built-in table, as shown to people."""
    return [m.name for m in BUILTIN_MODELS]


def lookup_model(name: str) -> ModelSpec | None:
    """The built-in model called ``name`` (case-insensitive, or its HF id), else ``None``."""
    wanted = name.strip().lower()
    for model in BUILTIN_MODELS:
        if wanted == model.name.lower() or (model.hf_id and wanted == model.hf_id.lower()):
            return model
    return None


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """A table name (``llama-3-70b``), a table HF id, or a ``config.json`` file or directory.

    Raises:
        UsageError: unknown name (the hint lists the known ones), or a bad config file.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UsageError(
                f"model directory {path.parent} has no config.json",
                "point --model at a HuggingFace config.json or use a built-in name",
            )
    if path.is_file():
        return read_config_json(path)
    model = lookup_model(text)
    if model is not None:
        return model
    looks_like_file = text.endswith(".json") or text.startswith((".", "/", "~"))
    cause = (
        f"model config {text} does not exist"
        if looks_like_file
        else f"unknown model {text!r} (not a built-in name and no such file)"
    )
    raise UsageError(
        cause,
        f"use a built-in name ({', '.join(known_model_names())}) or a path to a config.json",
    )


def read_config_json(path: Path) -> ModelSpec:
    """Read a HuggingFace ``config.json`` into a :class:`ModelSpec`.

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default ``num_attention_heads``),
    ``head_dim`` (default ``hidden_size / num_attention_heads``) and ``torch_dtype`` (default
    bfloat16); MLA models by ``kv_lora_rank`` + ``qk_rope_head_dim``. Multimodal configs are
    read from their ``text_config``. Dense models get an estimated parameter count (embeddings,
    attention and gated-MLP weights); MoE models get none (pass the count explicitly).

    Raises:
        UsageError: the file is unreadable, not JSON, or lacks a required field.
    """
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(
            f"cannot read model config {path}: {exc.strerror or exc}",
            "check the path given to --model",
        ) from exc
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"model config {path} is not JSON (line {exc.lineno}, column {exc.colno})",
            "give the model's HuggingFace config.json",
        ) from exc
    if not isinstance(raw, dict):
        raise UsageError(
            f"model config {path} is not a JSON object", "give the model's HuggingFace config.json"
        )
    cfg: dict[str, Any] = raw
    text_config = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text_config, dict):
        cfg = {**text_config, "torch_dtype": text_config.get("torch_dtype", raw.get("torch_dtype"))}

    def need_int(key: str) -> int:
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            found = "missing" if value is None else f"{value!r}"
            raise UsageError(
                f"model config {path}: {key} is {found}, expected a positive integer",
                "give a HuggingFace config.json of a decoder-only transformer",
            )
        return value

    def opt_int(key: str) -> int | None:
        return need_int(key) if cfg.get(key) is not None else None

    layers = need_int("num_hidden_layers")
    dtype_name = str(cfg.get("torch_dtype") or "bfloat16").lower().removeprefix("torch.")
    if dtype_name not in DTYPE_BYTES:
        raise UsageError(
            f"model config {path}: torch_dtype {dtype_name!r} is not a known KV dtype",
            f"known: {', '.join(sorted(DTYPE_BYTES))}",
        )
    dtype_bytes = DTYPE_BYTES[dtype_name]
    name = str(cfg.get("_name_or_path") or raw.get("_name_or_path") or path)

    kv_lora_rank = opt_int("kv_lora_rank")
    if kv_lora_rank is not None:
        rope_dim = need_int("qk_rope_head_dim")
        return ModelSpec(
            name=name, layers=layers, kv_heads=1, head_dim=kv_lora_rank + rope_dim,
            kv_dtype_bytes=dtype_bytes, mla_latent_dim=kv_lora_rank + rope_dim,
            source=str(path),
        )

    heads = need_int("num_attention_heads")
    kv_heads = opt_int("num_key_value_heads") or heads
    head_dim = opt_int("head_dim")
    hidden = opt_int("hidden_size")
    if head_dim is None:
        if hidden is None:
            raise UsageError(
                f"model config {path}: neither head_dim nor hidden_size is set",
                "add head_dim (or hidden_size and num_attention_heads) to the config",
            )
        if hidden % heads:
            raise UsageError(
                f"model config {path}: hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads}",
                "set head_dim explicitly in the config",
            )
        head_dim = hidden // heads
    params = _estimate_dense_params(cfg, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    if params is None:
        log.info("model config %s: parameter count unknown (MoE or missing fields)", path)
    return ModelSpec(
        name=name, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        kv_dtype_bytes=dtype_bytes, params=params, active_params=params, source=str(path),
    )


def _estimate_dense_params(
    cfg: dict[str, Any], *, heads: int, kv_heads: int, head_dim: int
) -> int | None:
    """Weights of a Llama-style dense decoder: attention, gated MLP, embeddings (no norms).

    ``None`` for mixture-of-experts configs or when a needed field is missing.
    """
    if any(cfg.get(k) for k in ("num_local_experts", "n_routed_experts", "num_experts")):
        return None
    try:
        hidden = int(cfg["hidden_size"])
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * (attention + mlp) + embeddings
