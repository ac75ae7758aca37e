"""Chain invariants of kvctl's own scheme (property-based) and the seed encoding."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import UsageError
from kvctl.keys.chain import (
    HASHES,
    SeedFields,
    chain_keys,
    derive_seed,
    encode_seed,
    parse_extra_fields,
)
from kvctl.keys.pyhash import str_hash

token = st.integers(min_value=0, max_value=2**32 - 1)
tokens_st = st.lists(token, min_size=0, max_size=200)
block_st = st.integers(min_value=1, max_value=32)
hash_st = st.sampled_from(HASHES)
SEED = derive_seed(SeedFields(model="m"))


@settings(max_examples=40, deadline=None)
@given(tokens=tokens_st, block_size=block_st, hash_name=hash_st)
def test_only_full_blocks_get_keys(tokens: list[int], block_size: int, hash_name: str) -> None:
    keys = chain_keys(tokens, block_size=block_size, seed=SEED, hash_name=hash_name)
    assert len(keys) == len(tokens) // block_size
    # Appending a partial block adds no key and changes none.
    more = chain_keys(tokens + [1] * (block_size - 1 - len(tokens) % block_size or 0),
                      block_size=block_size, seed=SEED, hash_name=hash_name)
    assert more[: len(keys)] == keys


@settings(max_examples=40, deadline=None)
@given(prefix=tokens_st, a=tokens_st, b=tokens_st, block_size=block_st, hash_name=hash_st)
def test_same_prefix_same_keys(prefix: list[int], a: list[int], b: list[int], block_size: int,
                               hash_name: str) -> None:
    ka = chain_keys(prefix + a, block_size=block_size, seed=SEED, hash_name=hash_name)
    kb = chain_keys(prefix + b, block_size=block_size, seed=SEED, hash_name=hash_name)
    shared = len(prefix) // block_size
    assert ka[:shared] == kb[:shared]


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(token, min_size=1, max_size=200), data=st.data(), block_size=block_st,
       hash_name=hash_st)
def test_change_at_t_changes_keys_from_its_block_on(tokens: list[int], data: st.DataObject,
                                                    block_size: int, hash_name: str) -> None:
    t = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    new = data.draw(token.filter(lambda v: v != tokens[t]))
    changed = list(tokens)
    changed[t] = new
    k1 = chain_keys(tokens, block_size=block_size, seed=SEED, hash_name=hash_name)
    k2 = chain_keys(changed, block_size=block_size, seed=SEED, hash_name=hash_name)
    b = t // block_size
    assert k1[:b] == k2[:b]
    assert all(x != y for x, y in zip(k1[b:], k2[b:], strict=True))


field_names = ["model", "revision", "tenant", "lora_name", "lora_path", "kv_dtype",
               "kv_layout", "cache_salt"]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(field_names), v1=st.text(max_size=8), v2=st.text(max_size=8),
       tokens=st.lists(token, min_size=16, max_size=80), hash_name=hash_st)
def test_different_seed_field_changes_every_key(name: str, v1: str, v2: str,
                                                tokens: list[int], hash_name: str) -> None:
    if v1 == v2:
        v2 = v1 + "x"
    s1 = derive_seed(SeedFields(**{name: v1}), hash_name=hash_name)
    s2 = derive_seed(SeedFields(**{name: v2}), hash_name=hash_name)
    k1 = chain_keys(tokens, block_size=8, seed=s1, hash_name=hash_name)
    k2 = chain_keys(tokens, block_size=8, seed=s2, hash_name=hash_name)
    assert all(x != y for x, y in zip(k1, k2, strict=True))


def test_seed_encoding_is_unambiguous() -> None:
    # Moving characters between adjacent fields would collide under plain concatenation.
    a = SeedFields(model="ab", revision="c")
    b = SeedFields(model="a", revision="bc")
    assert encode_seed(a) != encode_seed(b)
    # An extra field cannot impersonate a fixed one.
    c = SeedFields(extra=(("model", "x"),))
    d = SeedFields(model="x")
    assert encode_seed(c) != encode_seed(d)
    # Domain separation: the encoding starts with kvctl's tag, so no other use of H matches.
    assert encode_seed(a).startswith(b"kvctl/block-key-seed/v1\x00")
    assert derive_seed(a) == hashlib.sha256(encode_seed(a)).digest()


@settings(max_examples=50, deadline=None)
@given(f1=st.fixed_dictionaries({n: st.text(max_size=4) for n in field_names}),
       f2=st.fixed_dictionaries({n: st.text(max_size=4) for n in field_names}))
def test_seed_encoding_is_injective(f1: dict[str, str], f2: dict[str, str]) -> None:
    assert (encode_seed(SeedFields(**f1)) == encode_seed(SeedFields(**f2))) == (f1 == f2)


def test_digest_sizes_and_known_answer() -> None:
    sizes = {h: len(chain_keys([1] * 16, block_size=16, seed=b"s", hash_name=h)[0])
             for h in HASHES}
    assert sizes == {"sha256": 32, "blake2b": 32, "xxh3-128": 16}
    # key_0 = H(seed || tokens as little-endian uint32), computed independently here.
    data = b"".join(t.to_bytes(4, "little") for t in range(16))
    assert chain_keys(list(range(16)), block_size=16, seed=b"seed")[0] == \
        hashlib.sha256(b"seed" + data).digest()


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_bad_token_ids_are_usage_errors(bad: list[object]) -> None:
    with pytest.raises(UsageError, match="token id"):
        chain_keys(bad * 16, block_size=16, seed=b"", hash_name="sha256")  # type: ignore[arg-type]


def test_bad_block_size_hash_and_fields() -> None:
    with pytest.raises(UsageError, match="block size"):
        chain_keys([1], block_size=0, seed=b"")
    with pytest.raises(UsageError, match="unknown hash") as err:
        chain_keys([1], block_size=1, seed=b"", hash_name="md5")
    assert "sha256, blake2b, xxh3-128" in (err.value.hint or "")
    with pytest.raises(UsageError, match="NAME=VALUE"):
        parse_extra_fields(["novalue"])
    with pytest.raises(UsageError, match="given twice"):
        SeedFields(extra=(("a", "1"), ("a", "2"))).items()


@pytest.mark.parametrize("seed", ["0", "1", "42", "4294967295"])
def test_cpython_str_hash_matches_a_real_interpreter(seed: str) -> None:
    words = ["vllm-none-hash", "0", "é", "€uro", "😀", "x" * 17]
    code = "import sys; print(*(hash(w) for w in sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, *words], env={"PYTHONHASHSEED": seed},
                          capture_output=True, text=True, check=True, timeout=30)
    assert [int(v) for v in done.stdout.split()] == [str_hash(w, seed) for w in words]


def test_str_hash_rejects_non_integer_seeds() -> None:
    with pytest.raises(UsageError, match="PYTHONHASHSEED"):
        str_hash("x", "random")
