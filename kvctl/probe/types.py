"""Values shared by every probe source."""

from __future__ import annotations

import dataclasses

from kvctl.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Unavailable:
    """A source that could not answer, and why (``"unavailable: <reason>"`` in output).

    Attributes:
        source: ``"sysfs"``, ``"nvml"`` or ``"verbs"``.
        reason: one sentence naming what is missing.
        hint: how to make the source available, or ``None``.
    """

    source: str
    reason: str
    hint: str | None = None

    def __str__(self) -> str:
        return f"unavailable: {self.reason}"


def normalize_bdf(text: str) -> str:
    """A PCI address in sysfs spelling: ``00000000:18:00.0`` → ``0000:18:00.0`` (lower case).

    Raises:
        UsageError: ``text`` is not a PCI address.
    """
    value = text.strip().lower()
    domain, sep, rest = value.rpartition(":")
    if not sep:
        raise UsageError(f"{text!r} is not a PCI address", "write DOMAIN:BUS:DEV.FN")
    dom, sep2, bus = domain.rpartition(":")
    if not sep2:
        dom, bus = "0", domain
    dev, _, fn = rest.partition(".")
    try:
        return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"
    except ValueError:
        raise UsageError(f"{text!r} is not a PCI address", "write DOMAIN:BUS:DEV.FN") from None


def is_bdf(name: str) -> bool:
    """Whether ``name`` is a sysfs PCI function directory name (``0000:18:00.0``).

    The domain has 4 hex digits, or up to 8 where the kernel numbers domains past 0xffff
    (Intel VMD puts its devices in ``10000:e1:00.0``).
    """
    parts = name.split(":")
    if len(parts) != 3 or not 4 <= len(parts[0]) <= 8 or len(parts[1]) != 2:
        return False
    dev, dot, fn = parts[2].partition(".")
    if not dot or len(dev) != 2 or len(fn) != 1:
        return False
    try:
        int(parts[0], 16)
        int(parts[1], 16)
        int(dev, 16)
        int(fn, 16)
    except ValueError:
        return False
    return True
