"""Space allocation inside one node segment: best-fit over free extents with coalescing.

Two sorted views of the free extents are kept (:class:`~kvctl.store.sortedchunks.
SortedChunks`: O(log n) search, invisible to the garbage collector): by offset (to merge
neighbours on free) and by length then offset (to find the smallest extent that fits).
Every allocation is rounded up to :attr:`ExtentAllocator.alignment_bytes`. A restore
builds the allocator from every live range at once (:meth:`ExtentAllocator.from_ranges`:
one sort, whatever order the ranges come in) instead of carving them out one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvctl.store.sortedchunks import SortedChunks

DEFAULT_ALIGNMENT_BYTES = 64
#: by-size keys pack ``length << _SHIFT | offset`` into one int (offsets below 2**64).
_SHIFT = 64
_MASK = (1 << _SHIFT) - 1


class AllocatorInvariantError(RuntimeError):
    """A free or reserve contradicts the allocator's state (a bug in the caller)."""


class ExtentAllocator:
    """Allocate and free byte ranges of a segment of ``capacity_bytes``.

    Args:
        capacity_bytes: size of the segment in bytes.
        alignment_bytes: every offset and allocated length is a multiple of this (power of 2).
    """

    def __init__(self, capacity_bytes: int, *, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
                 ) -> None:
        if capacity_bytes < 0 or alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError("capacity must be >= 0 and alignment a power of two")
        self.alignment_bytes = alignment_bytes
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment_bytes
        self.used_bytes = 0
        self._offsets: SortedChunks[int] = SortedChunks()
        self._lengths: dict[int, int] = {}
        self._by_size: SortedChunks[int] = SortedChunks()
        if self.capacity_bytes:
            self._insert(0, self.capacity_bytes)

    @classmethod
    def from_ranges(cls, capacity_bytes: int, ranges: Sequence[tuple[int, int]], *,
                    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
                    ) -> tuple[ExtentAllocator, list[int]]:
        """An allocator with each ``(offset, size_bytes)`` of ``ranges`` allocated, built in
        one pass (O(n log n) for n ranges in any order), and the indices of the ranges
        refused: outside the segment, misaligned, or overlapping one at a lower offset (of
        two overlapping ranges at the same offset, the one listed first is kept)."""
        alloc = cls(capacity_bytes, alignment_bytes=alignment_bytes)
        if not ranges:
            return alloc, []
        alloc._offsets.clear()
        alloc._lengths.clear()
        alloc._by_size.clear()
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        rejected: list[int] = []
        free: list[tuple[int, int]] = []
        pos = 0
        used = 0
        cap = alloc.capacity_bytes
        for i in order:
            offset, size = ranges[i]
            length = alloc.rounded(size)
            if offset < pos or offset % alignment_bytes or offset + length > cap:
                rejected.append(i)
                continue
            if offset > pos:
                free.append((pos, offset - pos))
            pos = offset + length
            used += length
        if pos < cap:
            free.append((pos, cap - pos))
        alloc.used_bytes = used
        alloc._offsets.update(off for off, _ in free)
        alloc._lengths.update(free)
        alloc._by_size.update(length << _SHIFT | off for off, length in free)
        rejected.sort()
        return alloc, rejected

    def rounded(self, size_bytes: int) -> int:
        """``size_bytes`` rounded up to the alignment (at least one alignment unit)."""
        a = self.alignment_bytes
        return max(a, (size_bytes + a - 1) & ~(a - 1))

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated."""
        return self.capacity_bytes - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """The largest single allocation that would succeed now, in bytes."""
        last = self._by_size.last()
        return 0 if last is None else last >> _SHIFT

    @property
    def free_extents(self) -> int:
        """How many free extents there are (fragmentation)."""
        return len(self._offsets)

    def extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(offset, length)`` in offset order (for tests and status)."""
        return [(o, self._lengths[o]) for o in self._offsets]

    def allocate(self, size_bytes: int) -> int | None:
        """Offset of a fresh range of ``rounded(size_bytes)`` bytes, or ``None`` when no free
        extent is large enough (the caller evicts and retries)."""
        need = self.rounded(size_bytes)
        packed = self._by_size.ge(need << _SHIFT)
        if packed is None:
            return None
        length, offset = packed >> _SHIFT, packed & _MASK
        self._remove(offset, length)
        if length > need:
            self._insert(offset + need, length - need)
        self.used_bytes += need
        return offset

    def free(self, offset: int, size_bytes: int) -> None:
        """Return ``rounded(size_bytes)`` bytes at ``offset``; merges with free neighbours.

        Raises:
            AllocatorInvariantError: the range overlaps a free extent or leaves the segment.
        """
        length = self.rounded(size_bytes)
        end = offset + length
        if offset < 0 or end > self.capacity_bytes or offset % self.alignment_bytes:
            raise AllocatorInvariantError(f"free of [{offset}, {end}) is outside the segment")
        prev_off = self._offsets.lt(offset)
        next_off = self._offsets.ge(offset)
        if prev_off is not None and prev_off + self._lengths[prev_off] > offset:
            raise AllocatorInvariantError(f"free of [{offset}, {end}) overlaps a free extent")
        if next_off is not None and next_off < end:
            raise AllocatorInvariantError(f"free of [{offset}, {end}) overlaps a free extent")
        self.used_bytes -= length
        start = offset
        if prev_off is not None and prev_off + self._lengths[prev_off] == offset:
            start = prev_off
            self._remove(prev_off, self._lengths[prev_off])
        if next_off is not None and next_off == end:
            end = next_off + self._lengths[next_off]
            self._remove(next_off, self._lengths[next_off])
        self._insert(start, end - start)

    def reserve(self, offset: int, size_bytes: int) -> None:
        """Mark ``rounded(size_bytes)`` bytes at ``offset`` as allocated.

        Raises:
            AllocatorInvariantError: the range is not entirely free.
        """
        length = self.rounded(size_bytes)
        ext_off = self._offsets.le(offset)
        if ext_off is None:
            raise AllocatorInvariantError(f"reserve of [{offset}, +{length}) is not free")
        ext_len = self._lengths[ext_off]
        if offset + length > ext_off + ext_len or offset % self.alignment_bytes:
            raise AllocatorInvariantError(f"reserve of [{offset}, +{length}) is not free")
        self._remove(ext_off, ext_len)
        if offset > ext_off:
            self._insert(ext_off, offset - ext_off)
        tail = ext_off + ext_len - (offset + length)
        if tail:
            self._insert(offset + length, tail)
        self.used_bytes += length

    def _insert(self, offset: int, length: int) -> None:
        self._offsets.add(offset)
        self._lengths[offset] = length
        self._by_size.add(length << _SHIFT | offset)

    def _remove(self, offset: int, length: int) -> None:
        self._offsets.remove(offset)
        del self._lengths[offset]
        self._by_size.remove(length << _SHIFT | offset)
