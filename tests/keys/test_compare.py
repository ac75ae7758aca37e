"""compare: manifests that differ in exactly one setting get a diagnosis naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvctl.keys.chain import SeedFields
from kvctl.keys.compare import compare
from kvctl.keys.manifest import Manifest, emit
from kvctl.keys.profiles import KeyConfig, KeyFormat
from kvctl.keys.prompts import LoraRef, Prompt
from kvctl.keys.selfcheck import held_prefix

TOKENS = tuple((i * 31 + 5) % 50_000 for i in range(100))
PROMPT = Prompt("p", TOKENS)


def _manifest(config: KeyConfig, prompt: Prompt = PROMPT, source: str = "") -> Manifest:
    return dataclasses.replace(emit(config, [prompt]), source=source)


def _pair(base: KeyConfig, other: KeyConfig, pa: Prompt = PROMPT,
          pb: Prompt = PROMPT) -> tuple[str, list[str], Any]:
    result = compare([_manifest(base, pa, "a.json"), _manifest(other, pb, "b.json")])
    (r,) = result.results
    return r.status, [c.setting for c in r.causes], r


KV = KeyConfig(profile="kvctl:sha256", block_size=16,
               fields=SeedFields(model="m", revision="r1", tenant="t1", kv_dtype="bf16",
                                 kv_layout="NHD"))
VLLM = KeyConfig(profile="vllm:sha256_cbor", block_size=16, pythonhashseed="0",
                 fields=SeedFields(model="org/m", revision="r1"))


def _fields(config: KeyConfig, **changes: Any) -> KeyConfig:
    return dataclasses.replace(config, fields=config.fields.replace(**changes))


@pytest.mark.parametrize(("other", "cause"), [
    (dataclasses.replace(KV, block_size=32), "block_size"),
    (dataclasses.replace(KV, profile="kvctl:blake2b"), "profile"),
    (_fields(KV, model="m2"), "model"),
    (_fields(KV, revision="r2"), "revision"),
    (_fields(KV, tenant="t2"), "tenant"),
    (_fields(KV, kv_dtype="fp8"), "kv_dtype"),
    (_fields(KV, kv_layout="HND"), "kv_layout"),
    (_fields(KV, extra=(("rope", "yarn"),)), "extra"),
    (dataclasses.replace(VLLM, profile="vllm:sha256"), "profile"),
    (dataclasses.replace(VLLM, pythonhashseed="1"), "pythonhashseed"),
    (dataclasses.replace(VLLM, pythonhashseed=None), "pythonhashseed"),
])
def test_one_setting_differs_and_the_diagnosis_names_it(other: KeyConfig, cause: str) -> None:
    base = VLLM if other.profile.startswith("vllm") else KV
    status, causes, r = _pair(base, other)
    assert status == "mismatch"
    assert causes == [cause]
    assert r.first_diverging_block == 0


@pytest.mark.parametrize(("pb", "cause"), [
    (dataclasses.replace(PROMPT, lora=LoraRef("sql", "/a/sql")), "lora"),
    (dataclasses.replace(PROMPT, cache_salt="tenant-b"), "cache_salt"),
])
def test_per_request_fields_are_diagnosed(pb: Prompt, cause: str) -> None:
    status, causes, _ = _pair(VLLM, VLLM, PROMPT, pb)
    assert (status, causes) == ("mismatch", [cause])


def test_token_difference_names_the_block() -> None:
    changed = list(TOKENS)
    changed[40] += 1
    status, causes, r = _pair(KV, KV, PROMPT, dataclasses.replace(PROMPT, tokens=tuple(changed)))
    assert (status, causes) == ("mismatch", ["tokens"])
    assert r.first_diverging_block == 2
    assert "from block 2 (tokens 32..47)" in r.causes[0].detail


def test_xxhash_without_pythonhashseed_never_matches() -> None:
    config = dataclasses.replace(VLLM, profile="vllm:xxhash", pythonhashseed=None)
    status, causes, r = _pair(config, config)
    assert (status, causes) == ("mismatch", ["pythonhashseed"])
    assert "random first link" in r.causes[0].detail


def test_equal_settings_match_and_unmixed_differences_are_hazards() -> None:
    assert _pair(KV, KV)[0] == "match"
    # vLLM does not mix the revision into its keys: equal keys, but a hazard to report.
    status, causes, r = _pair(VLLM, _fields(VLLM, revision="r2"))
    assert (status, causes) == ("match", [])
    assert [h.setting for h in r.hazards] == ["revision"]


def test_mooncake_keys_differ_by_model_and_rank() -> None:
    mc = dataclasses.replace(VLLM, key_format=KeyFormat.MOONCAKE)
    assert _pair(mc, dataclasses.replace(mc, tp_rank=1))[1] == ["tp_rank"]
    assert _pair(mc, _fields(mc, model="org/other"))[1] == ["model"]
    assert _pair(mc, dataclasses.replace(mc, key_format=KeyFormat.RAW))[1] == ["key_format"]


def test_three_instances_give_every_pair() -> None:
    ms = [_manifest(KV, source=f"{n}.json") for n in "abc"]
    ms[2] = _manifest(_fields(KV, tenant="x"), source="c.json")
    result = compare(ms)
    assert [(r.a, r.b, r.status) for r in result.results] == [
        ("a.json", "b.json", "match"), ("a.json", "c.json", "mismatch"),
        ("b.json", "c.json", "mismatch")]
    assert not result.ok


def test_store_held_prefix_takes_an_exists_callable() -> None:
    keys = emit(KV, [PROMPT]).prompts[0].keys
    store = {keys[0], keys[1], keys[4]}
    held = held_prefix("p", keys, lambda ks: [k in store for k in ks])
    assert (held.blocks, held.leading_held, held.held_after_gap) == (6, 2, 1)
