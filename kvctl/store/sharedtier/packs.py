"""Pack files: small objects written to the shared tier several to a file.

A file per object costs an fsync, a rename and a name on the distributed file system per
object; below some size that is most of the write (a 5 ms fsync against 16 KiB of data)
and of the read (an open and a lookup per object). With ``pack_below`` set, the master
gathers the small copies it would ask one node to write before that node's next heartbeat
(write-through copies of a stream of puts, the write-backs of one eviction slice) into one
``pack`` task, up to ``pack_max_bytes`` / ``pack_max_entries``: the node writes one file
of records in the single-file format at offsets the master chose
(:func:`~kvctl.store.sharedtier.fileformat.write_pack`), fsyncs it once and renames it.

Rules (tests/store/test_shared_tier_packs.py, tests/multihost/test_shared_tier_packs.py):

- A packed copy is ``Obj.shared`` (its use stamp, as any copy) plus ``Obj.pack``, the
  pack's id and the record's offset in one int (:func:`pack_ref`); the record of the
  object in the state carries both, so a master restart rebuilds the table of packs
  (:class:`Pack`: file, bytes, live entries) from the objects.
- A get names the pack file and the offset (``GetSlot.shared_at``); the client reads the
  record there and checks it as a single file (a torn, flipped or missing record is a miss
  and is reported, the master checks that record alone).
- An entry dies with its copy (overwrite, remove, a bad record, quota); the pack's file is
  deleted when its last live entry dies, once that change is durable.
- Quota: the pack's bytes and one file count; when the least recently used copy of the
  tier is a packed one, its whole pack goes (objects also in DRAM stay there).
- A pack whose node is dropped before its report leaves the table; a file renamed by then
  is an orphan, and the sweep purges packs no table names (``pk/<id>.kvp``) as it does
  single files.
- Entries whose DRAM changed before they were written are reported ``failed`` and
  recorded nowhere; a pack with none written is not a file.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.store import protocol as p
from kvctl.store.master.base import MasterBase
from kvctl.store.master.records import Node, Obj
from kvctl.store.sharedtier.fileformat import (
    PACK_DIR,
    PACK_NAME_RE,
    entry_span,
    file_bytes,
    pack_bytes,
    pack_name,
)

if TYPE_CHECKING:
    from kvctl.store.sharedtier.housekeeping import SharedState

_log = logging.getLogger("kvctl.store.master")

#: ``Obj.pack`` is ``pack id << AT_BITS | offset`` (a pack is smaller than 1 << AT_BITS).
AT_BITS = 24
AT_MASK = (1 << AT_BITS) - 1
#: past this a pack's ``Obj.pack`` would not fit an int64 (a name such as
#: ``pk/ffffffffffffffff.kvp`` found on the tier is not taken for one of ours)
MAX_PACK_ID = (1 << (63 - AT_BITS)) - 1


def highest_pack_on_disk(root: Path) -> int:
    """The highest pack id named in ``root/pk`` (0: none, or it cannot be read): a master
    starting gives ids past it, so no pack it asks for has the name of an orphan of the
    last run (a pack renamed but never recorded, waiting for the sweep)."""
    top = 0
    try:
        with os.scandir(root / PACK_DIR) as entries:
            for entry in entries:
                match = PACK_NAME_RE.match(entry.name)
                if match is not None:
                    pack_id = int(match.group(1), 16)
                    if pack_id <= MAX_PACK_ID >> 1:  # leaves ids to give after it
                        top = max(top, pack_id)
    except OSError:
        return top
    return top


def pack_ref(pack_id: int, at: int) -> int:
    """``Obj.pack`` of the record at byte ``at`` of pack ``pack_id``."""
    return pack_id << AT_BITS | at


class Pack:
    """One pack file: what the master knows of it (lock held)."""

    __slots__ = ("counted", "due", "end", "keys", "landed", "live", "nbytes", "pack_id",
                 "path", "task")

    def __init__(self, pack_id: int, path: str, task: p.Task | None = None) -> None:
        self.pack_id = pack_id
        self.path = path
        #: the task writing it while it is being written (``None`` once landed)
        self.task = task
        #: keys of the entries it was recorded with (dead ones are those whose object's
        #: ``pack`` no longer names this pack)
        self.keys: list[str] = []
        self.live = 0
        #: bytes of the file, counted in the tier's usage once landed
        self.nbytes = 0
        #: where the next entry goes while being gathered
        self.end = 0
        self.landed = False
        #: it took one of its node's write-through queue slots
        self.counted = False
        #: the latest lease end of its dropped entries (the file outlives them)
        self.due = 0.0


class SharedPacks(MasterBase):
    """Gathering small shared-tier copies into packs, and the table of packs."""

    _shared: SharedState | None

    def _shared_quota(self, newest: Obj | None, now: float) -> None:
        raise NotImplementedError

    def _shared_packable(self, obj: Obj) -> bool:
        st = self._shared
        assert st is not None
        below = st.config.pack_below
        return bool(below) and 0 < obj.size < below

    def _shared_open_pack(self, node: Node, obj: Obj) -> Pack | None:
        """The pack being gathered for ``node`` that ``obj`` still fits in, if any."""
        st = self._shared
        assert st is not None
        pack: Pack | None = st.open_packs.get(node)
        if pack is None or pack.task is None:
            return None
        cfg = st.config
        task = pack.task
        if len(task.entries) >= cfg.pack_max_entries or (
                pack.end + entry_span(obj.key, obj.size) > cfg.pack_max_bytes):
            return None
        if not any(t is task for t in reversed(node.tasks)):
            return None  # sent already
        return pack

    def _shared_pack_entry(self, node: Node, obj: Obj, offset: int, *, free_after: bool
                           ) -> p.Task | None:
        """Add ``obj`` to ``node``'s pack being gathered (a new one when none has room);
        ``None`` when no pack may be started now (its name is being deleted)."""
        st = self._shared
        assert st is not None
        pack = self._shared_open_pack(node, obj)
        if pack is None:
            pack_id = st.new_pack_id()
            path = st.prefix + pack_name(pack_id)
            if not st.claim(path):
                return None
            task = p.Task(task_id=next(self._task_ids), op="pack", key="", version=pack_id,
                          offset=0, size=0, checksum=0, path=path)
            pack = Pack(pack_id, path, task)
            st.packs[pack_id] = pack
            st.open_packs[node] = pack
            node.tasks.append(task)
        assert pack.task is not None
        pack.task.entries.append(p.PackEntry(obj.key, obj.version, offset, obj.size,
                                             obj.checksum, pack.end, free_after))
        pack.end += entry_span(obj.key, obj.size)
        if free_after:
            self._cond.notify_all()
        return pack.task

    def _shared_pack_persisted(self, node: Node, task: p.Task, report: p.TaskReport,
                               now: float) -> None:
        """A node reports a ``pack`` task: each entry as a ``shared`` task's report would
        be, then the pack's file counted, or deleted when no entry of it lives."""
        st = self._shared
        assert st is not None
        pack: Pack | None = st.packs.get(task.version)
        if pack is None or pack.task is not task:
            pack = None  # left the table (its node was dropped meanwhile): nothing counts
        if st.open_packs.get(node) is pack:
            st.open_packs.pop(node, None)
        if pack is not None:
            pack.task = None
        failed = set(report.failed)
        written = [e for i, e in enumerate(task.entries) if i not in failed] if (
            report.ok) else []
        st.note_write(report, now)
        through_bytes = 0
        landed: Obj | None = None
        for i, e in enumerate(task.entries):
            ok = report.ok and i not in failed and pack is not None
            free_after = e.free_after
            if not free_after:
                through_bytes += e.size
                free_after = st.through_landed(e.key, task.task_id, node)
            if free_after:
                node.freeing_bytes = max(0, node.freeing_bytes - node.alloc.rounded(e.size))
            obj = self._index.get(e.key)
            if obj is None or obj.version != e.version:
                if free_after:  # removed while its write-back ran: free the DRAM now
                    node.alloc.free(e.offset, e.size)
                continue  # its record in the pack is dead from the start
            if ok and not obj.shared:
                assert pack is not None
                obj.shared = st.next_stamp()
                obj.pack = pack_ref(pack.pack_id, e.at)
                pack.keys.append(obj.key)
                pack.live += 1
                st.packed += 1
                st.track(obj, 0, files=0)
                landed = obj
            elif not ok and not report.ok:
                _log.warning("node %s could not write %r to the shared tier: %s",
                             node.node_id, obj.key, report.error)
            if free_after and self._write_back_done(obj, node, now):
                continue
            self._persist(obj)
        if any(not e.free_after for e in task.entries):
            count, nbytes = st.queued.get(node, (0, 0))
            st.queued[node] = (max(0, count - (1 if pack is None or pack.counted else 0)),
                               max(0, nbytes - through_bytes))
        if pack is None:
            return
        if not written:  # a failed write left no file (its temporary is removed), ...
            del st.packs[pack.pack_id]
            if report.ok:  # ... one whose every record changed while written is deleted
                st.unlink_later(pack.path, now)
            return
        last = written[-1]
        pack.nbytes = pack_bytes(last.at + file_bytes(last.key, last.size), len(written))
        pack.landed = True
        st.used_bytes += pack.nbytes
        st.files += 1
        st.pack_files += 1
        if not pack.live:  # every object of it went meanwhile
            self._shared_pack_dead(pack, now)
        elif landed is not None:
            self._shared_quota(landed, now)

    def _shared_pack_kill(self, obj: Obj, now: float) -> None:
        """``obj``'s packed copy leaves the index (the caller clears ``obj.shared``)."""
        st = self._shared
        assert st is not None
        pack: Pack | None = st.packs.get(obj.pack >> AT_BITS)
        obj.pack = 0
        st.untrack(obj, 0, files=0)
        st.packed -= 1
        if pack is None:
            return
        pack.live -= 1
        if obj.readers:
            pack.due = max(pack.due, obj.lease_until)
        if pack.live <= 0 and pack.landed:
            self._shared_pack_dead(pack, now)

    def _shared_pack_dead(self, pack: Pack, now: float) -> None:
        """No entry of ``pack`` lives: out of the table and the usage; its file goes once
        the changes that dropped its entries are durable and their leases ended."""
        st = self._shared
        assert st is not None
        del st.packs[pack.pack_id]
        st.used_bytes -= pack.nbytes
        st.files -= 1
        st.pack_files -= 1
        st.unlink_later(pack.path, max(now, pack.due), tuple(pack.keys))

    def _shared_pack_members(self, obj: Obj) -> list[Obj]:
        """The live objects of ``obj``'s pack (``obj`` among them)."""
        st = self._shared
        assert st is not None
        pack: Pack | None = st.packs.get(obj.pack >> AT_BITS)
        if pack is None:
            return [obj]
        pack_id = pack.pack_id
        members: list[Obj] = []
        for key in dict.fromkeys(pack.keys):
            other = self._index.get(key)
            if other is not None and other.shared and other.pack >> AT_BITS == pack_id:
                members.append(other)
        return members or [obj]

    def _shared_pack_gone(self, node: Node) -> None:
        """``node`` is dropped: packs it was to write leave the table (a file it renamed
        without reporting is an orphan, purged by the sweep)."""
        st = self._shared
        assert st is not None
        st.open_packs.pop(node, None)
        for task in (*node.tasks, *node.inflight.values()):
            if task.op != "pack":
                continue
            pack = st.packs.get(task.version)
            if pack is not None and pack.task is task:
                del st.packs[task.version]
            for e in task.entries:
                through = st.writing.get(e.key)
                if through is not None and through[2] == task.task_id:
                    del st.writing[e.key]

    def _shared_packs_restored(self, held: list[Obj]) -> None:
        """After the restore: the table of packs from the objects' records (an
        approximation of each file's size: its live records and their trailer)."""
        st = self._shared
        assert st is not None
        packs: dict[int, Pack] = st.packs
        for obj in held:
            if not obj.pack:
                continue
            pack_id, at = obj.pack >> AT_BITS, obj.pack & AT_MASK
            pack = packs.get(pack_id)
            if pack is None:
                pack = packs[pack_id] = Pack(pack_id, st.prefix + pack_name(pack_id))
                pack.landed = True
            pack.keys.append(obj.key)
            pack.live += 1
            pack.end = max(pack.end, at + file_bytes(obj.key, obj.size))
        for pack in packs.values():
            pack.nbytes = pack_bytes(pack.end, pack.live)
            st.used_bytes += pack.nbytes
            st.files += 1
            st.pack_files += 1
            st.packed += pack.live
        st.next_pack = max(st.next_pack, max(packs, default=0) + 1, int(time.time()),
                           highest_pack_on_disk(st.config.root) + 1)
