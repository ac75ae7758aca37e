"""The node's side of the shared tier: a ``shared`` task writes a DRAM range to a file.

The node checks the range against the object's checksum first (the DRAM copy may have
changed under the task: nothing is written then), writes the file as
:func:`~kvctl.store.sharedtier.fileformat.write_object` does (temporary name, fsync,
rename) at the master's path mapped to this host's mount, and reports. A refusal for
lack of space (``ENOSPC``, ``EDQUOT``) is reported as ``full``; every error's text starts
with its errno name, which the master counts.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.sharedtier.config import map_path
from kvctl.store.sharedtier.fileformat import errno_name, write_object

_log = logging.getLogger("kvctl.store.sharedtier")


class SharedWriter:
    """Carry out ``shared`` tasks.

    Args:
        path_map: ``(master prefix, local prefix)`` pairs (where this host mounts the
            tier, when not at the master's path).
        fsync: fsync each file before its rename (the default: a file another host reads
            must not lose its data to this host's crash).
    """

    def __init__(self, path_map: tuple[tuple[str, str], ...] = (), *, fsync: bool = True
                 ) -> None:
        self.path_map = path_map
        self.fsync = fsync
        self.written = 0

    def run(self, task: p.Task, view_of: Callable[[int, int], memoryview], epoch: str
            ) -> p.TaskReport:
        """Write ``task``'s range (``view_of(offset, size)``) to its file; the report."""
        try:
            view = view_of(task.offset, task.size)
        except KvctlError as exc:
            return p.TaskReport(task_id=task.task_id, ok=False, error=f"EINVAL: {exc.cause}")
        if checksum(view) != task.checksum:
            return p.TaskReport(task_id=task.task_id, ok=False,
                                error=f"CHANGED: the DRAM copy of {task.key!r} changed before "
                                "it was written (overwritten or removed)")
        path = map_path(task.path, self.path_map)
        try:
            write_object(path, task.key, task.version, view, task.checksum, epoch,
                         fsync=self.fsync)
        except OSError as exc:
            name = errno_name(exc)
            text = f"{name}: shared-tier write of {task.key!r} to {path}: {exc.strerror or exc}"
            _log.warning("%s", text)
            return p.TaskReport(task_id=task.task_id, ok=False, error=text,
                                full=exc.errno in (errno.ENOSPC, errno.EDQUOT))
        self.written += 1
        return p.TaskReport(task_id=task.task_id, ok=True)
