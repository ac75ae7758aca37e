"""A sorted sequence that the cyclic garbage collector never walks.

The store master keeps millions of keys (and an allocator millions of free-extent keys) in
sorted order. ``sortedcontainers.SortedList`` holds them in lists, and every full garbage
collection visits every element of every list: about 20 ms per million keys, paid again at
each full collection. :class:`SortedChunks` keeps the same values in *tuples* of at most
:data:`MAX_CHUNK` elements (a tuple of strings or ints is untracked by the collector after
its first young collection), plus one list of the chunks and one of their maxima (a few
thousand entries at 10^7 values). An insert or remove rebuilds one chunk: O(chunk) copying,
O(log n) search.

Values must be totally ordered and immutable (strings, ints); duplicates are allowed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


T = TypeVar("T", bound=_Ordered)

#: Chunk sizes: split past MAX_CHUNK, merge with a neighbour below MIN_CHUNK.
MAX_CHUNK = 512
MIN_CHUNK = 64


class SortedChunks(Generic[T]):
    """Sorted values in tuples of at most :data:`MAX_CHUNK` (not thread-safe)."""

    def __init__(self, values: Iterable[T] = ()) -> None:
        self._chunks: list[tuple[T, ...]] = []
        self._maxes: list[T] = []
        self._len = 0
        self.update(values)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        for chunk in list(self._chunks):
            yield from chunk

    def __contains__(self, value: object) -> bool:
        v: T = value  # type: ignore[assignment]
        i = bisect_left(self._maxes, v)
        if i == len(self._maxes):
            return False
        chunk = self._chunks[i]
        j = bisect_left(chunk, v)
        return j < len(chunk) and chunk[j] == v

    def clear(self) -> None:
        self._chunks.clear()
        self._maxes.clear()
        self._len = 0

    def update(self, values: Iterable[T]) -> None:
        """Add many values (one sort of everything)."""
        new = list(values)
        if not new:
            return
        if self._len:
            new.extend(self)
        new.sort()
        half = MAX_CHUNK // 2
        self._chunks = [tuple(new[i:i + half]) for i in range(0, len(new), half)]
        self._maxes = [chunk[-1] for chunk in self._chunks]
        self._len = len(new)

    def add(self, value: T) -> None:
        chunks, maxes = self._chunks, self._maxes
        self._len += 1
        if not chunks:
            chunks.append((value,))
            maxes.append(value)
            return
        i = bisect_right(maxes, value)
        if i == len(maxes):
            i -= 1
        chunk = chunks[i]
        j = bisect_right(chunk, value)
        chunk = (*chunk[:j], value, *chunk[j:])
        if len(chunk) > MAX_CHUNK:
            half = len(chunk) // 2
            chunks[i:i + 1] = [chunk[:half], chunk[half:]]
            maxes[i:i + 1] = [chunk[half - 1], chunk[-1]]
        else:
            chunks[i] = chunk
            maxes[i] = chunk[-1]

    def remove(self, value: T) -> None:
        """Remove one occurrence of ``value``.

        Raises:
            ValueError: ``value`` is not there.
        """
        chunks, maxes = self._chunks, self._maxes
        i = bisect_left(maxes, value)
        if i == len(maxes):
            raise ValueError(f"{value!r} is not in the sequence")
        chunk = chunks[i]
        j = bisect_left(chunk, value)
        if j == len(chunk) or chunk[j] != value:
            raise ValueError(f"{value!r} is not in the sequence")
        self._len -= 1
        chunk = chunk[:j] + chunk[j + 1:]
        if not chunk:
            del chunks[i], maxes[i]
            return
        chunks[i] = chunk
        maxes[i] = chunk[-1]
        if len(chunk) < MIN_CHUNK and len(chunks) > 1:
            k = i if i + 1 < len(chunks) else i - 1  # merge chunks k and k + 1
            merged = chunks[k] + chunks[k + 1]
            if len(merged) > MAX_CHUNK:
                half = len(merged) // 2
                chunks[k:k + 2] = [merged[:half], merged[half:]]
                maxes[k:k + 2] = [merged[half - 1], merged[-1]]
            else:
                chunks[k:k + 2] = [merged]
                maxes[k:k + 2] = [merged[-1]]

    def discard(self, value: T) -> bool:
        """Remove one occurrence of ``value`` if there; whether it was."""
        try:
            self.remove(value)
        except ValueError:
            return False
        return True

    def first(self) -> T | None:
        return self._chunks[0][0] if self._chunks else None

    def last(self) -> T | None:
        return self._maxes[-1] if self._maxes else None

    def ge(self, value: T) -> T | None:
        """The smallest value ``>= value``, or ``None``."""
        i = bisect_left(self._maxes, value)
        if i == len(self._maxes):
            return None
        chunk = self._chunks[i]
        return chunk[bisect_left(chunk, value)]

    def gt(self, value: T) -> T | None:
        """The smallest value ``> value``, or ``None``."""
        i = bisect_right(self._maxes, value)
        if i == len(self._maxes):
            return None
        chunk = self._chunks[i]
        return chunk[bisect_right(chunk, value)]

    def lt(self, value: T) -> T | None:
        """The largest value ``< value``, or ``None``."""
        i = bisect_left(self._maxes, value)
        if i < len(self._maxes):
            chunk = self._chunks[i]
            j = bisect_left(chunk, value)
            if j:
                return chunk[j - 1]
        return self._maxes[i - 1] if i else None

    def le(self, value: T) -> T | None:
        """The largest value ``<= value``, or ``None``."""
        i = bisect_right(self._maxes, value)
        if i < len(self._maxes):
            chunk = self._chunks[i]
            j = bisect_right(chunk, value)
            if j:
                return chunk[j - 1]
        return self._maxes[i - 1] if i else None

    def iter_from(self, value: T, *, inclusive: bool = True) -> Iterator[T]:
        """Values ``>= value`` (``> value`` unless ``inclusive``) in order. The sequence must
        not change while the iterator is in use."""
        maxes = self._maxes
        find = bisect_left if inclusive else bisect_right
        i = find(maxes, value)
        if i == len(maxes):
            return
        chunks = self._chunks
        chunk = chunks[i]
        yield from chunk[find(chunk, value):]
        for k in range(i + 1, len(chunks)):
            yield from chunks[k]
