"""Reading and cleaning what is published about segments (used by the engine and the CLI)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.metadata import MetadataClient, key_prefix
from kvctl.transfer.errors import SegmentNotFoundError
from kvctl.transfer.segments import SHM_DIR, SegmentInfo, host_id
from kvctl.transfer.shmfiles import delete_if_unowned, pid_alive

_log = logging.getLogger("kvctl.transfer")


def segment_key(cluster_id: str, name: str) -> str:
    """Metadata key of segment ``name``: ``<prefix>segments/<name>``.

    Raises:
        UsageError: the name or cluster id is not UTF-8 text (a lone surrogate, as
            ``os.fsdecode`` makes of bytes that are not UTF-8), so no backend can store it.
    """
    key = f"{key_prefix(cluster_id)}segments/{name}"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"segment name {name!r} (cluster {cluster_id!r}) is not valid UTF-8",
                         "names are UTF-8 text: check the bytes (or the shell's locale)"
                         ) from None
    return key


def list_segments(metadata: MetadataClient, cluster_id: str = "") -> list[SegmentInfo]:
    """Every segment descriptor published under ``<prefix>segments/``, by name.

    Entries that do not decode are skipped with a warning (``kvctl segment rm`` removes them).
    """
    prefix = f"{key_prefix(cluster_id)}segments/"
    out: list[SegmentInfo] = []
    for key, raw in sorted(metadata.list(prefix).items()):
        try:
            out.append(SegmentInfo.from_json(raw, source=key))
        except UsageError as exc:
            _log.warning("%s", exc.cause)
    return out


def lookup_segment(metadata: MetadataClient, cluster_id: str, name: str, *,
                   token: str | None = None) -> SegmentInfo:
    """The descriptor published for ``name``; with ``token``, only one signed with it.

    Raises:
        SegmentNotFoundError: nothing is published under that name.
        UsageError: the entry is not a valid descriptor.
        DescriptorAuthError: ``token`` is set and the entry is not signed with it.
    """
    key = segment_key(cluster_id, name)
    raw = metadata.get(key)
    if raw is None:
        raise SegmentNotFoundError(
            f"segment {name!r} is not published in {metadata.url}",
            "check the name with 'kvctl segment list' and that its process is running")
    return SegmentInfo.from_json(raw, source=key, token=token)


@dataclasses.dataclass(frozen=True)
class RemovedSegment:
    """What ``remove_segment`` did.

    Attributes:
        name: the segment.
        key: the metadata key deleted.
        files_removed: stale ``/dev/shm`` files of a dead same-host owner that were deleted.
    """

    name: str
    key: str
    files_removed: tuple[str, ...]


def remove_segment(metadata: MetadataClient, cluster_id: str, name: str) -> RemovedSegment:
    """Delete a (stale) segment entry; on its host, also its shm file if the owner is dead.

    Raises:
        SegmentNotFoundError: nothing is published under that name.
    """
    key = segment_key(cluster_id, name)
    raw = metadata.get(key)
    if raw is None:
        raise SegmentNotFoundError(f"segment {name!r} is not published in {metadata.url}",
                                   "nothing to remove; see 'kvctl segment list'")
    removed: list[str] = []
    try:
        info: SegmentInfo | None = SegmentInfo.from_json(raw, source=key)
    except UsageError:
        info = None  # a corrupt entry: delete it all the same
    if info is not None and info.host == host_id() and not pid_alive(info.pid):
        for buf in info.buffers:
            path = Path(buf.path) if buf.path else None
            if (path is not None and path.parent == SHM_DIR and path.name.startswith("kvctl-")
                    and str(path) not in removed and delete_if_unowned(path) is not None):
                removed.append(str(path))
    metadata.delete(key)
    return RemovedSegment(name, key, tuple(removed))
