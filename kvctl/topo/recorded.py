"""``kvctl topo --from FILE``: a kvctl snapshot, an hwloc XML or an NCCL topology, told
apart by content (never by file name).

- a gzip stream is a snapshot (:mod:`kvctl.topo.snapshot`);
- an XML document whose element is ``<topology>`` is an hwloc XML (:mod:`kvctl.topo.hwloc`);
- one whose element is ``<system>`` is an NCCL topology dump or file (:mod:`kvctl.topo.nccl`).

Each becomes the same :class:`~kvctl.topo.model.Topology` a live host gives; what the file
does not record is a source marked unavailable, with the reason.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.probe.types import Unavailable
from kvctl.topo import hwloc, nccl, xmlfile
from kvctl.topo.build import build_topology, discover
from kvctl.topo.model import SourceStatus, Topology
from kvctl.topo.snapshot import open_snapshot

_GZIP_MAGIC = b"\x1f\x8b"
_HINT = ("give a file written by kvctl topo snapshot, lstopo --of xml, or NCCL "
         "(NCCL_TOPO_DUMP_FILE)")


class RecordedFormat(enum.StrEnum):
    """What ``--from`` can read."""

    SNAPSHOT = "snapshot"
    HWLOC = "hwloc XML"
    NCCL = "NCCL topology"


def detect_format(path: Path) -> RecordedFormat:
    """Which format ``path`` holds, from its first bytes.

    Raises:
        UsageError: missing, unreadable, or none of the three formats.
    """
    try:
        with path.open("rb") as fh:
            head = fh.read(1 << 16)
    except FileNotFoundError:
        raise UsageError(f"snapshot {path} does not exist", _HINT) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", _HINT) from exc
    if head.startswith(_GZIP_MAGIC):
        return RecordedFormat.SNAPSHOT
    name = xmlfile.root_element_name(head)
    if name is not None and hwloc.is_hwloc(name):
        return RecordedFormat.HWLOC
    if name is not None and nccl.is_nccl(name):
        return RecordedFormat.NCCL
    if name == "graphs":
        raise UsageError(f"{path} is an NCCL graph dump (NCCL_GRAPH_DUMP_FILE), not a "
                         "topology", "dump the topology with NCCL_TOPO_DUMP_FILE instead")
    what = f"an XML document <{name}>" if name else "neither gzip nor XML"
    raise UsageError(f"snapshot {path} is not a readable kvctl topo snapshot, hwloc XML or "
                     f"NCCL topology ({what})", _HINT)


def load_recorded(path: Path) -> Topology:
    """The topology recorded in ``path`` (any format :func:`detect_format` knows).

    Raises:
        UsageError: unreadable, unknown format, damaged.
    """
    fmt = detect_format(path)
    if fmt is RecordedFormat.SNAPSHOT:
        with open_snapshot(path) as snap:
            return discover(snap.reader, snap.nvml, snap.verbs, label=f"snapshot {path}")
    hint = hwloc.HINT if fmt is RecordedFormat.HWLOC else nccl.HINT
    data = xmlfile.read_bytes(path, fmt.value, hint)
    root = xmlfile.parse(data, path, fmt.value, hint)
    no_verbs = Unavailable("verbs", f"{fmt.value} {path} holds no verbs facts (RDMA MTU, "
                           "lanes, GIDs)", "record the host with kvctl topo snapshot")
    if fmt is RecordedFormat.HWLOC:
        facts = hwloc.hwloc_facts(root)
        label = hwloc.describe(path, root)
        topology = build_topology(
            facts, Unavailable("nvml", f"hwloc XML {path} holds no NVML facts (GPU names, "
                               "NVLinks)", "record the host with kvctl topo snapshot"),
            no_verbs, sysfs_label=label)
        nvml_status = None
    else:
        facts, links = nccl.nccl_facts(root)
        label = nccl.describe(path, root)
        topology = build_topology(facts, links, no_verbs, sysfs_label=label)
        nvml_status = SourceStatus(
            "nvml", True, f"NVLinks of {len(links.gpus)} GPU(s) from {label} (NCCL asks "
            "NVML for them)")
    sources = tuple(nvml_status if s.name == "nvml" and nvml_status is not None else s
                    for s in topology.sources)
    return dataclasses.replace(topology, sources=sources)
