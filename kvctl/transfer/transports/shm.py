"""``shm``: same-host, one-sided copies straight between mapped segments.

The initiator maps the target's ``/dev/shm`` file (or opens its disk file) once per target
and copies with memoryview slice assignment (a ``memcpy``) or positional I/O. The target's
CPU takes no part: no frame, no thread, no syscall on its side. Copies run on one worker
thread per engine, so ``submit`` returns at once; ``TransferEngine.run`` (submit and wait)
copies in the calling thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading

from kvctl.errors import KvctlError
from kvctl.transfer.batch import SETTLE_FAILED, Batch, OpCode
from kvctl.transfer.segments import LocalBuffer, MemoryBuffer, map_remote_buffer
from kvctl.transfer.transports.base import Item, RemoteSegment, Transport

_log = logging.getLogger("kvctl.transfer.shm")

#: Copies at least this long use ctypes.memmove (GIL released); shorter ones slice-assign.
MEMMOVE_BYTES = 64 * 1024
_memmove = ctypes.memmove

_Job = tuple[Batch, OpCode, RemoteSegment, list[Item]]


class _Mappings:
    """A remote segment's buffers mapped here, and how many copies are using them."""

    __slots__ = ("buffers", "retired", "users")

    def __init__(self, buffers: list[LocalBuffer]) -> None:
        self.buffers = buffers
        self.users = 0
        self.retired = False

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()


class ShmTransport(Transport):
    """Copies through shared mappings of same-host segments."""

    name = "shm"

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kvctl-shm", daemon=True)
        self._worker.start()

    def execute(self, batch: Batch, op: OpCode, target: RemoteSegment, items: list[Item]) -> None:
        self._jobs.put((batch, op, target, items))

    def execute_waiting(self, batch: Batch, op: OpCode, target: RemoteSegment,
                        items: list[Item]) -> None:
        self._copy((batch, op, target, items))  # the caller waits anyway: copy here

    def _acquire(self, target: RemoteSegment) -> _Mappings:
        """The target's mappings, counted as in use until :meth:`_release`."""
        with target.lock:
            held: _Mappings | None = target.cache.get("shm")
            if held is None:
                held = _Mappings([map_remote_buffer(b, segment=target.info.name)
                                  for b in target.info.buffers])
                target.cache["shm"] = held
            held.users += 1
            return held

    def _release(self, target: RemoteSegment, held: _Mappings) -> None:
        with target.lock:
            held.users -= 1
            last = held.retired and held.users == 0
        if last:
            held.close()

    def forget(self, target: RemoteSegment) -> None:
        """Drop the target's mappings: now, or when the last copy through them ends (a
        refresh or close on another thread never unmaps memory under a running copy)."""
        with target.lock:
            held: _Mappings | None = target.cache.pop("shm", None)
            if held is None:
                return
            held.retired = True
            idle = held.users == 0
        if idle:
            held.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._copy(job)

    def _copy(self, job: _Job) -> None:
        batch, op, target, items = job
        done = 0
        held: _Mappings | None = None
        try:
            held = self._acquire(target)
            maps = held.buffers
            path = "shm:mmap" if maps[0].view is not None else "shm:pio"
            for lbuf, lrel, rbuf, trel, length, count in merge_runs(items, maps):
                copy_run(op, lbuf, lrel, rbuf, trel, length)
                done += count
            self._release(target, held)
            held = None
            batch.settle([it[0] for it in items], path=path)
        except (KvctlError, OSError, ValueError, BufferError) as exc:
            if held is not None:
                self._release(target, held)
            cause = getattr(exc, "cause", None) or str(exc)
            _log.warning("shm copy to %s failed: %s", target.info.name, cause)
            if done:
                batch.settle([it[0] for it in items[:done]], path="shm")
            batch.settle([it[0] for it in items[done:]], path="shm", failure=SETTLE_FAILED,
                          cause=f"shm copy with segment {target.info.name!r} failed: {cause}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        with contextlib.suppress(RuntimeError):
            self._worker.join(10.0)


def merge_runs(items: list[Item], maps: list[LocalBuffer]
          ) -> list[tuple[LocalBuffer, int, LocalBuffer, int, int, int]]:
    """Merge items contiguous on both sides into single copies:
    (local buffer, offset, remote buffer, offset, length, items merged)."""
    runs: list[tuple[LocalBuffer, int, LocalBuffer, int, int, int]] = []
    for _slot, lbuf, lrel, bi, trel, _toff, length in items:
        rbuf = maps[bi]
        if runs:
            plbuf, plrel, prbuf, ptrel, plen, pcount = runs[-1]
            if (plbuf is lbuf and prbuf is rbuf and plrel + plen == lrel
                    and ptrel + plen == trel):
                runs[-1] = (plbuf, plrel, prbuf, ptrel, plen + length, pcount + 1)
                continue
        runs.append((lbuf, lrel, rbuf, trel, length, 1))
    return runs


def copy_run(op: OpCode, lbuf: LocalBuffer, lrel: int, rbuf: LocalBuffer, trel: int,
             length: int) -> None:
    """Copy one run between a local and a mapped remote buffer (READ: remote → local)."""
    read = op is OpCode.READ
    lview, rview = lbuf.view, rbuf.view
    if lview is not None and rview is not None:
        if length >= MEMMOVE_BYTES and isinstance(lbuf, MemoryBuffer) and isinstance(
                rbuf, MemoryBuffer):
            # ctypes releases the GIL for the copy: submitters keep running
            if read:
                _memmove(lbuf.address + lrel, rbuf.address + trel, length)
            else:
                _memmove(rbuf.address + trel, lbuf.address + lrel, length)
        elif read:
            lview[lrel : lrel + length] = rview[trel : trel + length]
        else:
            rview[trel : trel + length] = lview[lrel : lrel + length]
    elif lview is not None:
        if read:
            rbuf.read_into(trel, lview[lrel : lrel + length])
        else:
            rbuf.write_from(trel, lview[lrel : lrel + length])
    else:
        stage = memoryview(bytearray(length))
        if read:
            rbuf.read_into(trel, stage)
            lbuf.write_from(lrel, stage)
        else:
            lbuf.read_into(lrel, stage)
            rbuf.write_from(trel, stage)
