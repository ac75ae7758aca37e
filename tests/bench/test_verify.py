"""Block patterns: unique per run, configuration, block and offset; mismatches located."""

import pytest

from kvctl.bench.verify import (
    STRIDE,
    IntegrityError,
    Pattern,
    check_block,
    find_mismatch,
    first_difference,
)


def test_pattern_roundtrip_and_uniqueness() -> None:
    pattern = Pattern.for_config(run_id=7, config_index=3)
    blocks = [pattern.expected(i, 3 * STRIDE + 100) for i in range(4)]
    assert len({bytes(b) for b in blocks}) == 4  # every block differs
    for i, block in enumerate(blocks):
        check_block(pattern, memoryview(block), i, where="t")  # intact: no error
    other_run = Pattern.for_config(run_id=8, config_index=3).expected(0, 4096)
    other_config = Pattern.for_config(run_id=7, config_index=4).expected(0, 4096)
    assert other_run != blocks[0][:4096]
    assert other_config != blocks[0][:4096]


def test_every_stride_is_stamped_with_its_offset() -> None:
    pattern = Pattern.for_config(1, 1)
    block = pattern.expected(5, 2 * STRIDE)
    # Same filler in both strides, different stamps: a shifted copy is caught.
    assert block[:24] != block[STRIDE : STRIDE + 24]
    assert block[24:STRIDE] == block[STRIDE + 24 :]


def test_flipped_byte_is_located() -> None:
    pattern = Pattern.for_config(1, 2)
    block = pattern.expected(9, 64 * 1024)
    block[40_000] ^= 0xFF
    bad = find_mismatch(pattern, memoryview(block), 9)
    assert bad is not None
    assert bad.offset == 40_000
    assert bad.actual == bad.expected ^ 0xFF
    with pytest.raises(IntegrityError, match="block 9 differs at byte offset 40000"):
        check_block(pattern, memoryview(block), 9, where="write tcp 64 KiB x1")


def test_misplaced_block_is_caught_at_offset_zero() -> None:
    pattern = Pattern.for_config(1, 2)
    wrong = pattern.expected(1, 4096)
    bad = find_mismatch(pattern, memoryview(wrong), 0)
    assert bad is not None
    assert bad.offset == 8  # run word equal, block index (bytes 8..15) differs


def test_tiny_blocks_keep_a_truncated_stamp() -> None:
    pattern = Pattern.for_config(3, 0)
    assert pattern.expected(0, 10) != pattern.expected(1, 10)
    assert pattern.expected(2, 16) != pattern.expected(3, 16)


def test_first_difference() -> None:
    assert first_difference(b"abc", b"abc") is None
    data = bytearray(10_000)
    other = bytearray(data)
    other[9_999] = 1
    assert first_difference(memoryview(data), memoryview(other)) == 9_999
    with pytest.raises(ValueError):
        first_difference(b"a", b"ab")
