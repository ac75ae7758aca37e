"""The client's side of the shared tier: read an object's file directly, verified.

A get whose answer names a shared-tier file and no DRAM location (or whose DRAM reads all
failed: the node just died) opens the file at the master's path mapped to this host's
mount, checks its header against the answer (key, size, checksum, version) and its bytes
against the checksum. Anything else is a miss (:class:`ObjectNotFoundError`, evicted):
never served.
"""

from __future__ import annotations

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.sharedtier.config import map_path
from kvctl.store.sharedtier.fileformat import SharedMissError, read_bytes, read_into


class SharedReader:
    """Read shared-tier files named in get answers.

    Args:
        path_map: ``(master prefix, local prefix)`` pairs (where this host mounts the
            tier, when not at the master's path).
    """

    def __init__(self, path_map: tuple[tuple[str, str], ...] = ()) -> None:
        self.path_map = path_map
        #: reads served / misses (torn, missing, mismatched files)
        self.reads = 0
        self.misses = 0

    def read(self, key: str, slot: p.GetSlot, dest: memoryview | None
             ) -> bytes | int | KvctlError:
        """``slot``'s object: its bytes, or the size once in ``dest``; a miss as an error
        naming why (``key``: as the caller named it)."""
        path = map_path(slot.shared, self.path_map)
        try:
            if dest is None:
                data = read_bytes(path, slot.key, slot.version, slot.checksum, slot.size)
                self.reads += 1
                return data
            read_into(path, slot.key, slot.version, slot.checksum, dest[:slot.size])
        except SharedMissError as exc:
            self.misses += 1
            return ObjectNotFoundError(key, evicted=True, why=exc.cause.replace(
                repr(slot.key), "its copy"))
        self.reads += 1
        return slot.size
