"""Reading the XML files operators already have (hwloc, NCCL), safely and with limits.

Both formats come from tools run on the host (``lstopo --of xml``, ``NCCL_TOPO_DUMP_FILE``)
and are plain element trees: no entities, no external DTD. Documents that declare entities
are refused, the size is bounded, and Python's expat neither fetches external entities nor
lets internal ones expand past its amplification limit.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from kvctl.errors import UsageError

#: Largest topology XML read (a 4-socket host's hwloc XML with every PU is ~2 MiB).
MAX_XML_BYTES = 64 << 20
_FIRST_ELEMENT = re.compile(rb"<([A-Za-z_][\w.-]*)")
_SKIP = re.compile(rb"<\?.*?\?>|<!--.*?-->|<!DOCTYPE[^\[>]*(?:\[.*?\])?\s*>", re.DOTALL)


def read_bytes(path: Path, what: str, hint: str) -> bytes:
    """The bytes of ``path``, bounded by :data:`MAX_XML_BYTES`.

    Raises:
        UsageError: missing, unreadable or too large.
    """
    try:
        size = path.stat().st_size
        if size > MAX_XML_BYTES:
            raise UsageError(f"{what} {path} is {size} bytes; a topology file is at most "
                             f"{MAX_XML_BYTES >> 20} MiB", hint)
        return path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist", hint) from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}", hint) from exc


def root_element_name(data: bytes) -> str | None:
    """The name of the document element of XML ``data`` (``topology``, ``system``), or
    ``None`` when ``data`` does not start like XML."""
    head = _SKIP.sub(b"", data[: 1 << 16].lstrip(b"\xef\xbb\xbf \t\r\n"))
    head = head.lstrip()
    match = _FIRST_ELEMENT.match(head)
    return match.group(1).decode("ascii") if match else None


def parse(data: bytes, path: Path, what: str, hint: str) -> ET.Element:
    """Parse ``data`` (read from ``path``) into its document element.

    Raises:
        UsageError: not well-formed, or it declares entities.
    """
    if b"<!ENTITY" in data:
        raise UsageError(f"{what} {path} declares XML entities, which no {what} has",
                         hint)
    try:
        # expat fetches no external entity and caps entity amplification; the file is
        # the operator's own tool output, bounded in size and entity-free (checked above)
        return ET.fromstring(data)  # noqa: S314
    except ET.ParseError as exc:
        raise UsageError(f"{what} {path} is not well-formed XML ({exc})", hint) from exc


def cpulist(cpus: list[int]) -> str | None:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (the kernel's ``cpulist`` spelling); ``None`` if empty."""
    out: list[tuple[int, int]] = []
    for cpu in sorted(set(cpus)):
        if out and out[-1][1] == cpu - 1:
            out[-1] = (out[-1][0], cpu)
        else:
            out.append((cpu, cpu))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) or None


def mask_bits(text: str) -> list[int]:
    """Set bits of a CPU/NUMA mask written as comma-separated 32-bit hex words, most
    significant first (hwloc ``0x000000ff,0xffff0000,,0x1`` where an empty word is 0; NCCL
    ``000000ff,ffff0000``).

    Raises:
        ValueError: a word is not hexadecimal.
    """
    words = [int(w, 16) if w else 0 for w in text.strip().replace("0x", "").split(",")]
    bits: list[int] = []
    for i, word in enumerate(reversed(words)):
        bits += [i * 32 + b for b in range(32) if word >> b & 1]
    return bits
