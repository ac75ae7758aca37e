"""The shm transport: contiguous requests merge into single copies; gaps do not."""

from __future__ import annotations

from kvctl.transfer.batch import OpCode
from kvctl.transfer.segments import wrap_memory
from kvctl.transfer.transports.shm import copy_run, merge_runs


def test_contiguous_items_merge_and_others_do_not() -> None:
    local = wrap_memory("l", [bytearray(64)]).buffers[0]
    remote = wrap_memory("r", [bytearray(64), bytearray(64)]).buffers
    items = [
        (0, local, 0, 0, 0, 0, 8), (1, local, 8, 0, 8, 8, 8),  # contiguous: one run
        (2, local, 16, 0, 32, 32, 8),                         # gap on the remote side
        (3, local, 24, 1, 40, 104, 8),                        # other remote buffer
        (4, local, 40, 1, 48, 112, 8),                        # gap on the local side
    ]
    runs = merge_runs(items, list(remote))  # type: ignore[arg-type]
    assert [(r[1], r[3], r[4], r[5]) for r in runs] == [
        (0, 0, 16, 2), (16, 32, 8, 1), (24, 40, 8, 1), (40, 48, 8, 1)]


def test_copy_moves_bytes_both_ways_in_either_size_class() -> None:
    for size in (100, 200_000):  # slice assignment below MEMMOVE_BYTES, memmove above
        a = wrap_memory("a", [bytearray(b"x" * size)]).buffers[0]
        b = wrap_memory("b", [bytearray(size)]).buffers[0]
        copy_run(OpCode.WRITE, a, 0, b, 0, size)  # WRITE: local a -> remote b
        assert bytes(b.view) == b"x" * size  # type: ignore[arg-type]
        b.view[:] = b"y" * size  # type: ignore[index]
        copy_run(OpCode.READ, a, 0, b, 0, size)  # READ: remote b -> local a
        assert bytes(a.view) == b"y" * size  # type: ignore[arg-type]
