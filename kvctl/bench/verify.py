"""Per-block integrity patterns: every block says which run, block and offset it is.

A block is laid out in chunks of :data:`STRIDE` bytes. Each chunk starts with a 24-byte
stamp ``(run word, block index, byte offset)`` (little-endian u64s) followed by a run-wide
pseudo-random filler. A block landing at the wrong place, a stale block from an earlier
configuration, a torn or shifted copy and a flipped byte all differ from the expected bytes;
:func:`check_block` names the first bad offset.

Filling and checking run at memcpy speed: the filler is repeated by C code and only the
stamps (one per 4 KiB) are written from Python.
"""

from __future__ import annotations

import dataclasses
import random
import struct

from kvctl.errors import CheckFailedError

STRIDE = 4096
_STAMP = struct.Struct("<QQQ")


class IntegrityError(CheckFailedError):
    """A block came back different from what was sent (``--verify``)."""


@dataclasses.dataclass(frozen=True)
class Pattern:
    """The pattern of one run and configuration.

    Attributes:
        run_word: 64-bit value naming the run (high 32 bits) and configuration (low 32 bits).
    """

    run_word: int

    @classmethod
    def for_config(cls, run_id: int, config_index: int) -> Pattern:
        """The pattern of configuration ``config_index`` of run ``run_id`` (32 bits used)."""
        return cls(((run_id & 0xFFFFFFFF) << 32) | (config_index & 0xFFFFFFFF))

    def filler(self) -> bytes:
        """The run-wide filler of one stride (deterministic in ``run_word``)."""
        return random.Random(self.run_word).randbytes(STRIDE)

    def expected(self, block_index: int, size_bytes: int) -> bytearray:
        """The bytes block ``block_index`` of ``size_bytes`` must hold."""
        out = bytearray(size_bytes)
        self.fill(memoryview(out), block_index)
        return out

    def fill(self, view: memoryview, block_index: int) -> None:
        """Write the pattern of block ``block_index`` into ``view`` (the whole block)."""
        size = len(view)
        filler = self.filler()
        reps, rest = divmod(size, STRIDE)
        view[: reps * STRIDE] = filler * reps
        view[reps * STRIDE :] = filler[:rest]
        for offset in range(0, size, STRIDE):
            stamp = _STAMP.pack(self.run_word, block_index, offset)
            end = min(offset + len(stamp), size)
            view[offset:end] = stamp[: end - offset]


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where a block first differs.

    Attributes:
        block_index: the block's index in the batch region.
        offset: byte offset inside the block.
        expected / actual: the byte values at that offset.
    """

    block_index: int
    offset: int
    expected: int
    actual: int


def first_difference(expected: memoryview | bytes, actual: memoryview | bytes) -> int | None:
    """Offset of the first differing byte, or ``None`` when equal (same lengths required)."""
    if len(expected) != len(actual):
        raise ValueError("first_difference needs equal lengths")
    if expected == actual:
        return None
    lo, hi = 0, len(expected)
    # Bisect with C-speed slice compares: the first half that differs holds the first byte.
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if expected[lo:mid] != actual[lo:mid]:
            hi = mid
        else:
            lo = mid
    for index in range(lo, hi):
        if expected[index] != actual[index]:
            return index
    raise AssertionError("unreachable: unequal views with no differing byte")  # pragma: no cover


def find_mismatch(pattern: Pattern, view: memoryview, block_index: int) -> Mismatch | None:
    """The first mismatch of block ``block_index`` held in ``view``; ``None`` when intact."""
    expected = pattern.expected(block_index, len(view))
    offset = first_difference(memoryview(expected), view)
    if offset is None:
        return None
    return Mismatch(block_index, offset, expected[offset], view[offset])


def check_block(pattern: Pattern, view: memoryview, block_index: int, *, where: str) -> None:
    """Raise :class:`IntegrityError` naming the first bad offset if the block is not intact.

    Args:
        where: the configuration and side, for the message (``write tcp 4 KiB x128``).
    """
    bad = find_mismatch(pattern, view, block_index)
    if bad is not None:
        raise IntegrityError(
            f"{where}: block {bad.block_index} differs at byte offset {bad.offset} "
            f"(expected 0x{bad.expected:02x}, got 0x{bad.actual:02x})",
            "the fabric or engine corrupted or misplaced data: rerun with -v and check the "
            "path shown; compare another transport with --transport",
        )
