"""The node's side of the shared tier: a ``shared`` task writes a DRAM range to a file.

The write runs on the writer's own thread, never on the node's heartbeat loop: a file
system that stalls (a distributed one under load, an fsync that takes seconds) must not
make the master judge the node dead. :meth:`SharedWriter.run` waits a little for the
write; one not done by then is reported ``pending`` (the master keeps the task in flight)
and its real report goes with a later heartbeat (:meth:`SharedWriter.finished`).

The node checks the range against the object's checksum before and after writing it (the
DRAM copy may change under a write-through copy: the file is then removed and nothing is
recorded), writes the file as :func:`~kvctl.store.sharedtier.fileformat.write_object` does
(temporary name, fsync, rename) at the master's path mapped to this host's mount, and
reports. A refusal for lack of space (``ENOSPC``, ``EDQUOT``) is reported as ``full``;
every error's text starts with its errno name, which the master counts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Callable

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.checksum import checksum
from kvctl.store.sharedtier.config import TIER_MARKER, map_path
from kvctl.store.sharedtier.fileformat import errno_name, write_object, write_pack
from kvctl.store.taskthread import WAIT_S, TaskThread

_log = logging.getLogger("kvctl.store.sharedtier")

class SharedWriter:
    """Carry out ``shared`` tasks on a thread of their own (a :class:`TaskThread`).

    Args:
        path_map: ``(master prefix, local prefix)`` pairs (where this host mounts the
            tier, when not at the master's path).
        fsync: fsync each file before its rename (the default: a file another host reads
            must not lose its data to this host's crash).
        wait_s: how long :meth:`run` waits for a write before reporting it pending.
    """

    def __init__(self, path_map: tuple[tuple[str, str], ...] = (), *, fsync: bool = True,
                 wait_s: float = WAIT_S) -> None:
        self.path_map = path_map
        self.fsync = fsync
        self.written = 0
        self._tasks = TaskThread("kvctl-shared-writer", wait_s=wait_s)

    @property
    def wait_s(self) -> float:
        """How long :meth:`run` waits for a write before reporting it pending."""
        return self._tasks.wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self._tasks.wait_s = value

    def run(self, task: p.Task, view_of: Callable[[int, int], memoryview], epoch: str
            ) -> p.TaskReport:
        """Write ``task``'s range (``view_of(offset, size)``; a ``pack`` task: each entry's)
        to its file; its report, or a ``pending`` one when the write takes longer than
        ``wait_s``."""
        try:
            views = ([view_of(e.offset, e.size) for e in task.entries] if task.op == "pack"
                     else [view_of(task.offset, task.size)])
        except KvctlError as exc:
            return p.TaskReport(task_id=task.task_id, ok=False, error=f"EINVAL: {exc.cause}")
        if task.op == "pack":
            return self._tasks.run(task.task_id, lambda: self._write_pack(task, views, epoch))
        return self._tasks.run(task.task_id, lambda: self._write(task, views[0], epoch))

    def finished(self) -> list[p.TaskReport]:
        """Reports of writes that were pending and have ended since the last call."""
        return self._tasks.finished()

    def unreported(self) -> list[int]:
        """Task ids reported ``pending`` whose real report :meth:`finished` has not handed
        out yet (running, or ended since its last call)."""
        return self._tasks.unreported()

    def _write(self, task: p.Task, view: memoryview, epoch: str) -> p.TaskReport:
        changed = p.TaskReport(task_id=task.task_id, ok=False,
                               error=f"CHANGED: the DRAM copy of {task.key!r} changed before "
                               "it was written (overwritten or removed)")
        if checksum(view) != task.checksum:
            return changed
        path = map_path(task.path, self.path_map)
        try:
            write_object(path, task.key, task.version, view, task.checksum, epoch,
                         fsync=self.fsync, marker=TIER_MARKER)
        except OSError as exc:
            name = errno_name(exc)
            text = f"{name}: shared-tier write of {task.key!r} to {path}: {exc.strerror or exc}"
            _log.warning("%s", text)
            return p.TaskReport(task_id=task.task_id, ok=False, error=text,
                                full=exc.errno in (errno.ENOSPC, errno.EDQUOT))
        if checksum(view) != task.checksum:  # changed while it was written: not this object
            with contextlib.suppress(OSError):
                path.unlink()
            return changed
        self.written += 1
        return p.TaskReport(task_id=task.task_id, ok=True)

    def _write_pack(self, task: p.Task, views: list[memoryview], epoch: str) -> p.TaskReport:
        """A ``pack`` task: the entries whose DRAM still holds their object, as records of
        one file (one fsync, one rename); the others are reported ``failed`` (their place
        stays zeros, which no reader takes for a record)."""
        entries = task.entries
        good = [i for i, e in enumerate(entries) if checksum(views[i]) == e.checksum]
        if not good:
            return p.TaskReport(task_id=task.task_id, ok=False,
                                error="CHANGED: the DRAM copies of a pack's objects changed "
                                "before they were written")
        path = map_path(task.path, self.path_map)
        try:
            write_pack(path, [(entries[i].key, entries[i].version, entries[i].checksum,
                               entries[i].at, views[i]) for i in good], epoch,
                       fsync=self.fsync, marker=TIER_MARKER)
        except OSError as exc:
            name = errno_name(exc)
            text = (f"{name}: shared-tier write of a pack of {len(good)} objects to {path}: "
                    f"{exc.strerror or exc}")
            _log.warning("%s", text)
            return p.TaskReport(task_id=task.task_id, ok=False, error=text,
                                full=exc.errno in (errno.ENOSPC, errno.EDQUOT))
        # changed while written: those records are not their objects
        kept = {i for i in good if checksum(views[i]) == entries[i].checksum}
        self.written += 1
        return p.TaskReport(task_id=task.task_id, ok=True,
                            failed=[i for i in range(len(entries)) if i not in kept])
