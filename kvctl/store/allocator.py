"""Space allocation inside one node segment: best-fit over free extents with coalescing.

Two sorted views of the free extents are kept: by offset (to merge neighbours on free) and
by ``(length, offset)`` (to find the smallest extent that fits in ``O(log n)``). Every
allocation is rounded up to :attr:`ExtentAllocator.alignment_bytes`.
"""

from __future__ import annotations

import bisect

DEFAULT_ALIGNMENT_BYTES = 64


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
        self._offsets: list[int] = []
        self._lengths: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        if self.capacity_bytes:
            self._insert(0, self.capacity_bytes)

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
        return self._by_size[-1][0] if self._by_size else 0

    def extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(offset, length)`` in offset order (for tests and status)."""
        return [(o, self._lengths[o]) for o in self._offsets]

    def allocate(self, size_bytes: int) -> int | None:
        """Offset of a fresh range of ``rounded(size_bytes)`` bytes, or ``None`` when no free
        extent is large enough (the caller evicts and retries)."""
        need = self.rounded(size_bytes)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        length, offset = self._by_size[i]
        self._remove(offset, length, size_index=i)
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
        i = bisect.bisect_left(self._offsets, offset)
        prev_off = self._offsets[i - 1] if i > 0 else None
        next_off = self._offsets[i] if i < len(self._offsets) else None
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
        """Mark ``rounded(size_bytes)`` bytes at ``offset`` as allocated (state rebuild).

        Raises:
            AllocatorInvariantError: the range is not entirely free.
        """
        length = self.rounded(size_bytes)
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0:
            raise AllocatorInvariantError(f"reserve of [{offset}, +{length}) is not free")
        ext_off = self._offsets[i]
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
        bisect.insort(self._offsets, offset)
        self._lengths[offset] = length
        bisect.insort(self._by_size, (length, offset))

    def _remove(self, offset: int, length: int, *, size_index: int | None = None) -> None:
        del self._offsets[bisect.bisect_left(self._offsets, offset)]
        del self._lengths[offset]
        if size_index is None:
            size_index = bisect.bisect_left(self._by_size, (length, offset))
        del self._by_size[size_index]
