"""chain_keys converts the whole prompt once: every input form must give the same keys as
the documented encoding (key_i = H(key_{i-1} || block as little-endian uint32)), and only
the keyed part of the prompt is validated."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import UsageError
from kvctl.keys.chain import chain_keys, pack_tokens


def _reference(tokens: list[int], block_size: int, seed: bytes) -> list[bytes]:
    keys, prev = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[start:start + block_size])
        prev = hashlib.sha256(prev + block).digest()
        keys.append(prev)
    return keys


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
       block_size=st.sampled_from([1, 3, 16]))
def test_list_tuple_and_packed_array_match_the_encoding(tokens: list[int],
                                                        block_size: int) -> None:
    want = _reference(tokens, block_size, b"seed")
    assert chain_keys(tokens, block_size=block_size, seed=b"seed") == want
    assert chain_keys(tuple(tokens), block_size=block_size, seed=b"seed") == want
    assert chain_keys(array("I", tokens), block_size=block_size, seed=b"seed") == want
    assert pack_tokens(tokens) == b"".join(t.to_bytes(4, "little") for t in tokens)


def test_bad_id_in_the_unkeyed_tail_is_ignored_but_not_in_a_block() -> None:
    tokens = list(range(16))
    assert chain_keys([*tokens, -1], block_size=16, seed=b"s") == \
        chain_keys(tokens, block_size=16, seed=b"s")
    with pytest.raises(UsageError, match="token id -1"):
        chain_keys([*tokens[:15], -1, 7], block_size=16, seed=b"s")
    assert tokens == list(range(16))  # the caller's list is not touched
