"""Settings of ``kvctl topo`` and the sources they select (live host, tree, snapshot)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kvctl.config import register_section
from kvctl.errors import UsageError
from kvctl.probe.nvml import NvmlBackend, PynvmlBackend, RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import PyverbsBackend, RecordedVerbs, VerbsBackend
from kvctl.topo.build import discover
from kvctl.topo.model import Topology
from kvctl.topo.recorded import load_recorded


@register_section("topo")
@dataclasses.dataclass(frozen=True)
class TopoSettings:
    """Settings of ``kvctl topo`` (section ``topo``, variables ``KVCTL_TOPO_*``).

    Attributes:
        sysfs_root: directory that plays ``/`` for sysfs (``/`` is the live host; a
            recorded tree elsewhere). NVML and verbs are only asked when it is ``/``.
        nvml: ask NVML (pynvml) for GPU details.
        verbs: ask libibverbs (pyverbs) for RDMA port details.
    """

    sysfs_root: Path = Path("/")
    nvml: bool = True
    verbs: bool = True


@dataclasses.dataclass(frozen=True)
class Sources:
    """The three sources topo reads."""

    reader: SysfsReader
    nvml: NvmlBackend
    verbs: VerbsBackend


def live_sources(settings: TopoSettings) -> Sources:
    """Sources for ``settings``: sysfs under ``sysfs_root``, NVML and verbs when it is ``/``.

    Raises:
        UsageError: ``sysfs_root`` is not a directory.
    """
    root = settings.sysfs_root
    if not root.is_dir():
        raise UsageError(f"--sysfs-root {root} is not a directory",
                         "give / (this host) or the root of a recorded tree")
    reader = SysfsReader(root)
    tree = not reader.is_live
    nvml: NvmlBackend
    verbs: VerbsBackend
    if tree:
        why = f"sysfs root is {root}, a recorded tree: live NVML describes this host, not it"
        nvml = RecordedNvml(Unavailable("nvml", why, "record NVML with kvctl topo snapshot"))
    elif not settings.nvml:
        nvml = RecordedNvml(Unavailable("nvml", "disabled by setting topo.nvml", None))
    else:
        nvml = PynvmlBackend()
    if tree:
        why = f"sysfs root is {root}, a recorded tree: live verbs describes this host, not it"
        verbs = RecordedVerbs(Unavailable("verbs", why, "record verbs with kvctl topo snapshot"))
    elif not settings.verbs:
        verbs = RecordedVerbs(Unavailable("verbs", "disabled by setting topo.verbs", None))
    else:
        verbs = PyverbsBackend()
    return Sources(reader, nvml, verbs)


def load_topology(settings: TopoSettings, snapshot: Path | None = None) -> Topology:
    """The topology of the live host / tree named by ``settings``, or of the file
    ``snapshot``: a kvctl snapshot, an hwloc XML or an NCCL topology
    (:func:`~kvctl.topo.recorded.load_recorded`).

    Raises:
        UsageError: bad ``sysfs_root`` or a damaged or unknown file.
    """
    if snapshot is not None:
        return load_recorded(snapshot)
    sources = live_sources(settings)
    try:
        # the live host's GPUs are numbered as this process's CUDA numbers them
        return discover(sources.reader, sources.nvml, sources.verbs,
                        cuda_env=os.environ if sources.reader.is_live else None)
    finally:
        sources.nvml.close()
