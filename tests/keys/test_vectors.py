"""Every profile against vectors recorded by running the engines' own code.

The vectors (tests/keys/vectors/*.json) were written by
scripts/record_key_vectors/record.py, which executes vLLM's, LMCache's and SGLang's hashing
functions from their released wheels; kvctl is not involved in producing them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvctl.keys.chain import SeedFields
from kvctl.keys.profiles import KeyConfig, KeyFormat, get_profile
from kvctl.keys.profiles.lmcache import LMCACHE_VERSION
from kvctl.keys.profiles.sglang import SGLANG_VERSION
from kvctl.keys.profiles.vllm import VLLM_VERSION
from kvctl.keys.prompts import LoraRef, Prompt

VECTORS = Path(__file__).parent / "vectors"


def _load(engine: str) -> dict[str, Any]:
    return json.loads((VECTORS / f"{engine}.json").read_text())


def _prompts(doc: dict[str, Any]) -> dict[str, Prompt]:
    out = {}
    for p in doc["prompts"]:
        lora = LoraRef(**p["lora"]) if p.get("lora") else None
        out[p["id"]] = Prompt(p["id"], tuple(p["tokens"]), lora, p.get("cache_salt"))
    return out


def _cases(engine: str) -> list[Any]:
    doc = _load(engine)
    return [
        pytest.param(run["pythonhashseed"], case,
                     id=f"{case['profile']}-B{case['block_size']}-{case['prompt']}"
                        f"-seed{run['pythonhashseed']}-{case.get('model', '')}")
        for run in doc["runs"] for case in run["cases"]
    ]


@pytest.mark.parametrize(("engine", "version"), [
    ("vllm", VLLM_VERSION), ("lmcache", LMCACHE_VERSION), ("sglang", SGLANG_VERSION)])
def test_vectors_were_recorded_from_the_version_the_profile_claims(engine: str,
                                                                  version: str) -> None:
    doc = _load(engine)
    assert doc["engine_version"] == version
    assert "engine's own code" in doc["recorded_by"]


VLLM = _prompts(_load("vllm"))


@pytest.mark.parametrize(("hashseed", "case"), _cases("vllm"))
def test_vllm_profiles_match_vllm(hashseed: str | None, case: dict[str, Any]) -> None:
    profile = get_profile(case["profile"])
    prompt = VLLM[case["prompt"]]
    raw = profile.keyer(KeyConfig(profile=profile.name, block_size=case["block_size"],
                                  pythonhashseed=hashseed))
    assert raw.keys(prompt) == case["keys"]
    mc = case["mooncake"]
    mooncake = profile.keyer(KeyConfig(
        profile=profile.name, block_size=case["block_size"], pythonhashseed=hashseed,
        fields=SeedFields(model=mc["model"]), tp_rank=mc["tp_rank"],
        key_format=KeyFormat.MOONCAKE))
    assert mooncake.keys(prompt) == mc["keys"]


LMCACHE = _prompts(_load("lmcache"))


@pytest.mark.parametrize(("hashseed", "case"), _cases("lmcache"))
def test_lmcache_profiles_match_lmcache(hashseed: str | None, case: dict[str, Any]) -> None:
    profile = get_profile(case["profile"])
    config = KeyConfig(profile=profile.name, block_size=case["block_size"],
                       pythonhashseed=hashseed,
                       fields=SeedFields(model=case["model"], kv_dtype=case["kv_dtype"]),
                       world_size=case["world_size"], worker_id=case["worker_id"])
    keyer = profile.keyer(config)
    assert keyer.seed.value == str(case["none_hash"])
    assert keyer.keys(LMCACHE[case["prompt"]]) == case["keys"]
    # LMCache's Mooncake connector stores each chunk under CacheEngineKey.to_string().
    mooncake = profile.keyer(KeyConfig(**{**config.__dict__, "key_format": KeyFormat.MOONCAKE}))
    assert mooncake.keys(LMCACHE[case["prompt"]]) == case["keys"]


SGLANG = _prompts(_load("sglang"))


@pytest.mark.parametrize(("hashseed", "case"), _cases("sglang"))
def test_sglang_profile_matches_sglang(hashseed: str | None, case: dict[str, Any]) -> None:
    profile = get_profile("sglang")
    prompt = SGLANG[case["prompt"]]
    keyer = profile.keyer(KeyConfig(profile="sglang", block_size=case["block_size"]))
    assert keyer.keys(prompt) == case["keys"]
    bare = Prompt(prompt.id, prompt.tokens)
    assert keyer.keys(bare) == case["unnamespaced_keys"]
    mc = case["mooncake"]
    mooncake = profile.keyer(KeyConfig(
        profile="sglang", block_size=case["block_size"], fields=SeedFields(model=mc["model"]),
        tp_rank=mc["tp_rank"], store_prefix=mc["backend_tag"], key_format=KeyFormat.MOONCAKE))
    # SGLang writes a _k and a _v object per page; kvctl reports the _k one.
    assert mooncake.keys(prompt) == mc["keys"][0::2]
    assert [k[:-2] + "_v" for k in mooncake.keys(prompt)] == mc["keys"][1::2]


def test_vectors_cover_lora_salt_and_partial_blocks() -> None:
    # Guard against a re-recording that silently drops the interesting prompts.
    ids = {p["id"] for p in _load("vllm")["prompts"]}
    assert {"lora", "salted", "partial", "big-ids"} <= ids
    cases = [c for r in _load("vllm")["runs"] for c in r["cases"]]
    lora = {c["keys"][0] for c in cases if c["prompt"] == "lora" and c["block_size"] == 16}
    salted = {c["keys"][0] for c in cases if c["prompt"] == "salted" and c["block_size"] == 16}
    assert lora.isdisjoint(salted)
    assert all(c["keys"] == [] for c in cases if c["prompt"] == "partial")
