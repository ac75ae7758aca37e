"""Model table and HuggingFace config.json reader: KV bytes per token by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvctl.errors import UsageError
from kvctl.models import BUILTIN_MODELS, known_model_names, read_config_json, resolve_model

# Llama-3-8B's published config.json (the fields that matter).
LLAMA3_8B = {
    "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def write(tmp_path: Path, cfg: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def test_70b_class_holds_320_kib_per_token() -> None:
    model = resolve_model("llama-3-70b")
    assert (model.layers, model.kv_heads, model.head_dim, model.kv_dtype_bytes) == (80, 8, 128, 2)
    assert model.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2 == 320 * 1024
    assert model.kv_bytes(1_000_000) == 327_680_000_000
    assert model.block_bytes(16) == 16 * 320 * 1024


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("LLAMA-3-8B", 32 * 8 * 128 * 4),
        ("qwen2.5-32b", 64 * 8 * 128 * 4),
        ("Qwen2.5-7B", 28 * 4 * 128 * 4),
        ("mistral-7b", 32 * 8 * 128 * 4),
        ("llama-3.1-405b", 126 * 8 * 128 * 4),
        ("deepseek-v3", 61 * (512 + 64) * 2),
        ("meta-llama/Meta-Llama-3-70B", 80 * 8 * 128 * 4),
    ],
)
def test_lookup_is_case_insensitive(name: str, kv_bytes: int) -> None:
    assert resolve_model(name).kv_bytes_per_token == kv_bytes


def test_deepseek_is_mla_with_active_params() -> None:
    model = resolve_model("DeepSeek-V3")
    assert model.is_mla
    assert model.mla_latent_dim == 576
    assert model.params == 671_000_000_000
    assert model.active_params == 37_000_000_000
    assert model.prefill_flops_per_token == 2 * 37e9


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(UsageError) as info:
        resolve_model("llama-9-1t")
    assert "unknown model 'llama-9-1t'" in info.value.cause
    assert info.value.hint is not None
    for name in known_model_names():
        assert name in info.value.hint
    assert len(known_model_names()) == len(BUILTIN_MODELS) >= 7


def test_reads_gqa_config_and_estimates_params(tmp_path: Path) -> None:
    model = resolve_model(write(tmp_path, LLAMA3_8B))
    assert model.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert model.name == "meta-llama/Meta-Llama-3-8B"
    assert model.source.endswith("config.json")
    assert model.params is not None
    assert abs(model.params - 8_030_000_000) / 8.03e9 < 0.005  # published 8.03B


def test_reads_directory_and_defaults(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768,
           "torch_dtype": "float32"}
    write(tmp_path, cfg)
    model = resolve_model(tmp_path)  # the directory holding config.json
    # kv heads default to attention heads, head_dim to hidden/heads, fp32 = 4 bytes
    assert (model.kv_heads, model.head_dim, model.kv_dtype_bytes) == (12, 64, 4)
    assert model.kv_bytes_per_token == 12 * 12 * 64 * 2 * 4
    assert model.params is None  # no intermediate/vocab sizes: unknown, not guessed


def test_reads_mla_config(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "n_routed_experts": 256, "torch_dtype": "bfloat16"}
    model = read_config_json(write(tmp_path, cfg))
    assert model.kv_bytes_per_token == 61 * 576 * 2
    assert model.active_params is None


def test_reads_text_config_of_multimodal(tmp_path: Path) -> None:
    cfg = {"torch_dtype": "float16",
           "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "head_dim": 32}}
    assert read_config_json(write(tmp_path, cfg)).kv_bytes_per_token == 4 * 2 * 32 * 2 * 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"num_attention_heads": 8}), "num_hidden_layers is missing"),
        (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 8}),
         "not a multiple"),
        (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8,
                     "torch_dtype": "int3"}), "not a known KV dtype"),
    ],
)
def test_bad_configs_are_usage_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=match) as info:
        resolve_model(path)
    assert info.value.hint


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.json"))
    with pytest.raises(UsageError, match=r"has no config\.json"):
        resolve_model(tmp_path)
    with pytest.raises(UsageError):
        resolve_model("llama-3-8b").block_bytes(0)
