"""Words for people: counts with the noun in the right number ("1 object", "2 objects").

Library and CLI both use it (it imports nothing of kvctl's).
"""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` with thousands separators and ``noun`` (singular for exactly 1, else ``nouns``,
    default ``noun + "s"``): ``plural(1, "object")`` is ``"1 object"``, ``plural(2, "entry",
    "entries")`` is ``"2 entries"``."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
