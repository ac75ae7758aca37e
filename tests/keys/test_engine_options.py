"""Engine options and per-request fields: prompts files, manifests, diagnosis, CLI.

The key values themselves are pinned by the engines' recorded vectors (test_vectors.py);
these tests cover how the options reach the profiles and how mistakes are reported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.keys.chain import SeedFields
from kvctl.keys.compare import compare
from kvctl.keys.manifest import (
    config_from_settings,
    emit,
    fingerprint,
    manifest_to_json,
    read_manifest,
    token_block_digests,
    write_manifest,
)
from kvctl.keys.profiles import KeyConfig, get_profile
from kvctl.keys.profiles.base import EngineOptions, LmcacheHost
from kvctl.keys.profiles.sglang import deterministic_lora_id
from kvctl.keys.prompts import LoraRef, MmItem, Prompt, read_prompts
from kvctl.keys.settings import KeysSettings
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]
TOKENS = tuple(range(1, 81))


def _write(tmp_path: Path, *objs: dict[str, object]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


# ------------------------------------------------------------------ prompts files


def test_prompts_carry_mm_items_embeddings_and_lmcache_tags(tmp_path: Path) -> None:
    (tmp_path / "e.bin").write_bytes((bytes(range(256)) * 3)[:640])  # 40 rows, 8 bf16 each
    path = _write(
        tmp_path,
        {"id": "img", "tokens": list(TOKENS),
         "mm": [{"identifier": "h1", "offset": 3, "length": 10, "modality": "image"},
                {"identifier": "h2", "offset": 13, "length": 4}]},
        {"id": "emb", "prompt_embeds": {"path": "e.bin", "dtype": "bfloat16",
                                        "hidden_size": 8}},
        {"id": "tag", "tokens": [1, 2], "kv_transfer_params": {
            "lmcache.tag.user": "alice", "lmcache.skip_save": True, "lmcache.tag.n": 3,
            "other": "x"}},
        {"id": "wide", "tokens": [2**63 - 1, 0]},
    )
    img, emb, tag, wide = read_prompts(path)
    assert img.mm == (MmItem("h1", 3, 10), MmItem("h2", 13, 4))
    assert emb.tokens == (0,) * 40  # vLLM's token ids of an embeddings-only prompt
    assert emb.prompt_embeds is not None
    assert emb.prompt_embeds.rows == 40
    assert emb.prompt_embeds.block(1, 2) == bytes(range(16, 32))
    assert tag.lmcache_tags == (("user", "alice"), ("n", "3"))
    assert wide.tokens[0] == 2**63 - 1


@pytest.mark.parametrize(("obj", "message"), [
    ({"tokens": [1] * 20, "mm": [{"identifier": "a", "offset": 0, "length": 10},
                                 {"identifier": "b", "offset": 5, "length": 2}]},
     "starts before mm[0] ends"),
    ({"tokens": [1] * 5, "mm": [{"identifier": "a", "offset": 2, "length": 10}]},
     "of a 5-token prompt"),
    ({"tokens": [1] * 5, "mm": [{"identifier": "", "offset": 0, "length": 1}]}, "non-empty"),
    ({"tokens": [1] * 3, "prompt_embeds": {"path": "e.bin", "dtype": "bfloat16",
                                           "hidden_size": 8}}, "40 rows for 3 tokens"),
    ({"prompt_embeds": {"path": "e.bin", "dtype": "int8", "hidden_size": 8}}, "dtype one of"),
    ({"prompt_embeds": {"path": "e.bin", "dtype": "float32", "hidden_size": 3}},
     "not a multiple of one row"),
    ({"prompt_embeds": {"path": "nope.bin", "dtype": "float32", "hidden_size": 2}},
     "cannot read prompt_embeds file"),
    ({"tokens": [1], "kv_transfer_params": {"lmcache.tag.x": [1]}}, "list value"),
    ({"tokens": [2**63]}, "is not an integer in 0..9223372036854775807"),
    ({"tokens": [-1]}, "is not an integer"),
])
def test_bad_request_fields_name_the_line(tmp_path: Path, obj: dict[str, object],
                                          message: str) -> None:
    (tmp_path / "e.bin").write_bytes(bytes(640))
    path = _write(tmp_path, {"id": "ok", "tokens": [1]}, {"id": "bad", **obj})
    with pytest.raises(UsageError, match="line 2") as err:
        read_prompts(path)
    assert message in str(err.value)


def test_token_digests_cover_wide_ids_and_a_partial_block() -> None:
    normal = token_block_digests(list(range(32)), 16)
    assert len(normal) == 2
    wide = token_block_digests([2**40] * 16 + list(range(16)), 16)
    assert wide[1] == normal[0]  # a block of normal ids keeps its uint32 digest
    assert wide[0] not in normal
    assert len(token_block_digests(list(range(20)), 16, blocks=2)) == 2


# ------------------------------------------------------------------ manifests


def _settings(**changes: object) -> KeysSettings:
    return dataclasses.replace(KeysSettings(profile="vllm:sha256", model="Qwen/Qwen3-8B"),
                               **changes)


def test_manifests_without_options_keep_their_fingerprints() -> None:
    # The example manifests were written before the options existed: same settings, same
    # fingerprint (options are recorded only when they differ from the engine's default).
    for name in ("host-a", "host-b", "host-c"):
        manifest = read_manifest(REPO / "examples" / "keys" / f"{name}.json")
        assert manifest.config.options == EngineOptions()
        assert fingerprint(manifest.config, manifest.engine_version) == manifest.fingerprint
        assert "options" not in manifest_to_json(manifest)["config"]


def test_options_and_request_fields_round_trip(tmp_path: Path) -> None:
    settings = _settings(key_format="mooncake", tp_size=8, num_kv_heads=2, tp_rank=5,
                         pp_rank=1, pp_size=2, lora_paths=("a=/p/a", "/p/b"))
    config = config_from_settings(settings, env={"PYTHONHASHSEED": "0"})
    assert config.options.lora_paths == (("a", "/p/a"), ("/p/b", "/p/b"))
    prompt = Prompt("p", TOKENS, LoraRef("sql", "/l"), "s", None,
                    mm=(MmItem("h", 2, 5),), lmcache_tags=(("user", "al"),))
    manifest = emit(config, [prompt])
    assert manifest.prompts[0].keys[0].startswith("Qwen3-8B@tp_rank:1@pcp0@dcp0@pp_rank:1@")
    path = tmp_path / "m.json"
    write_manifest(manifest, path)
    back = read_manifest(path)
    assert back.config.options == config.options
    assert back.prompts[0].mm == prompt.mm
    assert back.prompts[0].lmcache_tags == prompt.lmcache_tags
    assert back.fingerprint == manifest.fingerprint
    doc = json.loads(path.read_text())
    assert doc["config"]["options"]["tp_size"] == 8


def test_unfull_chunks_are_keyed_and_manifests_accept_them(tmp_path: Path) -> None:
    settings = KeysSettings(profile="lmcache", model="m", kv_dtype="bfloat16", block_size=16,
                            save_unfull_chunk=True, layer_id=2)
    config = config_from_settings(settings, env={"PYTHONHASHSEED": "0"})
    manifest = emit(config, [Prompt("p", tuple(range(40))), Prompt("q", (1, 2, 3))])
    assert [len(p.keys) for p in manifest.prompts] == [3, 1]
    assert all(k.endswith("@bfloat16@2") for p in manifest.prompts for k in p.keys)
    write_manifest(manifest, tmp_path / "m.json")
    assert read_manifest(tmp_path / "m.json").prompts[1].keys == manifest.prompts[1].keys


def test_bad_options_are_usage_errors() -> None:
    for changes, message in (({"pp_rank": 2, "pp_size": 2}, "--pp-rank 2"),
                             ({"tp_size": 0}, "--tp-size 0"),
                             ({"layer_id": -1}, "--layer-id"),
                             ({"lmcache_host": "sglang"}, "unknown LMCache host"),
                             ({"lora_paths": ("a=/x", "a=/y")}, "twice")):
        with pytest.raises(UsageError, match=message):
            config_from_settings(_settings(**changes), env={})


# ------------------------------------------------------------------ engines


def test_vllm_mooncake_needs_kv_heads_with_tp_size() -> None:
    config = config_from_settings(_settings(key_format="mooncake", tp_size=8, tp_rank=3),
                                  env={})
    with pytest.raises(UsageError, match="--num-kv-heads is not set"):
        emit(config, [Prompt("p", TOKENS)])
    mla = config_from_settings(_settings(key_format="mooncake", tp_size=8, tp_rank=3,
                                         mla=True), env={})
    assert "@tp_rank:0@" in emit(mla, [Prompt("p", TOKENS)]).prompts[0].keys[0]
    outside = config_from_settings(_settings(key_format="mooncake", tp_size=2, tp_rank=3,
                                             num_kv_heads=8), env={})
    with pytest.raises(UsageError, match=r"outside 0\.\.1"):
        emit(outside, [Prompt("p", TOKENS)])


def test_vllm_lora_needs_its_path_and_old_vllm_its_int_id() -> None:
    config = config_from_settings(_settings(), env={})
    with pytest.raises(UsageError, match="has no path"):
        emit(config, [Prompt("p", TOKENS, LoraRef("sql"))])
    modules = config_from_settings(_settings(lora_paths=("sql=/l",)), env={})
    assert (emit(modules, [Prompt("p", TOKENS, LoraRef("sql"))]).prompts[0].keys
            == emit(config, [Prompt("p", TOKENS, LoraRef("sql", "/l"))]).prompts[0].keys)
    old = config_from_settings(_settings(profile="vllm-0.10.2:sha256"), env={"PYTHONHASHSEED": "0"})
    with pytest.raises(UsageError, match="lora_int_id") as err:
        emit(old, [Prompt("p", TOKENS, LoraRef("sql", "/l"))])
    assert "1, 2" in (err.value.hint or "")
    keys = emit(old, [Prompt("p", TOKENS, LoraRef("sql", "/l", "4"))]).prompts[0].keys
    assert len(keys) == 5


def test_sglang_lora_by_name_alone_says_why_no_tool_can_know_its_id() -> None:
    config = config_from_settings(KeysSettings(profile="sglang", block_size=16), env={})
    with pytest.raises(UsageError, match="cannot derive it from the name 'sql'") as err:
        emit(config, [Prompt("p", TOKENS, LoraRef("sql"))])
    assert "uuid4" in (err.value.hint or "")
    assert "--lora-paths NAME=PATH" in (err.value.hint or "")
    by_option = config_from_settings(KeysSettings(profile="sglang", block_size=16,
                                                  lora_paths=("sql=/l",)), env={})
    by_prompt = emit(config, [Prompt("p", TOKENS, LoraRef("sql", "/l"))])
    by_id = emit(config, [Prompt("p", TOKENS, LoraRef("sql", "", deterministic_lora_id("sql",
                                                                                      "/l")))])
    assert (emit(by_option, [Prompt("p", TOKENS, LoraRef("sql"))]).prompts[0].keys
            == by_prompt.prompts[0].keys == by_id.prompts[0].keys)


def test_sglang_default_page_size_is_one() -> None:
    config = config_from_settings(KeysSettings(profile="sglang"), env={})
    assert config.block_size == 1
    assert len(emit(config, [Prompt("p", (1, 2, 3))]).prompts[0].keys) == 3


def test_lmcache_seed_sources() -> None:
    profile = get_profile("lmcache:sha256_cbor")
    fields = SeedFields(model="m", kv_dtype="half")
    none = profile.keyer(KeyConfig(profile=profile.name, fields=fields, options=EngineOptions(
        lmcache_host=LmcacheHost.NONE)))
    assert (none.seed.source, none.seed.value) == ("default", "0")
    builtin = get_profile("lmcache")
    for seed, source in ((None, "random"), ("random", "random"), ("", "PYTHONHASHSEED"),
                         ("-0", "PYTHONHASHSEED")):
        keyer = builtin.keyer(KeyConfig(profile="lmcache", fields=fields, pythonhashseed=seed))
        assert keyer.seed.source == source
    xx = get_profile("lmcache:xxhash").keyer(KeyConfig(profile="lmcache:xxhash", fields=fields))
    assert not xx.seed.reproducible


# ------------------------------------------------------------------ diagnosis


def test_compare_blames_the_engine_option_that_differs() -> None:
    prompt = Prompt("p", TOKENS)
    base = {"key_format": "mooncake", "tp_size": 8, "num_kv_heads": 8, "tp_rank": 5}
    a = emit(config_from_settings(_settings(**base), env={}), [prompt])
    b = emit(config_from_settings(_settings(**{**base, "num_kv_heads": 2}), env={}), [prompt])
    result = compare([dataclasses.replace(a, source="a"), dataclasses.replace(b, source="b")])
    (pair,) = result.results
    assert pair.status == "mismatch"
    assert [c.setting for c in pair.causes] == ["num_kv_heads"]
    lm = KeysSettings(profile="lmcache", model="m", kv_dtype="half", block_size=16)
    x = emit(config_from_settings(lm, env={"PYTHONHASHSEED": "0"}), [prompt])
    y = emit(config_from_settings(dataclasses.replace(lm, lmcache_host="none"),
                                  env={"PYTHONHASHSEED": "0"}), [prompt])
    (pair,) = compare([dataclasses.replace(x, source="x"),
                       dataclasses.replace(y, source="y")]).results
    assert "lmcache_host" in [c.setting for c in pair.causes]


def test_compare_blames_request_tags_and_mm_items() -> None:
    config = config_from_settings(KeysSettings(profile="lmcache", model="m", kv_dtype="half",
                                               block_size=16), env={"PYTHONHASHSEED": "0"})
    a = emit(config, [Prompt("p", TOKENS, lmcache_tags=(("user", "a"),))])
    b = emit(config, [Prompt("p", TOKENS, lmcache_tags=(("user", "b"),))])
    (pair,) = compare([dataclasses.replace(a, source="a"),
                       dataclasses.replace(b, source="b")]).results
    assert [c.setting for c in pair.causes] == ["lmcache_tags"]
    vconfig = config_from_settings(_settings(), env={})
    c = emit(vconfig, [Prompt("p", TOKENS, mm=(MmItem("h", 0, 4),))])
    d = emit(vconfig, [Prompt("p", TOKENS, mm=(MmItem("h", 1, 4),))])
    (pair,) = compare([dataclasses.replace(c, source="c"),
                       dataclasses.replace(d, source="d")]).results
    assert [x.setting for x in pair.causes] == ["mm"]


# ------------------------------------------------------------------ CLI


def test_cli_engine_options_reach_the_keys(tmp_path: Path, kvctl: Kvctl) -> None:
    prompts = _write(tmp_path, {"id": "p", "tokens": list(TOKENS)})
    out = tmp_path / "m.json"
    r = kvctl("verify-keys", "emit", "--profile", "sglang", "--block-size", "16",
              "--model", "Qwen/Qwen3-8B", "--key-format", "mooncake", "--mla", "--pp-size",
              "2", "--pp-rank", "1", "--prompts", str(prompts), "-o", str(out))
    assert r.exit_code == 0, r.stderr
    keys = json.loads(out.read_text())["prompts"][0]["keys"]
    assert all(k.endswith("_1_k") and k.startswith("Qwen-Qwen3-8B_") for k in keys)
    r = kvctl("verify-keys", "--profile", "lmcache", "--save-unfull-chunk", "--layer-id", "1",
              "--json", env={"PYTHONHASHSEED": "+7"})
    assert r.exit_code == 0, r.stdout
    names = {c["name"] for c in r.json()["checks"]}
    assert "a partial last block has one key" in names
    r = kvctl("verify-keys", "emit", "--profile", "sglang", "--prompts", str(_write(
        tmp_path, {"id": "p", "tokens": [1, 2], "lora": {"name": "sql"}})))
    assert r.exit_code == 2
    assert "uuid4" in r.stderr
