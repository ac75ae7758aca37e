"""A storage node: contributes a DRAM segment (and optionally an SSD directory) to the store.

The DRAM segment is a shared-memory segment registered with a
:class:`~kvctl.transfer.engine.TransferEngine`, so clients move bytes in and out through
the engine (``shm`` on the same host, ``tcp`` otherwise) without the node's Python code on
the path: the engine's target server answers READ/WRITE frames, or a same-host client copies
through the shared mapping. The node itself only runs the control loop: register with the
master, heartbeat (a long poll that also brings tasks), and carry out SSD tasks on its own
memory (persist: DRAM → file; load: file → DRAM, verified; drop). Those tasks run on a
thread of their own (:mod:`kvctl.store.taskthread`), never on a client's put or get nor on
the heartbeat loop.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.errors import KvctlError, UsageError
from kvctl.net.advertise import (
    advertised_hosts,
    check_reachable,
    default_listen,
    host_of,
    route_source,
)
from kvctl.net.bind import is_loopback, is_unspecified, parse_listen
from kvctl.store import protocol as p
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.rpc import MasterConnection
from kvctl.store.sharedtier.writer import SharedWriter
from kvctl.store.shmmap import SharedMapping
from kvctl.store.ssd import SsdCorruptError, SsdMissingError, SsdStaleError, SsdTier
from kvctl.store.taskthread import TaskThread
from kvctl.transfer.admin import segment_key
from kvctl.transfer.engine import TransferEngine
from kvctl.transfer.errors import BusyError
from kvctl.transfer.segments import SegmentInfo

if TYPE_CHECKING:
    from kvctl.metrics import ServerMetrics

_log = logging.getLogger("kvctl.store.node")


class _DroppedError(StoreUnavailableError):
    """The master declared this node's memory dead: register new memory instead."""


def node_listen_for(master: str, listen: str | None, advertise: Sequence[str] = ()) -> str:
    """Where a node's data path listens, given its master's address: loopback for a master
    on loopback, else the local address that routes to the master.

    Raises:
        UsageError: an explicit loopback ``listen`` (no ``advertise``) for a master on
            another host.
    """
    if listen is None:
        return default_listen(host_of(master))
    check_reachable(host_of(master), listen, advertise, what="the node's data path",
                    flag="--node-listen")
    return listen


#: Longest host label a default node name keeps (the name stays short in tables).
HOST_LABEL_CHARS = 40


def default_node_id(hostname: str | None = None) -> str:
    """A node's name when none is given: its host's name (the first label of
    ``hostname``, default :func:`socket.gethostname`, reduced to letters, digits, ``_``
    and ``-``) and 6 random hex digits, e.g. ``gpu07-3fa2c1``.

    The suffix keeps the name unique on a host that runs several nodes (and across hosts
    sharing a hostname): the master takes a registration under a name it already has, with
    other memory, as that node restarted, and drops the earlier one (see
    :mod:`kvctl.store.master.liveness`), so two nodes must never share a name.
    """
    host = socket.gethostname() if hostname is None else hostname
    label = re.sub(r"[^A-Za-z0-9_-]+", "-", host.split(".", 1)[0]).strip("-")
    return f"{label[:HOST_LABEL_CHARS] or 'node'}-{secrets.token_hex(3)}"


def _preferred(listen: str, prefer: str | None) -> tuple[str, ...]:
    """For a wildcard bind: advertise the address that reaches the master first."""
    host = parse_listen(listen)[0]
    if not is_unspecified(host) or prefer is None:
        return ()
    return advertised_hosts(host, prefer=prefer)


