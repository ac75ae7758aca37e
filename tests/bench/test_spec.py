"""Sweep settings: defaults, validation, model sizing against hand-computed values."""

import json
from pathlib import Path

import pytest

from kvctl.bench.spec import BenchSettings, Op, build_sweep, parse_location
from kvctl.errors import UsageError
from kvctl.models import resolve_model


def test_default_sweep_is_the_documented_one() -> None:
    sweep = build_sweep(BenchSettings())
    assert sweep.transports == ("shm", "tcp")
    assert sweep.ops == (Op.READ, Op.WRITE)
    assert sweep.block_sizes_bytes == (4096, 65536, 1 << 20, 4 << 20)
    assert sweep.batch_sizes == (128,)
    assert len(sweep.configs()) == 16
    assert sweep.region_bytes == 128 * (4 << 20)
    assert sweep.duration_s is not None
    assert sweep.iterations is None


def test_ranges_lists_and_iterations() -> None:
    sweep = build_sweep(BenchSettings(block_size="4KiB-32KiB", batch_size="1,32", op="write",
                                      transport="tcp", iterations=5, threads=2))
    assert sweep.block_sizes_bytes == (4096, 8192, 16384, 32768)
    assert sweep.batch_sizes == (1, 32)
    assert sweep.ops == (Op.WRITE,)
    assert sweep.duration_s is None
    assert sweep.region_bytes == 2 * 32 * 32768
    labels = [c.label() for c in sweep.configs()]
    assert labels[0] == "write tcp 4 KiB x1"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("block_size", "4QB", "unknown unit"),
        ("transport", "udp", "transport 'udp' is unknown"),
        ("op", "copy", "operation 'copy'"),
        ("batch_size", "0", "batch size '0'"),
        ("threads", 0, "threads 0"),
        ("local_location", "gpu:0", "not a buffer location"),
        ("iterations", 0, "iterations 0"),
    ],
)
def test_bad_settings_are_usage_errors(field: str, value: object, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        build_sweep(BenchSettings(**{field: value}))
    assert info.value.hint


def test_too_large_sweep_is_refused() -> None:
    with pytest.raises(UsageError, match="buffer per side"):
        build_sweep(BenchSettings(block_size="64MiB", batch_size="128"))


def test_locations() -> None:
    assert str(parse_location("cpu")) == "cpu:0"
    assert str(parse_location("cuda:3")) == "cuda:3"
    loc = parse_location("file:/tmp/x.bin")
    assert loc.kind == "file"
    assert loc.path == Path("/tmp/x.bin")


def test_model_sizing_builtin_dense_and_mla() -> None:
    llama = build_sweep(BenchSettings(page_tokens=16), model=resolve_model("llama-3-70b"))
    # 80 layers x 8 KV heads x 128 head dim x 2 (K,V) x 2 bytes = 327,680 B/token
    assert llama.sizing is not None
    assert llama.sizing.kv_bytes_per_token == 327_680
    assert llama.block_sizes_bytes == (16 * 327_680,)
    deepseek = build_sweep(BenchSettings(page_tokens=64), model=resolve_model("DeepSeek-V3"))
    # MLA: 61 layers x (512 + 64) latent x 2 bytes = 70,272 B/token
    assert deepseek.sizing is not None
    assert deepseek.sizing.kv_bytes_per_token == 70_272
    assert deepseek.block_sizes_bytes == (64 * 70_272,)


def test_model_sizing_from_config_json(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 512, "torch_dtype": "float32"}))
    sweep = build_sweep(BenchSettings(page_tokens=32), model=resolve_model(str(config)))
    # 4 layers x 2 KV heads x (512/8 = 64) head dim x 2 x 4 bytes = 4,096 B/token
    assert sweep.sizing is not None
    assert sweep.sizing.kv_bytes_per_token == 4096
    assert sweep.block_sizes_bytes == (32 * 4096,)
