"""kvctl's own transfer engine (:mod:`kvctl.transfer.engine`) as a benchmark driver.

The local region is an anonymous mapping registered with ``register_memory`` (``cpu``), a
file segment (``file:PATH``) or a GPU segment (``cuda:N``: the engine's own GPU memory, the
one its transports reach by dma-buf, peermem or staging; verification patterns go through a
host copy of it, moved in and out with the engine's ``write_local``/``read_local``). One
initiator engine runs at a time, opened with the transport under test; the target is an
:class:`~kvctl.bench.target.kvctl.EmbeddedTarget` on loopback unless ``peer`` names one.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from kvctl.bench.engines.base import BatchOutcome, DriverPlan, EngineDriver, PathInfo
from kvctl.bench.region import check_gpu
from kvctl.bench.spec import Op
from kvctl.bench.target.kvctl import DEFAULT_SEGMENT, EmbeddedTarget, TargetSpec, rdma_options
from kvctl.errors import UsageError
from kvctl.metadata.base import MetadataError
from kvctl.net.advertise import host_of
from kvctl.net.bind import is_loopback
from kvctl.units import format_size

_log = logging.getLogger("kvctl.bench")


def describe_paths(paths: Iterable[str]) -> str:
    """Summarise per-request paths: ``any->10.0.0.2:7400#0..#3`` becomes
    ``any->10.0.0.2:7400 (4 paths)``; sliced requests list several, comma-joined."""
    counts: dict[str, set[str]] = {}
    for joined in paths:
        for path in joined.split(","):
            base, _, index = path.strip().rpartition("#")
            if not base:
                base, index = path.strip(), ""
            counts.setdefault(base, set()).add(index)
    parts = []
    for base, indices in sorted(counts.items()):
        n = len(indices - {""})
        parts.append(f"{base} ({n} path{'s' if n != 1 else ''})" if n else base)
    return ", ".join(parts) if parts else "-"


class KvctlDriver(EngineDriver):
    """Drives :class:`kvctl.transfer.engine.TransferEngine`."""

    name: ClassVar[str] = "kvctl"
    install_hint: ClassVar[str] = "kvctl's engine is built in"

    def __init__(self, *, segment: str = DEFAULT_SEGMENT, token: str | None = None) -> None:
        self.segment = segment
        self.token = token
        self._plan: DriverPlan | None = None
        self._target: EmbeddedTarget | None = None
        self._metadata_url = ""
        self._mm: mmap.mmap | None = None
        self._file_fd: int | None = None
        self._engine: Any = None
        self._engine_transport: str | None = None
        self._local_name = ""
        self._poke_name = ""
        self._poke_buf = bytearray(4096)
        self._describe_next = False
        self._requests: dict[tuple[str, int, int, int], list[Any]] = {}

    # ------------------------------------------------------------------ setup

    def start(self, plan: DriverPlan) -> None:
        self._plan = plan
        if plan.token is not None:
            self.token = plan.token
        if plan.local.kind == "cuda":
            check_gpu(plan.local.index)
        if plan.peer is None:
            self._target = EmbeddedTarget(TargetSpec(
                region_bytes=plan.region_bytes, location=str(plan.remote), segment=self.segment,
                token=self.token, nics=plan.nics, gid_index=plan.gid_index))
            info = self._target.start()
            self._metadata_url = info.metadata_url
        elif plan.metadata is not None:
            self._metadata_url = plan.metadata
            self.segment = plan.peer
        else:
            self._metadata_url = f"http://{plan.peer}"
        if plan.local.kind == "file" and plan.local.path is not None:
            self._open_file(plan.local.path, plan.region_bytes)
        else:
            self._mm = mmap.mmap(-1, plan.region_bytes)

    def _open_file(self, path: Path, size: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except OSError as exc:
            raise UsageError(f"cannot use local file {path}: {exc.strerror or exc}",
                             "give --local-location file:PATH on a writable local disk"
                             ) from exc
        self._file_fd = fd

    def prepare(self, transport: str) -> PathInfo:
        from kvctl.transfer.engine import TransferEngine

        plan = self._require_plan()
        self._close_engine()
        tag = f"{os.getpid()}-{transport}"
        # The initiator's own buffers are only ever local sides: its target server (started
        # by registering them) stays on loopback, whatever host the metadata service is on.
        engine = TransferEngine(f"kvctl-bench-init-{tag}", metadata=self._metadata_url,
                                transport=transport, timeout_s=plan.timeout_s, token=self.token,
                                listen="127.0.0.1:0", advertise=["127.0.0.1"],
                                nics=plan.local_addresses,
                                rdma=rdma_options(plan.nics, plan.gid_index, plan.timeout_s))
        try:
            self._local_name = f"kvctl-bench-local-{tag}"
            if self._file_fd is not None and plan.local.path is not None:
                engine.register_segment(self._local_name, plan.region_bytes, kind="file",
                                        path=plan.local.path)
            elif plan.local.kind == "cuda":
                engine.register_segment(self._local_name, plan.region_bytes, kind="gpu",
                                        location=str(plan.local))
            else:
                engine.register_memory(self._local_name, [self._mm], location=str(plan.local))
            self._poke_name = f"kvctl-bench-poke-{tag}"
            engine.register_memory(self._poke_name, [self._poke_buf])
            handle = engine.open_segment(self.segment)
        except MetadataError as exc:
            engine.close()
            if plan.peer is not None and plan.metadata is None and "cannot reach" in exc.cause:
                port = plan.peer.rpartition(":")[2] or "7400"
                raise MetadataError(
                    f"cannot reach the bench target at {plan.peer}: "
                    f"{exc.cause.rpartition(': ')[2]}",
                    "start it on that host: kvctl bench transfer --role target --listen "
                    f"0.0.0.0:{port} (or sh examples/runbooks/two-hosts-target.sh); check "
                    "the address, the port and firewalls between the hosts") from None
            raise
        except BaseException:
            engine.close()
            raise
        if handle.size_bytes < plan.region_bytes:
            engine.close()
            raise UsageError(
                f"target segment {self.segment!r} has {format_size(handle.size_bytes)}, the "
                f"sweep needs {format_size(plan.region_bytes)} (largest block x largest batch "
                "x threads)",
                "run the initiator command the target printed (it has the target's "
                "--block-size/--batch-size/--threads), or restart the target with this sweep's")
        self._engine, self._engine_transport = engine, transport
        self._requests.clear()
        self._describe_next = True
        address = handle.addresses[0] if handle.addresses else "?"
        if handle.transport == "shm":
            path = f"shm same-host ({handle.name})"
        else:
            path = f"{handle.transport} -> {address}"
        loopback = handle.same_host and (handle.transport == "shm" or is_loopback(host_of(address)))
        return PathInfo(handle.transport, path, loopback)

    # ------------------------------------------------------------------ batches

    def _reqs(self, op: Op, block: int, batch: int, thread: int) -> list[Any]:
        key = (op.value, block, batch, thread)
        cached = self._requests.get(key)
        if cached is None:
            from kvctl.transfer.batch import OpCode, TransferRequest

            plan = self._require_plan()
            code = OpCode.READ if op is Op.READ else OpCode.WRITE
            base = thread * plan.thread_stride_bytes
            cached = [TransferRequest(code, self._local_name, base + i * block, self.segment,
                                      base + i * block, block) for i in range(batch)]
            self._requests[key] = cached
        return cached

    def run_batch(self, transport: str, op: Op, block_size_bytes: int, batch_size: int,
                  thread_index: int) -> BatchOutcome:
        engine = self._engine_for(transport)
        batch = engine.allocate_batch(batch_size)
        engine.submit(batch, self._reqs(op, block_size_bytes, batch_size, thread_index))
        result = engine.wait(batch, self._require_plan().timeout_s)
        path = None
        if self._describe_next or result.failed or result.timed_out:
            self._describe_next = False
            path = describe_paths(s.path for s in engine.status(batch))
        if result.failed or result.timed_out:
            _log.warning("batch %s: %d failed, %d timed out: %s", op.value, result.failed,
                         result.timed_out, result.first_cause)
        engine.free_batch(batch)
        return BatchOutcome(errors=result.failed + result.timed_out, retries=result.retries,
                            path=path, cause=result.first_cause)

    def _engine_for(self, transport: str) -> Any:
        if self._engine is None or self._engine_transport != transport:
            self.prepare(transport)
        return self._engine

    def local_view(self, offset: int, length: int) -> memoryview:
        if self._mm is None:
            raise UsageError("driver not started", "call start() first")
        return memoryview(self._mm)[offset : offset + length]

    def sync_local(self, offset: int, length: int) -> None:
        """GPU regions: copy the host view's bytes into GPU memory (files share the view)."""
        if self._require_plan().local.kind == "cuda" and self._engine is not None:
            self._engine.write_local(self._local_name, offset, self.local_view(offset, length))

    def refresh_local(self, offset: int, length: int) -> None:
        """GPU regions: copy GPU memory into the host view (files share the view)."""
        if self._require_plan().local.kind == "cuda" and self._engine is not None:
            self._engine.read_local(self._local_name, offset, self.local_view(offset, length))

    def poke_remote(self, transport: str, offset: int, data: bytes) -> None:
        from kvctl.transfer.batch import OpCode, TransferRequest

        engine = self._engine_for(transport)
        if len(data) > 4096:
            raise UsageError("poke_remote writes at most 4096 bytes", "split the data")
        self._poke_buf[: len(data)] = data  # registered without copying: the engine sees it
        engine.transfer([TransferRequest(OpCode.WRITE, self._poke_name, 0, self.segment,
                                         offset, len(data))])

    # ------------------------------------------------------------------ teardown

    def _require_plan(self) -> DriverPlan:
        if self._plan is None:
            raise UsageError("driver not started", "call start() first")
        return self._plan

    def _close_engine(self) -> None:
        engine, self._engine = self._engine, None
        self._engine_transport = None
        if engine is not None:
            engine.close()

    def close(self) -> None:
        self._close_engine()
        target, self._target = self._target, None
        if target is not None:
            target.close()
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
        fd, self._file_fd = self._file_fd, None
        if fd is not None:
            os.close(fd)