class StorageNode:
    """Run one storage node until :meth:`close`.

    Args:
        master: ``HOST:PORT`` of the master, or several (``A:PORT,B:PORT``: masters that
            elect a leader on etcd; the node registers with whichever leads, again after
            a takeover, within :data:`~kvctl.store.rpc.FAILOVER_S`), or
            ``etcd://HOST:2379[?cluster=ID]`` (the leader the leader key names, read again
            before each registration). A master that answers ``not_leader`` (deposed, or
            cut off from etcd and not sure it leads) is left for the next.
        node_id: unique name of this node in the store (``None``: :func:`default_node_id`,
            the host's name and a random suffix).
        capacity_bytes: DRAM contributed, bytes.
        ssd_dir: SSD tier directory (``None``: no SSD tier).
        ssd_capacity_bytes: most bytes kept on SSD.
        ssd_policy: ``write-through`` or ``write-back`` (ignored without ``ssd_dir``).
        listen: ``HOST:PORT`` of the data path (transfer engine target server); ``None``
            picks one that the master's other clients can reach (:func:`node_listen_for`).
        advertise: ``HOST`` (or ``HOST:PORT``) clients reach the data path at, when it is
            not the listen address (NAT, a wildcard bind).
        token: shared secret for the master and the data path.
        heartbeat_s: heartbeat long-poll period, seconds (keep well under the master's
            node timeout).
        ssd_fsync: fsync SSD files (durable across host crashes).
        metrics: where to count the data path's reads and writes and the SSD tasks
            (namespace ``kvctl_node``, see :mod:`kvctl.store.metrics`), or ``None``.
    """

    def __init__(self, master: str, *, node_id: str | None = None,
                 capacity_bytes: int = 1 << 30, ssd_dir: Path | None = None,
                 ssd_capacity_bytes: int = 64 << 30, ssd_policy: str = "write-through",
                 listen: str | None = None, token: str | None = None,
                 heartbeat_s: float = 0.5, ssd_fsync: bool = False,
                 advertise: Sequence[str] = (), metrics: ServerMetrics | None = None) -> None:
        if capacity_bytes <= 0:
            raise UsageError(f"node capacity {capacity_bytes} is not positive",
                             "give --capacity a size such as 1GiB")
        if ssd_policy not in p.SSD_POLICIES or (ssd_dir is not None and ssd_policy == "off"):
            raise UsageError(f"unknown SSD policy {ssd_policy!r}",
                             "use write-through or write-back")
        self.master = master
        from kvctl.store.rpc import MasterSet

        self._masters = MasterSet(master)
        master = self._masters.first  # the data path listens where it reaches this one
        self.node_id = node_id or default_node_id()
        self.epoch = secrets.token_hex(8)
        self.capacity_bytes = capacity_bytes
        self._token = token
        self._heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self.ssd: SsdTier | None = None
        #: writes ``shared`` tasks to the master's shared tier (kvctl.store.sharedtier); set
        #: its ``path_map`` where this host mounts the tier elsewhere than the master
        self.shared = SharedWriter()
        #: SSD tasks run here, never on the heartbeat loop (a slow disk must not make the
        #: master judge this node dead)
        self._ssd_tasks = TaskThread(f"kvctl-ssd-{self.node_id}")
        self.ssd_policy = "off"
        self.ssd_capacity_bytes = 0
        if ssd_dir is not None:
            self.ssd = SsdTier(ssd_dir / self.node_id, fsync=ssd_fsync)
            dropped = self.ssd.clear()  # new memory, new epoch: old files are orphans
            if dropped:
                _log.info("SSD tier %s: removed %d files of a previous run", ssd_dir, dropped)
            self.ssd_policy = ssd_policy
            self.ssd_capacity_bytes = ssd_capacity_bytes
        self.segment = f"{self.node_id}.{self.epoch[:8]}"
        listen = node_listen_for(master, listen, advertise)
        prefer = None if is_loopback(host_of(master)) else route_source(host_of(master))
        self.engine = TransferEngine(f"store-{self.segment}",
                                     metadata=f"memory://kvctl-store-{self.segment}",
                                     listen=listen, token=token,
                                     advertise=advertise or _preferred(listen, prefer),
                                     metrics=metrics)
        self.metrics = metrics
        #: port of this node's own metrics endpoint, once one is served (else ``None``)
        self.metrics_port: int | None = None
        #: old segments to unregister once no transfer is in flight on them (see _renew)
        self._retiring: list[str] = []
        try:
            self._info, self._buffer = self._new_segment()
            self._conn = self._register()
        except BaseException:
            self.engine.close()
            raise
        self.tasks_done = 0
        self._thread = threading.Thread(target=self._run, name=f"kvctl-node-{self.node_id}",
                                        daemon=True)
        self._thread.start()

    def _descriptor(self) -> bytes:
        """The segment's descriptor as the engine published it (signed with the token, if
        any), for the master to hand to clients."""
        raw = self.engine.metadata.get(segment_key(self.engine.cluster_id, self.segment))
        return raw if raw is not None else self._info.to_json()

    def _new_segment(self) -> tuple[SegmentInfo, SharedMapping]:
        """Register ``self.segment`` and map it. Our own mapping is pre-faulted in the
        background: SSD tasks read and write through it, and no put or get pays a
        first-touch page fault."""
        self.engine.register_segment(self.segment, self.capacity_bytes, kind="shm")
        info = self.engine.lookup(self.segment)
        return info, SharedMapping(info.buffers[0], segment=self.segment, populate="write")

    def _renew(self) -> None:
        """The master declared this node dead (it missed heartbeats) and dropped its
        objects: start again with new memory under a new epoch and segment name, so a
        client still holding a location in the old segment fails (no such segment)
        instead of writing into space the master hands out again."""
        old_segment, old_buffer = self.segment, self._buffer
        self._ssd_tasks.discard()  # tasks of the old memory: their reports are moot
        if not self._ssd_tasks.idle(SSD_DRAIN_S):
            _log.warning("node %s: SSD tasks of the old memory still run after %g s; "
                         "renewing anyway", self.node_id, SSD_DRAIN_S)
        self.epoch = secrets.token_hex(8)
        self.segment = f"{self.node_id}.{self.epoch[:8]}"
        self._info, self._buffer = self._new_segment()
        old_buffer.close()
        self._retiring.append(old_segment)
        self._unregister_retired()
        if self.ssd is not None:
            self.ssd.clear()  # its objects were dropped with the old memory
        _log.warning("node %s was declared dead by the master; serving new memory as "
                     "segment %s", self.node_id, self.segment)

    def _unregister_retired(self) -> None:
        for name in list(self._retiring):
            try:
                self.engine.unregister_segment(name)
            except BusyError:
                continue  # a transfer still runs on it: next heartbeat
            self._retiring.remove(name)

    def hold(self, segment: str, offset: int, size: int
             ) -> tuple[memoryview, Callable[[], None]] | None:
        """A view of ``size`` bytes at ``offset`` of this node's segment ``segment`` for a
        server in this process to send (see :meth:`MasterServer.serve_local`), with the
        release to call once sent; ``None`` when the range is not in this node's memory."""
        return self.engine.hold_local(segment, offset, size)

    @property
    def endpoint(self) -> str:
        """``host:port`` clients reach the node's data path at (what the master is told)."""
        advertised = self.engine.advertised
        return advertised[0] if advertised else ""

    def _register(self, unsent: Sequence[p.TaskReport] = ()) -> MasterConnection:
        """Register (again); ``unsent``: reports not delivered yet (their tasks run on)."""
        try:
            return self._register_once([r.task_id for r in unsent])
        except _DroppedError:
            self._renew()
            return self._register_once([])

    def _register_once(self, unsent: list[int]) -> MasterConnection:
        conn = self._masters.connect(token=self._token,
                                     timeout_s=max(CALL_TIMEOUT_S, 4 * self._heartbeat_s))
        try:
            reply = conn.call(p.RegisterNode(
                node_id=self.node_id, epoch=self.epoch, segment=self.segment,
                endpoint=self.endpoint, host_id=self._info.host,
                capacity_bytes=self.capacity_bytes,
                ssd_capacity_bytes=self.ssd_capacity_bytes, ssd_policy=self.ssd_policy,
                descriptor=self._descriptor(),
                running=[*unsent, *self.shared.unreported(),
                         *self._ssd_tasks.unreported()]))
        except StoreUnavailableError:
            conn.close()
            # not the leader (it answered ``not_leader``) or gone: the next try starts
            # with the other masters (given etcd, the leader key is read again anyway)
            self._masters.failed(conn.address)
            raise
        except BaseException:
            conn.close()
            raise
        if isinstance(reply, p.Fail):
            conn.close()
            if reply.error.code == "node_dropped":
                raise _DroppedError(reply.error.cause, reply.error.hint or None)
            raise StoreUnavailableError(f"master {self.master} refused node {self.node_id}: "
                                        f"{reply.error.cause}", reply.error.hint or None)
        return conn

    def _run(self) -> None:
        reports: list[p.TaskReport] = []
        conn: MasterConnection | None = self._conn
        while not self._stop.is_set():
            try:
                if self._retiring:
                    self._unregister_retired()
                if conn is None:
                    conn = self._register(reports)
                    self._conn = conn
                    _log.info("node %s registered again with %s", self.node_id, conn.address)
                reports.extend(self.shared.finished())  # shared-tier writes ended since
                reports.extend(self._ssd_tasks.finished())  # and SSD tasks
                reply = conn.call(p.Heartbeat(node_id=self.node_id, epoch=self.epoch,
                                              reports=reports, wait_s=self._heartbeat_s))
                reports = []
                if isinstance(reply, p.Fail):
                    if reply.error.code in ("unknown_node", "node_dropped"):
                        conn.close()
                        conn = None
                        if reply.error.code == "node_dropped":
                            self._renew()
                            reports = []  # tasks of the old memory: moot
                        continue
                    _log.warning("master refused heartbeat: %s", reply.error.cause)
                elif isinstance(reply, p.Tasks):
                    reports = [self._dispatch(task) for task in reply.tasks]
            except KvctlError as exc:
                if self._stop.is_set():
                    break
                _log.warning("node %s: master %s unreachable (%s); retrying", self.node_id,
                             self.master, exc.cause)
                if conn is not None:
                    conn.close()
                    self._masters.failed(conn.address)
                conn = None
                self._stop.wait(min(self._heartbeat_s, 0.5))
        if conn is not None:
            conn.close()

    def _dispatch(self, task: p.Task) -> p.TaskReport:
        """Hand ``task`` to the thread that runs its kind; its report, or a pending one."""
        self.tasks_done += 1
        if task.op in ("shared", "pack"):
            return self.shared.run(task, self._view, self.epoch)
        return self._ssd_tasks.run(task.task_id, lambda: self._counted(task))

    def _counted(self, task: p.Task) -> p.TaskReport:
        """:meth:`_do`, counted as operation ``ssd_<op>`` (outcome ok, full, corrupt or
        failed; bytes: a persist's in to the SSD, a load's out of it)."""
        started = time.perf_counter()
        report = self._do(task)
        if self.metrics is not None:
            outcome = ("ok" if report.ok else "full" if report.full else
                       "corrupt" if report.corrupt else "failed")
            moved = task.size if report.ok else 0
            self.metrics.record(f"ssd_{task.op}", time.perf_counter() - started, outcome,
                                bytes_in=moved if task.op == "persist" else 0,
                                bytes_out=moved if task.op == "load" else 0)
        return report

    def _view(self, offset: int, size: int) -> memoryview:
        view = self._buffer.view
        if offset < 0 or offset + size > view.nbytes:
            raise UsageError(f"range {offset}+{size} is outside node {self.node_id}'s segment",
                             "the master and node disagree on the segment size")
        return view[offset:offset + size]

    def _do(self, task: p.Task) -> p.TaskReport:
        """Carry out SSD task ``task`` (on the SSD task thread)."""
        ssd = self.ssd
        if ssd is None:
            return p.TaskReport(task_id=task.task_id, ok=False, error="node has no SSD tier")
        try:
            if task.op == "persist":
                ssd.write(task.key, task.version, self._view(task.offset, task.size),
                          task.checksum)
            elif task.op == "load":
                ssd.read_into(task.key, self._view(task.offset, task.size), task.checksum)
            elif task.op == "drop":
                ssd.drop(task.key)
            else:
                return p.TaskReport(task_id=task.task_id, ok=False,
                                    error=f"unknown task {task.op!r}")
        except SsdCorruptError as exc:
            _log.warning("node %s: %s", self.node_id, exc.cause)
            return p.TaskReport(task_id=task.task_id, ok=False, corrupt=True, error=exc.cause)
        except SsdStaleError as exc:
            _log.debug("node %s: %s", self.node_id, exc.cause)
            return p.TaskReport(task_id=task.task_id, ok=False, error=exc.cause)
        except SsdMissingError as exc:
            return p.TaskReport(task_id=task.task_id, ok=False, corrupt=True, error=exc.cause)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            text = f"{task.op} of {task.key!r} in {ssd.directory}: {exc.strerror or exc}"
            _log.warning("node %s: %s", self.node_id, text)
            return p.TaskReport(task_id=task.task_id, ok=False, error=text, full=full)
        except KvctlError as exc:
            _log.warning("node %s: %s of %r failed: %s", self.node_id, task.op, task.key,
                         exc.cause)
            return p.TaskReport(task_id=task.task_id, ok=False, error=exc.cause)
        return p.TaskReport(task_id=task.task_id, ok=True)

    def close(self) -> None:
        """Stop the control loop and release the segment (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._conn.interrupt()
        self._thread.join(timeout=self._heartbeat_s + 6)
        self._ssd_tasks.close()
        self._buffer.close()
        self.engine.close()
        if self.metrics is not None:
            self.metrics.close()  # its own endpoint; nothing when it shares the master's

    def __enter__(self) -> StorageNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Seconds a node dropped by the master waits for its SSD tasks of the old memory to end
#: before it clears its SSD directory and serves new memory.
SSD_DRAIN_S = 10.0

#: Seconds a node waits at least for the master's answer (a heartbeat's long poll takes
#: ``heartbeat_s``): past it, a stalled master is given up and the others are tried.
CALL_TIMEOUT_S = 3.0


def default_capacity_bytes() -> int:
    """1 GiB, or 1/8 of physical memory when that is smaller."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 30
    return int(min(1 << 30, total // 8))
