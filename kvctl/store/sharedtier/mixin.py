"""The master's side of the shared tier: what is in it, who writes it, what leaves it.

Rules (tests/store/test_shared_tier.py, tests/multihost/test_shared_tier.py):

- Write-back: an object DRAM evicts is first written to the shared tier by the node that
  holds it (a ``shared`` task on its heartbeat), then its DRAM is freed. Write-through
  (policy ``write-through``): each installed object is also copied soon after its put,
  by one of its replica nodes, never on the put's path; at most
  ``max_queued_writes`` such copies wait per node (more are skipped and counted).
- The index records a copy as ``Obj.shared`` only once its writer reported the file
  renamed into place; the file's name follows from the key and version
  (:func:`~kvctl.store.sharedtier.fileformat.file_name`), so a record costs no string;
  a copy in a pack file (small objects, :mod:`~kvctl.store.sharedtier.packs`) is named by
  ``Obj.pack`` (pack id and offset).
  ``Obj.shared`` is the copy's *use stamp* (0: no copy): a counter taken when the copy
  lands and, coarsely, when it is used (below), kept in the object's record; copies
  stamped in a row share one value (about 1,024 in the tier,
  :data:`~kvctl.store.sharedtier.housekeeping.STAMP_BUCKETS`), so a stamp costs no memory.
- A get of an object with no DRAM replica (nor SSD copy) on an alive node answers the
  file's path and no location: the client reads it itself (no node hop) and verifies it.
  Every other get of an object with a shared copy names the file too, so a client whose
  DRAM read fails (the node just died) falls back to it.
- An object whose only other copies go (node dropped or restarted, DRAM evicted) stays
  while its shared copy does; a master restart keeps it (its record carries the copy).
- Quota: past ``capacity_bytes`` or ``max_files`` the least recently used copies are
  evicted (the object is forgotten when that was its last copy).
- LRU order across a master restart: the restore orders the copies by their use stamps.
  A get moves its copy to the recent end in memory (no state write); it writes a new
  stamp into the record only when the recorded one is older than half the tier's files
  (the copy would come back in the older half of the order), at most
  :data:`RESTAMPS_PER_S` a second, so a master restart keeps the copies in use, at the
  cost of a few state writes, never one per get.
- A file a client reports bad is checked by the master and, if bad, leaves the index
  (:mod:`kvctl.store.sharedtier.reports`).
- The master deletes files (evicted, removed, replaced, orphaned) after any lease on them
  ends and once the state change that stopped naming them is durable, outside its lock
  (:mod:`kvctl.store.sharedtier.housekeeping`), never a node.
- A node dropped with write-through copies in flight leaves no entry in the per-node
  queues (their reports will never come).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.store import protocol as p
from kvctl.store.master.records import Node, Obj, Replica
from kvctl.store.sharedtier.config import TIER_MARKER, SharedTierConfig, open_tier
from kvctl.store.sharedtier.fileformat import COUNTED_ERRNOS, file_bytes, file_name, pack_name
from kvctl.store.sharedtier.housekeeping import SharedState, housekeeping
from kvctl.store.sharedtier.packs import AT_BITS, AT_MASK, SharedPacks
from kvctl.store.sharedtier.reports import MAX_PER_REPORT

_log = logging.getLogger("kvctl.store.master")

#: Most use stamps written into records a second (see the module's docstring).
RESTAMPS_PER_S = 64.0
#: A recorded stamp is renewed only when about this many copies were stamped after it.
RESTAMP_MIN_AGE = 64
_USE_ORDER = operator.attrgetter("shared")


class SharedTierMixin(SharedPacks):
    """The shared tier's index, writes, quota and deletes (lock held unless said)."""

    _shared: SharedState | None
    #: the tier's marker was made by this start (the root had none)
    _shared_marked: bool = False
    #: while an elected master leads: ``None``, else why not (see :meth:`fence_files`)
    _shared_leading: Callable[[], str | None] | None = None

    def _shared_setup(self, config: SharedTierConfig | None) -> None:
        """Before the restore: the tier's tables (``None``: no shared tier)."""
        self._shared_marked = False
        if config is not None:
            config.check()
            self._shared_marked = not open_tier(config.root)
        self._shared = SharedState(config) if config is not None else None

    def _shared_restored(self) -> None:
        """After the restore: count the copies the state names (O(objects), once).

        Raises:
            UsageError: the state names shared-tier copies and no shared tier is set.
        """
        st = self._shared
        held = [obj for obj in self._index.values() if obj.shared]
        if st is None:
            if held:
                raise UsageError(f"the master's state names {len(held)} objects in a shared "
                                 "tier, and this master has none",
                                 "start it with --shared-tier DIR (the same directory)")
            return
        if held and self._shared_marked:
            # The marker was missing: a bare mount point (the file system not mounted) or
            # a tier of a kvctl before markers. Taken for the tier, its every file would be
            # "missing", and reads would drop the state's copies one by one.
            marker = st.config.root / TIER_MARKER
            with contextlib.suppress(OSError):
                marker.unlink()
            raise UsageError(f"the master's state names {len(held)} objects in the shared "
                             f"tier {st.config.root}, which has no {TIER_MARKER} file: it is "
                             "not mounted, or not that tier",
                             "mount the shared tier there; if it is mounted and was written "
                             f"by an older kvctl, create the marker: touch {marker}")
        # least recently used first: by use stamp (copies of one stamp, and records of
        # older kvctl versions, which have 1, keep their replay order); 0.4 s per 10^6
        held.sort(key=_USE_ORDER)
        for obj in held:
            if obj.pack:
                st.track(obj, 0, files=0)
            else:
                st.track(obj, file_bytes(obj.key, obj.size))
        self._shared_packs_restored(held)
        if held:
            st.stamp = max(st.stamp, held[-1].shared + 1)
        self._shared_quota(None, self._clock())  # a smaller quota than the last run's

    # ------------------------------------------------------------------ names

    def shared_path(self, key: str, version: int) -> Path:
        """Where the master names ``key``'s file at ``version`` (no shared tier: error)."""
        st = self._shared
        if st is None:
            raise UsageError("this master has no shared tier", "start it with --shared-tier")
        return st.config.root / file_name(key, version)

    def _shared_name(self, obj: Obj) -> str:
        """``obj``'s shared-tier file for a get's answer ("" without one); marks it used."""
        st = self._shared
        if st is None or not obj.shared:
            return ""
        lru = st.lru
        if lru.get(obj.key) is obj:
            del lru[obj.key]
            lru[obj.key] = obj
            if st.stamp_age(obj.shared) > max(RESTAMP_MIN_AGE, len(lru) // 2) and (
                    st.may_restamp(self._clock(), RESTAMPS_PER_S)):
                obj.shared = st.next_stamp()  # would restore in the older half: renew
                self._persist(obj)
        return self._shared_file(obj)

    def _shared_file(self, obj: Obj) -> str:
        """``obj``'s shared-tier file, as the master names it (a shared tier is set)."""
        assert self._shared is not None
        if obj.pack:
            return self._shared.prefix + pack_name(obj.pack >> AT_BITS)
        return self._shared.prefix + file_name(obj.key, obj.version)

    def _shared_at(self, obj: Obj) -> int:
        """Where ``obj``'s record starts in its pack file (-1: the file is its own)."""
        return obj.pack & AT_MASK if obj.pack else -1

    def _shared_get(self, obj: Obj, lease: bool, now: float) -> p.GetSlot:
        """The answer for an object only the shared tier holds (read by the client)."""
        if lease:
            obj.lease_until = max(obj.lease_until, now + self.config.lease_ttl_s)
            obj.readers += 1
        return p.GetSlot(key=obj.key, size=obj.size, checksum=obj.checksum,
                         version=obj.version, locations=[], shared=self._shared_name(obj),
                         shared_at=self._shared_at(obj))

    # ------------------------------------------------------------------ writes

    def _shared_task(self, node: Node, obj: Obj, offset: int, *, free_after: bool) -> p.Task:
        """Queue a ``shared`` task. A write-back (``free_after``: DRAM waits for it) wakes
        the node's heartbeat at once; a write-through copy goes with its next one, so a
        stream of puts costs the node one heartbeat per period, not one per put."""
        assert self._shared is not None
        if self._shared_packable(obj):
            packed = self._shared_pack_entry(node, obj, offset, free_after=free_after)
            if packed is not None:
                return packed
        task = p.Task(task_id=next(self._task_ids), op="shared", key=obj.key,
                      version=obj.version, offset=offset, size=obj.size,
                      checksum=obj.checksum, free_after=free_after,
                      path=self._shared_file(obj))
        node.tasks.append(task)
        if free_after:
            self._cond.notify_all()
        return task

    def _shared_write_back(self, obj: Obj, node: Node, rep: Replica, now: float) -> bool:
        """DRAM evicts ``obj`` on ``node``: have the node write it to the shared tier first
        (``True``), or ``False`` when it has a copy there already or cannot get one."""
        st = self._shared
        if st is None or obj.shared or (obj.evicting and node in obj.evicting) or (
                not st.fits(obj)):
            return False
        through = st.writing.get(obj.key)
        if through is not None and through[0] is obj and through[1] is node:
            task_id = through[2]  # its write-through copy runs there: free DRAM after it
            self._cond.notify_all()  # and let the node have it now
        elif st.paused(now) or len(obj.replicas) > 1:
            return False  # another DRAM replica keeps it (its eviction writes it back)
        elif not st.claim(self._shared_file(obj)):
            return False  # the name's old file is being deleted this moment
        else:
            task_id = self._shared_task(node, obj, rep.offset, free_after=True).task_id
        if obj.evicting is None:
            obj.evicting = {}
        obj.evicting[node] = task_id
        node.freeing_bytes += node.alloc.rounded(obj.size)
        return True

    def _shared_write_through(self, obj: Obj, now: float) -> None:
        """``obj`` was just installed: with write-through, a replica node copies it."""
        st = self._shared
        if st is None or st.config.policy != "write-through" or obj.shared or (
                not obj.size) or not st.fits(obj) or st.paused(now):
            return
        for rep in obj.replicas:
            node = rep.node
            if not node.alive:
                continue
            count, nbytes = st.queued.get(node, (0, 0))
            # a copy joining a pack being gathered takes no queue slot of its own
            pack = self._shared_open_pack(node, obj) if self._shared_packable(obj) else None
            if (count >= st.config.max_queued_writes and pack is None) or (
                    count and nbytes + obj.size > st.config.max_queued_bytes):
                st.skipped += 1
                return
            task = self._shared_task(node, obj, rep.offset, free_after=False)
            if task.op == "pack":
                pack = st.open_packs[node]
                added, pack.counted = int(not pack.counted), True
            else:
                added = 1
            st.queued[node] = (count + added, nbytes + obj.size)
            st.writing[obj.key] = (obj, node, task.task_id)
            return

    def _shared_persisted(self, node: Node, task: p.Task, report: p.TaskReport,
                          obj: Obj | None, now: float) -> None:
        """A node reports a ``shared`` task (``obj``: the current object it was for)."""
        st = self._shared
        if st is None:
            return
        free_after = task.free_after
        if not free_after:
            count, nbytes = st.queued.get(node, (1, task.size))
            st.queued[node] = (max(0, count - 1), max(0, nbytes - task.size))
            free_after = st.through_landed(task.key, task.task_id, node)
        if free_after:
            node.freeing_bytes = max(0, node.freeing_bytes - node.alloc.rounded(task.size))
        st.note_write(report, now)
        if obj is None:
            if free_after:  # removed while its write-back ran: free the DRAM now
                node.alloc.free(task.offset, task.size)
            if report.ok:  # object gone or replaced meanwhile: its file goes too
                st.unlink_later(task.path, now, task.key)
            return
        if report.ok:
            if not obj.shared:
                obj.shared = st.next_stamp()
                st.track(obj, file_bytes(obj.key, obj.size))
                self._shared_quota(obj, now)
        else:
            _log.warning("node %s could not write %r to the shared tier: %s", node.node_id,
                         obj.key, report.error)
        if free_after and self._write_back_done(obj, node, now):
            return
        self._persist(obj)

    # ------------------------------------------------------------------ leaving

    def _shared_quota(self, newest: Obj | None, now: float) -> None:
        """Evict least recently used copies while the tier is over its quota (never
        ``newest``, the copy that just landed)."""
        st = self._shared
        assert st is not None
        while st.over_quota():
            oldest = st.oldest(newest)
            if oldest is None:
                return
            # a packed copy goes with its whole pack (only that frees a file)
            for victim in self._shared_pack_members(oldest) if oldest.pack else [oldest]:
                st.evictions += 1
                self._shared_drop(victim, now)
                if not self._index.holds(victim):
                    continue
                if victim.replicas or victim.ssd:
                    self._persist(victim)
                else:
                    self._forget(victim, "evicted from the shared tier")

    def _shared_drop(self, obj: Obj, now: float) -> None:
        """``obj`` loses its shared copy; the file is deleted once no lease covers it."""
        st = self._shared
        if st is None or not obj.shared:
            return
        if obj.pack:
            obj.shared = 0
            self._shared_pack_kill(obj, now)  # the pack's file goes with its last entry
            return
        st.untrack(obj, file_bytes(obj.key, obj.size))
        obj.shared = 0
        # The caller writes the record that stops naming the file (same lock hold): the
        # delete waits until that change is durable.
        st.unlink_later(self._shared_file(obj),
                        max(now, obj.lease_until if obj.readers else now), obj.key)

    def _shared_node_gone(self, node: Node) -> None:
        """``node`` is dropped: its write-through copies in flight will never report, so
        they leave its queue and the table of copies being written (else up to
        ``max_queued_writes`` entries stayed, holding their objects, and kept the sweep
        from purging a file the node renamed but never reported)."""
        st = self._shared
        if st is None:
            return
        st.queued.pop(node, None)
        self._shared_pack_gone(node)
        for task in (*node.tasks, *node.inflight.values()):
            if task.op != "shared" or task.free_after:
                continue
            through = st.writing.get(task.key)
            if through is not None and through[2] == task.task_id:
                del st.writing[task.key]

    # ------------------------------------------------------------------ bad files

    def report_shared(self, keys: list[str], versions: list[int]) -> None:
        """A client found these files bad (a :class:`~kvctl.store.protocol.SharedBad`):
        queue those the index names now for the master's own check."""
        st = self._shared
        if st is None:
            return
        reports = st.reports
        taken = False
        looked = list(zip(keys[:MAX_PER_REPORT], versions[:MAX_PER_REPORT], strict=False))
        with self._lock:
            now = self._clock()
            reports.reports += max(len(keys), len(looked))
            reports.dropped += max(0, len(keys) - len(looked))
            for key, version in looked:
                obj = self._index.get(key)
                if obj is None or obj.version != version or not obj.shared:
                    continue  # not a file the index names (any more): nothing to check
                taken = reports.take(obj, self._shared_file(obj), now,
                                     self._shared_at(obj)) or taken
        if taken:
            reports.start(self)

    def _shared_root(self) -> Path:
        """The tier's root as the master sees it (a shared tier is set)."""
        assert self._shared is not None
        return self._shared.config.root

    def _shared_check_wanted(self, obj: Obj) -> bool:
        """Whether a queued report's file is still the one the index names (lock held)."""
        return self._index.holds(obj) and bool(obj.shared)

    def _shared_check_failed(self, name: str, text: str) -> None:
        """The file system failed the master's read of a reported file: counted, the
        index entry kept (lock held)."""
        st = self._shared
        if st is not None:
            st.count_error(name, text)

    def _shared_bad(self, obj: Obj, kind: str, why: str) -> None:
        """The master's own check found ``obj``'s file bad: drop the copy from the index
        (a state change), the file goes once that is durable (lock held)."""
        st = self._shared
        if st is None or not self._shared_check_wanted(obj):
            return
        now = self._clock()
        text = (f"shared-tier file {self._shared_file(obj)} of {obj.key!r} is bad ({why}): "
                "dropped from the index")
        _log.warning("%s", text)
        st.reports.bad += 1
        st.errors[kind] = st.errors.get(kind, 0) + 1
        st.last_error = text
        self._shared_drop(obj, now)
        if obj.replicas or obj.ssd:
            self._persist(obj)
        else:
            self._forget(obj, f"its shared-tier file was bad ({why})", lost=True)

    def _shared_close(self) -> None:
        if self._shared is not None:
            self._shared.reports.close()

    def _shared_status(self) -> p.SharedTierStatus | None:
        st = self._shared
        if st is None:
            return None
        cfg = st.config
        return p.SharedTierStatus(
            root=str(cfg.root), policy=cfg.policy, used_bytes=st.used_bytes,
            capacity_bytes=cfg.capacity_bytes, files=st.files, max_files=cfg.max_files,
            evictions=st.evictions, writes=st.writes, write_errors=st.write_errors,
            purged=st.purged, purge_backlog=st.backlog(),
            errors={k: v for k, v in st.errors.items() if v or k in COUNTED_ERRNOS},
            state="full" if st.paused(self._clock()) else "ok", last_error=st.last_error,
            fs_free_bytes=st.fs_free_bytes, fs_total_bytes=st.fs_total_bytes,
            reports=st.reports.reports, reports_dropped=st.reports.dropped,
            bad_files=st.reports.bad, pack_below=cfg.pack_below,
            packs=st.pack_files, packed_objects=st.packed)

    def _shared_housekeeping(self) -> None:
        """Deletes that are due and a slice of the purge sweep (takes the lock briefly; the
        file system calls run without it)."""
        if self._shared is not None:
            housekeeping(self, self._shared)

    def fence_files(self, check: Callable[[], str | None]) -> None:
        """Delete tier files only while ``check()`` is ``None`` (an elected master: see
        :meth:`~kvctl.store.master.election.Election.check`). The files are shared with
        the next leader and etcd cannot fence an unlink: a leader SIGSTOPped past its
        lease would otherwise, once resumed, purge the new leader's files as orphans of
        its stale index, or delete the ones its unsent journal writes had dropped."""
        self._shared_leading = check

    def _shared_may_delete(self) -> bool:
        check = self._shared_leading
        return check is None or check() is None

    def _shared_current(self, key: str, version: int) -> bool:
        """Whether the index names ``key``'s file at ``version``, or a node is writing it
        (its report may come long after the rename: a slow heartbeat, a takeover; the
        file is the copy the report records) (lock held)."""
        obj = self._index.get(key)
        if obj is None or obj.version != version:
            return False
        st = self._shared
        through = st.writing.get(key) if st is not None else None
        return (bool(obj.shared) and not obj.pack) or bool(obj.evicting) or (
            through is not None and through[0] is obj)
