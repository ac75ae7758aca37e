"""Every profile against vectors recorded by running the engines' own code.

The vectors (tests/keys/vectors/*.json) were written by
scripts/record_key_vectors/record.py, which executes vLLM's, LMCache's and SGLang's hashing
functions from their released wheels (and, for the older vLLM profile families, from the
first and last release of each era); kvctl is not involved in producing them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvctl.keys.chain import SeedFields
from kvctl.keys.profiles import KeyConfig, KeyFormat, get_profile
from kvctl.keys.profiles.base import EngineOptions, LmcacheHost
from kvctl.keys.profiles.lmcache import LMCACHE_VERSION
from kvctl.keys.profiles.sglang import SGLANG_VERSION
from kvctl.keys.profiles.vllm import ERAS, VLLM_VERSION
from kvctl.keys.prompts import (
    EMBED_DTYPE_BYTES,
    LoraRef,
    MmItem,
    Prompt,
    PromptEmbeds,
    lmcache_tags,
)

VECTORS = Path(__file__).parent / "vectors"


def _load(name: str) -> dict[str, Any]:
    return json.loads((VECTORS / f"{name}.json").read_text())


def _prompt(p: dict[str, Any]) -> Prompt:
    embeds = None
    if (spec := p.get("prompt_embeds")) is not None:
        row = spec["hidden_size"] * EMBED_DTYPE_BYTES[spec["dtype"]]
        embeds = PromptEmbeds(bytes.fromhex(spec["hex"]), row)
    return Prompt(
        p["id"], tuple(p["tokens"]), LoraRef(**p["lora"]) if p.get("lora") else None,
        p.get("cache_salt"), p.get("extra_key"),
        mm=tuple(MmItem(m["identifier"], m["offset"], m["length"]) for m in p.get("mm", [])),
        prompt_embeds=embeds,
        lmcache_tags=lmcache_tags(p.get("kv_transfer_params"), where="vector"))


def _prompts(doc: dict[str, Any]) -> dict[str, Prompt]:
    return {p["id"]: _prompt(p) for p in doc["prompts"]}


def _cases(name: str) -> list[Any]:
    doc = _load(name)
    return [
        pytest.param(run, case,
                     id=f"{case['profile']}-B{case['block_size']}-{case['prompt']}"
                        f"-seed{run['pythonhashseed']!r}-{run.get('lmcache_host', '')}"
                        f"-{case.get('model', '')}-{'-'.join(map(str, case.get('options', {})))}")
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


@pytest.mark.parametrize(("run", "case"), _cases("vllm"))
def test_vllm_profiles_match_vllm(run: dict[str, Any], case: dict[str, Any]) -> None:
    hashseed = run["pythonhashseed"]
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


@pytest.mark.parametrize("case", _load("vllm")["mooncake_ranks"],
                         ids=lambda c: f"tp{c['tp_size']}-r{c['tp_rank']}-h{c['num_kv_heads']}"
                                       f"-mla{c['mla']}-pp{c['pp_rank']}")
def test_vllm_mooncake_rank_rules_match_the_connector(case: dict[str, Any]) -> None:
    profile = get_profile(case["profile"])
    options = EngineOptions(tp_size=case["tp_size"], num_kv_heads=case["num_kv_heads"],
                            mla=case["mla"], pp_rank=case["pp_rank"],
                            pp_size=max(2, case["pp_rank"] + 1))
    keyer = profile.keyer(KeyConfig(
        profile=profile.name, block_size=case["block_size"], pythonhashseed="0",
        fields=SeedFields(model=case["model"]), tp_rank=case["tp_rank"],
        store_prefix=case["cache_prefix"], key_format=KeyFormat.MOONCAKE, options=options))
    assert keyer.keys(VLLM[case["prompt"]]) == case["keys"]


ERAS_DOC = _load("vllm_eras")
ERA_PROMPTS = _prompts(ERAS_DOC)


def _era_cases() -> list[Any]:
    return [pytest.param(run, case, id=f"{run['family']}-{run['release']}:{case['algo']}-"
                                       f"{case['prompt']}-seed{run['pythonhashseed']}")
            for run in ERAS_DOC["runs"] for case in run["cases"]]


@pytest.mark.parametrize(("run", "case"), _era_cases())
def test_vllm_release_families_match_each_release(run: dict[str, Any],
                                                  case: dict[str, Any]) -> None:
    profile = get_profile(f"{run['family']}:{case['algo']}")
    keyer = profile.keyer(KeyConfig(profile=profile.name, block_size=case["block_size"],
                                    pythonhashseed=run["pythonhashseed"]))
    assert keyer.seed.reproducible
    assert keyer.keys(ERA_PROMPTS[case["prompt"]]) == case["keys"]


def test_every_family_was_recorded_at_both_ends_of_its_releases() -> None:
    recorded = {(r["family"], r["release"]) for r in ERAS_DOC["runs"] if r["cases"]}
    for era in ERAS:
        assert {r for f, r in recorded if f == era.family} == set(ERAS_DOC["releases"][era.family])
    # Before 0.29 an unset PYTHONHASHSEED gives a random NONE_HASH: nothing was recordable.
    for run in ERAS_DOC["runs"]:
        era = next(e for e in ERAS if e.family == run["family"])
        if run["pythonhashseed"] is None and not era.fixed_default_seed:
            assert run["cases"] == []
            keyer = get_profile(f"{era.family}:sha256").keyer(KeyConfig(
                profile=f"{era.family}:sha256"))
            assert not keyer.seed.reproducible


LMCACHE = _prompts(_load("lmcache"))


@pytest.mark.parametrize(("run", "case"), _cases("lmcache"))
def test_lmcache_profiles_match_lmcache(run: dict[str, Any], case: dict[str, Any]) -> None:
    profile = get_profile(case["profile"])
    options = EngineOptions(lmcache_host=LmcacheHost(run["lmcache_host"]),
                            **{k: v for k, v in case.get("options", {}).items()
                               if k != "lmcache_host"})
    config = KeyConfig(profile=profile.name, block_size=case["block_size"],
                       pythonhashseed=run["pythonhashseed"],
                       fields=SeedFields(model=case["model"], kv_dtype=case["kv_dtype"]),
                       world_size=case["world_size"], worker_id=case["worker_id"],
                       options=options)
    keyer = profile.keyer(config)
    assert keyer.seed.value == str(case["none_hash"])
    prompt = LMCACHE[case["prompt"]]
    assert keyer.keys(prompt) == case["keys"]
    assert len(case["keys"]) == profile.keyed_blocks(len(prompt.tokens), config)
    # LMCache's Mooncake connector stores each chunk under CacheEngineKey.to_string().
    mooncake = profile.keyer(KeyConfig(**{**config.__dict__, "key_format": KeyFormat.MOONCAKE}))
    assert mooncake.keys(prompt) == case["keys"]


def test_lmcache_without_vllm_ignores_the_seed_and_the_algorithm() -> None:
    runs = [r for r in _load("lmcache")["runs"] if r["lmcache_host"] == "none"]
    assert {r["pythonhashseed"] for r in runs} == {None, "42"}
    by_seed = [{(c["profile"], c["block_size"], c["model"], c["prompt"],
                 json.dumps(c.get("options", {}), sort_keys=True)): c["keys"]
                for c in r["cases"]} for r in runs]
    assert by_seed[0] == by_seed[1]
    builtin = {k[1:]: v for k, v in by_seed[0].items() if k[0] == "lmcache"}
    cbor = {k[1:]: v for k, v in by_seed[0].items() if k[0] == "lmcache:sha256_cbor"}
    assert builtin
    assert all(cbor[k] == v for k, v in builtin.items() if k in cbor)


SGLANG = _prompts(_load("sglang"))


@pytest.mark.parametrize(("run", "case"), _cases("sglang"))
def test_sglang_profile_matches_sglang(run: dict[str, Any], case: dict[str, Any]) -> None:
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


@pytest.mark.parametrize("layout", _load("sglang")["mooncake_layouts"],
                         ids=lambda c: c["layout"])
def test_sglang_mooncake_pp_and_mla_suffixes(layout: dict[str, Any]) -> None:
    keyer = get_profile("sglang").keyer(KeyConfig(
        profile="sglang", block_size=layout["block_size"],
        fields=SeedFields(model=layout["model"]), tp_rank=layout["tp_rank"],
        store_prefix=layout["backend_tag"], key_format=KeyFormat.MOONCAKE,
        options=EngineOptions(mla=layout["mla"], pp_rank=layout["pp_rank"],
                              pp_size=layout["pp_size"])))
    expected = layout["keys"] if layout["mla"] else layout["keys"][0::2]
    assert keyer.keys(SGLANG[layout["prompt"]]) == expected


def test_vectors_cover_lora_salt_and_partial_blocks() -> None:
    # Guard against a re-recording that silently drops the interesting prompts.
    ids = {p["id"] for p in _load("vllm")["prompts"]}
    assert {"lora", "salted", "partial", "big-ids", "lora-by-path", "salt-empty", "wide-ids",
            "mm", "mm-lora-salt", "embeds", "tagged"} <= ids
    cases = [c for r in _load("vllm")["runs"] for c in r["cases"]]
    lora = {c["keys"][0] for c in cases if c["prompt"] == "lora" and c["block_size"] == 16}
    salted = {c["keys"][0] for c in cases if c["prompt"] == "salted" and c["block_size"] == 16}
    assert lora.isdisjoint(salted)
    assert all(c["keys"] == [] for c in cases if c["prompt"] == "partial")


def test_sglang_empty_salt_is_no_namespace_and_lora_paths_ids_are_uuid5() -> None:
    cases = {(c["prompt"], c["block_size"]): c for r in _load("sglang")["runs"]
             for c in r["cases"]}
    empty = cases[("salt-empty", 16)]
    assert empty["keys"] == empty["unnamespaced_keys"]
    by_path = cases[("lora-by-path", 16)]
    assert by_path["extra_key"] == "b6929e6f70255da988f96d21061e2558"  # uuid5(name\0path)
    assert by_path["keys"] != by_path["unnamespaced_keys"]
