"""Posting and completion matching: one poster thread per port.

Each port's :class:`Poster` owns that port's completion queue and the queue pairs opened
from it. It takes slices (a request, or a piece of one no longer than ``slice_bytes``),
posts each as one signaled RDMA READ/WRITE whose ``wr_id`` is unique for the transport's
life, and matches every completion to its slice by ``wr_id``:

- never more WRs outstanding on a QP than its ``max_send_wr``, nor on the port than its
  CQ holds; slices beyond wait in a per-QP queue (no ``ENOMEM`` from ``post_send``, no CQ
  overrun);
- a completion with an error status fails its QP: the QP goes to ERR, takes no new WRs,
  its flushed completions (``IBV_WC_WR_FLUSH_ERR``) are drained, then it is destroyed;
  every slice it held is retried on another NIC pair (counted in the batch's
  ``retries``) up to ``RetryPolicy.max_retries``, else settled FAILED with the status by
  name;
- a QP whose WRs make no progress for ``timeout_s`` is failed the same way (TIMEOUT when
  retries run out); one that does not even flush is destroyed and its slices retried;
- a completion whose ``wr_id`` is not in flight (a late one of a QP given up on) is
  counted in :attr:`Poster.stale` and never settles anything.

Staged slices (no MR for the local buffer on this port) go through the port's bounce
buffer: copied in before a WRITE is posted, copied out after a READ completes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvctl.errors import KvctlError
from kvctl.transfer.batch import SETTLE_FAILED, SETTLE_TIMEOUT, Batch, OpCode
from kvctl.transfer.segments import LocalBuffer
from kvctl.transfer.transports.base import RemoteSegment
from kvctl.transfer.transports.rdma.devices import NicContext, RdmaOptions
from kvctl.transfer.transports.rdma.exchange import Connection
from kvctl.transfer.transports.rdma.memory import Bounce, MemoryRegistry
from kvctl.transfer.transports.rdma.provider import (
    WC_FLUSH,
    WC_SUCCESS,
    Verbs,
    wc_status_text,
)

_log = logging.getLogger("kvctl.transfer.rdma")

#: How long an idle poster spins on its CQ before it starts sleeping, seconds.
SPIN_S = 100e-6
_MAX_SLEEP_S = 1e-3
_POLL_BATCH = 64
#: wr_ids are unique across every poster of a process.
_WR_IDS = itertools.count(1)


def post_wr(v: Verbs, qp: Any, wr_id: int, op: OpCode, laddr: int, length: int, lkey: int,
            rkey: int, raddr: int) -> None:
    """Post one signaled RDMA READ/WRITE of ``length`` bytes between ``laddr`` (``lkey``)
    and ``raddr`` (``rkey``). The SGE and the WR are closed here: ``ibv_post_send`` copied
    them, and pyverbs v44 never frees their native memory by itself.

    Raises:
        the provider's PyverbsError: ``post_send`` failed (nothing was posted).
        OverflowError: ``length`` does not fit the SGE's 32 bits (callers slice first).
    """
    en = v.enums
    opcode = en.IBV_WR_RDMA_READ if op is OpCode.READ else en.IBV_WR_RDMA_WRITE
    sge = v.SGE(laddr, length, lkey)
    try:
        wr = v.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                      send_flags=en.IBV_SEND_SIGNALED)
    finally:
        sge.close()
    try:
        wr.set_wr_rdma(rkey, raddr)
        qp.post_send(wr)
    finally:
        wr.close()


class Slice:
    """One WR's worth of a request (or all of it).

    Attributes:
        batch / slot: where its request is settled.
        op: READ or WRITE.
        lbuf / lrel: local buffer and offset in it.
        target / bi / trel: target segment, buffer index and offset in that buffer.
        length: bytes.
        remote: the remote port chosen (``mlx5_1:1``).
        attempt: 0 for the first try.
        last_timeout: the latest failure was a timeout.
    """

    __slots__ = ("attempt", "batch", "bi", "bounce", "conn", "last_path", "last_timeout", "lbuf",
                 "length", "lrel", "op", "remote", "slot", "target", "trel")

    def __init__(self, batch: Batch, slot: int, op: OpCode, lbuf: LocalBuffer, lrel: int,
                 target: RemoteSegment, bi: int, trel: int, length: int, remote: str) -> None:
        self.batch = batch
        self.slot = slot
        self.op = op
        self.lbuf = lbuf
        self.lrel = lrel
        self.target = target
        self.bi = bi
        self.trel = trel
        self.length = length
        self.remote = remote
        self.attempt = 0
        self.last_timeout = False
        self.bounce: int | None = None
        self.conn: Connection | None = None
        self.last_path = ""


#: Called with a slice that failed on this port: retry it elsewhere or settle it.
Reroute = Callable[[Slice, str, bool], None]
#: Opens the connection for (target engine, remote port) on a port.
Opener = Callable[[NicContext, Slice], Connection]


class Poster:
    """Posts slices on one port and matches their completions (one thread)."""

    def __init__(self, nic: NicContext, registry: MemoryRegistry, options: RdmaOptions, *,
                 open_connection: Opener, reroute: Reroute) -> None:
        self.nic = nic
        self._verbs = nic.verbs
        self._registry = registry
        self._options = options
        self._open = open_connection
        self._reroute = reroute
        self._jobs: queue.SimpleQueue[list[Slice] | None] = queue.SimpleQueue()
        self._waiting: dict[tuple[str, str], collections.deque[Slice]] = {}
        self._conns: dict[tuple[str, str], Connection] = {}
        self._dying: list[Connection] = []
        self._inflight: dict[int, Slice] = {}
        self._outstanding = 0
        self._bounce: Bounce | None = None
        self._stopping = False
        #: completions whose wr_id was no longer in flight (ignored)
        self.stale = 0
        #: WRs posted, completions matched
        self.posted = 0
        self.completed = 0
        self.thread = threading.Thread(target=self._run, name=f"kvctl-rdma-{nic.name}",
                                       daemon=True)
        self.thread.start()

    # -- feeding -----------------------------------------------------------------------

    def submit(self, slices: list[Slice]) -> None:
        """Queue ``slices`` for this port (any thread)."""
        self._jobs.put(slices)

    def stop(self) -> None:
        """Fail what is queued or in flight, drain and destroy the QPs, end the thread."""
        self._jobs.put(None)
        self.thread.join(30.0)

    @property
    def connections(self) -> int:
        """QPs this port has open to targets."""
        return len(self._conns)

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        idle_since = 0.0
        sleep_s = 0.0
        while True:
            busy = bool(self._inflight) or any(self._waiting.values()) or bool(self._dying)
            if not self._take(block=not busy):
                break
            posted = self._post_all()
            polled = self._poll()
            now = time.monotonic()
            self._check_timeouts(now)
            self._reap()
            if posted or polled:
                idle_since = 0.0
                sleep_s = 0.0
                continue
            if not idle_since:
                idle_since = now
            elif now - idle_since > SPIN_S:
                sleep_s = min(_MAX_SLEEP_S, max(20e-6, sleep_s * 2))
                time.sleep(sleep_s)
        self._shutdown()

    def _take(self, *, block: bool) -> bool:
        """Move queued slices to their connection queues; ``False`` once told to stop."""
        while True:
            try:
                job = self._jobs.get(timeout=0.5) if block else self._jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            for sl in job:
                key = (sl.target.info.engine, sl.remote)
                self._waiting.setdefault(key, collections.deque()).append(sl)
            block = False

    def _post_all(self) -> int:
        posted = 0
        capacity = self.nic.cq_capacity
        for key, waiting in list(self._waiting.items()):
            if not waiting:
                del self._waiting[key]
                continue
            conn = self._conns.get(key)
            if conn is None:
                conn = self._connect(key, waiting)
                if conn is None:
                    continue
            if conn.error is not None:
                continue  # draining; a new QP is opened once this one is gone
            while waiting and conn.outstanding < conn.window and self._outstanding < capacity:
                sl = waiting[0]
                if not self._post(conn, sl):
                    break
                waiting.popleft()
                posted += 1
        return posted

    def _connect(self, key: tuple[str, str], waiting: collections.deque[Slice]
                 ) -> Connection | None:
        if any(c.key == key for c in self._dying):
            return None  # the failed QP is still draining
        try:
            conn = self._open(self.nic, waiting[0])
        except (KvctlError, OSError, self._verbs.Error) as exc:
            cause = getattr(exc, "cause", None) or str(exc).strip()
            cause = f"cannot connect {self.nic.name} to {key[1]} of {key[0]}: {cause}"
            _log.warning("RDMA: %s", cause)
            slices = list(waiting)
            waiting.clear()
            for sl in slices:
                self._reroute(sl, cause, False)
            return None
        self._conns[key] = conn
        return conn

    def _post(self, conn: Connection, sl: Slice) -> bool:
        """Post one WR; ``False`` when it must wait (no bounce chunk free)."""
        v = self._verbs
        local = self._registry.lookup(sl.lbuf, self.nic.name)
        if local is None:
            bounce = self._staging()
            if bounce is None:
                self._fail_on_port(sl, "no staging memory for an unregistered buffer", False)
                return True
            index = bounce.take()
            if index is None:
                return False
            sl.bounce = index
            if sl.op is OpCode.WRITE:
                sl.lbuf.read_into(sl.lrel, bounce.view(index, sl.length))
            laddr, lkey = bounce.address(index), bounce.lkey
        else:
            laddr, lkey = local.base + sl.lrel, local.lkey
        rinfo = sl.target.info.rdma[sl.bi]["nics"][sl.remote]
        wr_id = next(_WR_IDS)
        try:
            post_wr(v, conn.qp, wr_id, sl.op, laddr, sl.length, lkey, int(rinfo["rkey"]),
                    int(rinfo["addr"]) + sl.trel)
        except v.Error as exc:
            self._give_bounce(sl)
            cause = f"post_send on {conn.path} failed: {str(exc).strip()}"
            conn.fail(cause)
            self._fail_on_port(sl, cause, False)
            return True
        if not conn.outstanding:
            conn.last_progress = time.monotonic()
        conn.outstanding += 1
        self._outstanding += 1
        sl.conn = conn
        self._inflight[wr_id] = sl
        self.posted += 1
        return True

    def _staging(self) -> Bounce | None:
        if self._bounce is None:
            from kvctl.transfer.transports.rdma.exchange import access_flags

            try:
                self._bounce = Bounce(self.nic, self._options.bounce_bytes,
                                      self._options.slice_bytes, access_flags(self.nic))
            except KvctlError as exc:
                _log.warning("RDMA staging on %s unavailable: %s", self.nic.name, exc.cause)
                return None
        return self._bounce

    def _give_bounce(self, sl: Slice) -> None:
        if sl.bounce is not None and self._bounce is not None:
            self._bounce.give(sl.bounce)
        sl.bounce = None

    def _poll(self) -> int:
        if not self._outstanding:
            return 0
        try:
            npolled, wcs = self.nic.cq.poll(_POLL_BATCH)
        except self._verbs.Error as exc:
            self._cq_failed(f"polling the CQ of {self.nic.name} failed: {str(exc).strip()}")
            return 0
        if not npolled:
            return 0
        now = time.monotonic()
        done: dict[tuple[int, str], tuple[Batch, list[int]]] = {}
        for wc in wcs[:npolled]:
            sl = self._inflight.pop(wc.wr_id, None)
            if sl is None:
                self.stale += 1  # a late completion of a QP given up on: never counted
                continue
            conn = sl.conn
            self._outstanding -= 1
            self.completed += 1
            if conn is not None:
                conn.outstanding -= 1
                conn.last_progress = now
            status = int(wc.status)
            if status == WC_SUCCESS:
                if sl.bounce is not None:
                    if sl.op is OpCode.READ and self._bounce is not None:
                        sl.lbuf.write_from(sl.lrel, self._bounce.view(sl.bounce, sl.length))
                    self._give_bounce(sl)
                path = self._path(sl, conn)
                entry = done.get((id(sl.batch), path))
                if entry is None:
                    done[(id(sl.batch), path)] = (sl.batch, [sl.slot])
                else:
                    entry[1].append(sl.slot)
                continue
            self._give_bounce(sl)
            where = conn.path if conn is not None else self.nic.name
            text = wc_status_text(status)
            if conn is not None and status != WC_FLUSH:
                conn.fail(f"{text} on {where}")
            if status == WC_FLUSH and conn is not None and conn.error:
                cause = f"flushed after {conn.error}"
            else:
                cause = f"RDMA {sl.op.name} of {sl.length} bytes via {where} failed: {text}"
            self._fail_on_port(sl, cause, bool(conn is not None and conn.error
                                                and "no completion" in conn.error))
        for (_, path), (batch, slots) in done.items():
            batch.settle(slots, path=path)
        return int(npolled)

    def _path(self, sl: Slice, conn: Connection | None) -> str:
        mode = self._registry.mode_of(sl.lbuf)
        remote_mode = sl.target.info.rdma[sl.bi].get("mode", "host")
        base = conn.path if conn is not None else f"rdma:{self.nic.name}"
        return f"{base}[{mode}->{remote_mode}]"

    def _fail_on_port(self, sl: Slice, cause: str, timeout: bool) -> None:
        sl.last_path = f"rdma:{self.nic.name}->{sl.remote}"
        sl.conn = None
        sl.last_timeout = timeout
        self._reroute(sl, cause, timeout)

    def _check_timeouts(self, now: float) -> None:
        limit = self._options.timeout_s
        for conn in [*self._conns.values(), *self._dying]:
            if not conn.outstanding:
                continue
            if conn.error is None and now - conn.last_progress > limit:
                _log.warning("RDMA: no completion on %s within %g s; failing its QP",
                             conn.path, limit)
                conn.fail(f"no completion within {limit:g} s")
            elif conn.error is not None and now - conn.failed_at > min(limit, 5.0):
                self._abandon(conn)  # not even flushed: the device is gone

    def _abandon(self, conn: Connection) -> None:
        """Give up on ``conn``'s in-flight WRs: retry them elsewhere, destroy the QP (no
        DMA after that), and ignore any completion of theirs that still turns up."""
        cause = f"RDMA QP on {conn.path} failed ({conn.error}) and did not flush"
        for wr_id, sl in list(self._inflight.items()):
            if sl.conn is conn:
                del self._inflight[wr_id]
                self._outstanding -= 1
                self._give_bounce(sl)
                self._fail_on_port(sl, cause, "no completion" in (conn.error or ""))
        conn.outstanding = 0

    def _reap(self) -> None:
        for key, conn in list(self._conns.items()):
            if conn.error is not None:
                del self._conns[key]
                self._dying.append(conn)
        if self._dying:
            left = []
            for conn in self._dying:
                if conn.outstanding:
                    left.append(conn)
                else:
                    _log.info("RDMA: destroyed the QP on %s (%s)", conn.path, conn.error)
                    conn.destroy()
            self._dying = left

    def _cq_failed(self, cause: str) -> None:
        _log.error("RDMA: %s", cause)
        for conn in [*self._conns.values(), *self._dying]:
            conn.fail(cause)
            self._abandon(conn)

    def _shutdown(self) -> None:
        cause = "RDMA transport closed"
        for waiting in self._waiting.values():
            for queued in waiting:
                queued.batch.settle([queued.slot], path=f"rdma:{self.nic.name}",
                                    failure=SETTLE_FAILED, cause=cause)
        self._waiting.clear()
        for conn in self._conns.values():
            conn.fail(cause)
        self._dying.extend(self._conns.values())
        self._conns.clear()
        deadline = time.monotonic() + 2.0
        while self._inflight and time.monotonic() < deadline:
            try:
                npolled, wcs = self.nic.cq.poll(_POLL_BATCH)
            except self._verbs.Error:
                break
            for wc in wcs[:npolled]:
                gone = self._inflight.pop(wc.wr_id, None)
                if gone is not None:
                    gone.batch.settle([gone.slot], path=f"rdma:{self.nic.name}",
                                      failure=SETTLE_FAILED, cause=cause)
            if not npolled:
                time.sleep(0.001)
        for sl in self._inflight.values():
            sl.batch.settle([sl.slot], path=f"rdma:{self.nic.name}", failure=SETTLE_FAILED,
                            cause=cause)
        self._inflight.clear()
        for conn in self._dying:
            conn.destroy()
        self._dying.clear()
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None


def settle_failed(sl: Slice, cause: str, *, timeout: bool) -> None:
    """Settle ``sl`` as FAILED (or TIMEOUT) with ``cause``, on the path it last tried."""
    sl.batch.settle([sl.slot], path=sl.last_path or f"rdma:->{sl.remote}",
                    failure=SETTLE_TIMEOUT if timeout else SETTLE_FAILED, cause=cause)
