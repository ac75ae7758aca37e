"""SGLang's storage namespace for absent, empty and set ``extra_key`` / ``cache_salt``.

The ``namespace_cases`` of tests/keys/vectors/sglang.json were recorded by
scripts/record_key_vectors/record.py through SGLang 0.5.23's own request path:
``GenerateReqInput.normalize_batch_and_arguments`` (io_struct.py, single and batch
requests), ``Req.__init__`` (schedule_batch.py: the LoRA id appended to ``extra_key``),
``RadixKey`` (radix_cache.py) and ``get_storage_hash_str`` / ``storage_namespace_seed``
(mem_cache/utils.py). The ``req`` cases hand the values to ``Req`` without io_struct: they
show what SGLang's hash does with an empty ``extra_key`` that no request path delivers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvctl.keys.profiles import KeyConfig, get_profile
from kvctl.keys.profiles.sglang import namespace_seed, request_extra_key
from kvctl.keys.prompts import LoraRef, Prompt

DOC = json.loads((Path(__file__).parent / "vectors" / "sglang.json").read_text())
CASES: list[dict[str, Any]] = DOC["namespace_cases"]
TOKENS = tuple(DOC["namespace_tokens"])
REQUESTS = [c for c in CASES if c["ingress"] != "req"]


def _id(case: dict[str, Any]) -> str:
    lora = "lora" if case["lora"] else "nolora"
    return f"{case['ingress']}-{lora}-ek{case['extra_key']!r}-salt{case['cache_salt']!r}"


def _prompt(case: dict[str, Any]) -> Prompt:
    lora = LoraRef(**case["lora"]) if case["lora"] else None
    return Prompt("ns", TOKENS, lora, cache_salt=case["cache_salt"],
                  extra_key=case["extra_key"])


def _by(ingress: str) -> dict[tuple[bool, str | None, str | None], dict[str, Any]]:
    return {(bool(c["lora"]), c["extra_key"], c["cache_salt"]): c for c in CASES
            if c["ingress"] == ingress}


@pytest.mark.parametrize("case", REQUESTS, ids=_id)
def test_kvctl_keys_a_request_as_sglang_does(case: dict[str, Any]) -> None:
    config = KeyConfig(profile="sglang", block_size=case["block_size"])
    keyer = get_profile("sglang").keyer(config)
    prompt = _prompt(case)
    assert keyer.keys(prompt) == case["keys"]
    assert request_extra_key(prompt, config) == case["req_extra_key"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_namespace_seed_matches_sglangs_for_what_reaches_the_hash(case: dict[str, Any]) -> None:
    seed = namespace_seed(case["req_extra_key"], case["req_cache_salt"])
    assert (seed.hex() if seed is not None else None) == case["namespace_seed"]


def test_an_empty_extra_key_or_salt_in_a_request_is_no_namespace() -> None:
    for ingress in ("single", "batch"):
        cases = _by(ingress)
        for (lora, extra, salt), case in cases.items():
            bare = cases[(lora, extra or None, salt or None)]
            assert case["keys"] == bare["keys"], (ingress, lora, extra, salt)
        assert cases[(False, "", "")]["namespace_seed"] is None
    assert [c["keys"] for c in REQUESTS if c["ingress"] == "single"] == \
        [c["keys"] for c in REQUESTS if c["ingress"] == "batch"]


def test_only_an_unnormalized_empty_extra_key_without_lora_is_a_namespace() -> None:
    # What SGLang's hash does with values io_struct never passes on: an empty extra_key
    # is a namespace of its own (present, length 0), an empty cache_salt is none
    # (Req.__init__: cache_salt or None), and with a LoRA the empty key is just the id.
    req = _by("req")
    assert req[(False, "", None)]["namespace_seed"] is not None
    assert req[(False, "", None)]["keys"] != req[(False, None, None)]["keys"]
    assert req[(False, None, "")]["keys"] == req[(False, None, None)]["keys"]
    assert req[(True, "", None)]["keys"] == req[(True, None, None)]["keys"]
    assert req[(True, "", "")]["req_extra_key"] == req[(True, None, None)]["req_extra_key"]
