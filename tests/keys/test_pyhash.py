"""PYTHONHASHSEED read exactly as CPython reads it, checked against real interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvctl.errors import UsageError
from kvctl.keys.chain import SeedFields
from kvctl.keys.profiles import KeyConfig, get_profile
from kvctl.keys.prompts import Prompt
from kvctl.keys.pyhash import parse_hash_seed, str_hash

#: Texts CPython accepts, refuses, or reads as "random" (Python/initconfig.c,
#: config_init_hash_seed: strtoul(text, &end, 10), whole text, at most 4294967295).
SEEDS = ["7", "+7", " 7", "\t+007", "0007", "-0", "0", "+0", "4294967295", "\n\v\f\r 12",
         "", "random",
         "-7", "7 ", "0x7", "7.0", "4294967296", "99999999999999999999999", "+", " ", "-",
         "Random", "\u0663", "1_000", "+-7"]


def _real(seed: str) -> tuple[int, int] | None:
    """(hash('abc'), sys.flags.hash_randomization) in a real interpreter, None if it refuses."""
    code = "import sys; print(hash('abc'), sys.flags.hash_randomization)"
    done = subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed},
                          capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        assert "PYTHONHASHSEED must be" in done.stderr
        return None
    value, randomized = done.stdout.split()
    return int(value), int(randomized)


@pytest.mark.parametrize("seed", SEEDS, ids=[repr(s) for s in SEEDS])
def test_parse_hash_seed_agrees_with_cpython(seed: str) -> None:
    real = _real(seed)
    if real is None:
        with pytest.raises(UsageError, match="refused by CPython"):
            parse_hash_seed(seed)
        return
    value, randomized = real
    parsed = parse_hash_seed(seed)
    if parsed is None:  # a random secret: nothing to reproduce
        assert randomized == 1
        with pytest.raises(UsageError, match="not a fixed seed"):
            str_hash("abc", seed)
        return
    assert str_hash("abc", seed) == value
    assert randomized == (parsed != 0)


def test_signs_spaces_and_zeros_name_the_same_seed() -> None:
    assert {parse_hash_seed(s) for s in ("7", "+7", " 7", "\t+007")} == {7}
    assert parse_hash_seed("-0") == 0
    assert parse_hash_seed(None) is None


def test_huge_digit_strings_are_refused_without_int_limits() -> None:
    with pytest.raises(UsageError, match="refused"):
        parse_hash_seed("1" + "0" * 5000)
    assert parse_hash_seed("0" * 5000 + "7") == 7


def test_lmcache_accepts_a_signed_seed_as_cpython_does() -> None:
    prompt = Prompt("p", tuple(range(1, 600)))
    profile = get_profile("lmcache")
    fields = SeedFields(model="Qwen/Qwen3-8B", kv_dtype="bfloat16")
    keys = {seed: profile.keyer(KeyConfig(profile="lmcache", block_size=256, fields=fields,
                                          pythonhashseed=seed)).keys(prompt)
            for seed in ("+7", " 007")}
    # vLLM hashes the variable's text, so '+7' and ' 007' give different NONE_HASHes, each
    # under the interpreter secret of seed 7.
    assert keys["+7"] != keys[" 007"]
    assert all(len(k) == 2 for k in keys.values())


def test_engines_refuse_a_seed_their_interpreter_refuses() -> None:
    for name in ("lmcache", "vllm:sha256"):
        profile = get_profile(name)
        config = KeyConfig(profile=name, block_size=16, pythonhashseed="-7",
                           fields=SeedFields(model="m", kv_dtype="bfloat16"))
        with pytest.raises(UsageError, match="refused by CPython"):
            profile.keyer(config)
