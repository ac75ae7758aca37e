"""The work an agent does for a client, one handler per job kind.

Each handler calls the library the single-host commands call: a bench target is
:class:`~kvctl.bench.target.serve.TargetSet` (kvctl's engine and the foreign ones), a
bench is :func:`~kvctl.bench.session.run_transfer_bench`, a runbook is
:func:`~kvctl.runbook.runner.run_runbook`, key manifests are
:func:`~kvctl.keys.manifest.emit`. Store masters and nodes run as ``kvctl store master`` /
``kvctl store node`` child processes (a crash there never takes the agent down, and a
killed node is seen as a process that exited); store clients run here.

Serving jobs (target, store master, store node) publish ``ready`` and hold until the client
deletes the job; a child that exits while held fails the job with its exit status.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvctl.cluster.agent import Handler, JobContext
from kvctl.cluster.protocol import (
    BENCH,
    KEYS,
    RUNBOOK,
    STORE_CLIENT,
    STORE_MASTER,
    STORE_NODE,
    TARGET,
    BenchParams,
    BenchResult,
    CheckRow,
    HostRecord,
    KeysParams,
    NodeView,
    RowSummary,
    RunbookParams,
    RunbookResult,
    StoreClientParams,
    StoreClientResult,
    StoreMasterParams,
    StoreMasterReady,
    StoreNodeParams,
    StoreNodeReady,
    SweepParams,
    TargetParams,
    TargetReady,
)
from kvctl.errors import KvctlError, UnavailableError, UsageError
from kvctl.net.advertise import join_host_port
from kvctl.units import format_size

if TYPE_CHECKING:
    from kvctl.bench.spec import Sweep
    from kvctl.topo.model import Topology

_log = logging.getLogger("kvctl.cluster")

#: Default limit on the memory one target or bench job may ask for.
DEFAULT_MAX_REGION_BYTES = 2 << 30
#: Seconds a store master or node child may take to print its address.
CHILD_START_S = 60.0
#: Objects per store batch call.
STORE_BATCH = 32


def sweep_from(params: SweepParams, *, max_region_bytes: int) -> Sweep:
    """The :class:`~kvctl.bench.spec.Sweep` a bench job asks for, validated.

    Raises:
        UsageError: an unknown op or transport, a size that is not positive, or a sweep
            needing more than ``max_region_bytes`` per side.
    """
    from kvctl.bench.spec import ModelSizing, Op, Sweep, parse_location, parse_transports

    try:
        ops = tuple(Op(o) for o in params.ops)
    except ValueError:
        raise UsageError(f"unknown op in {params.ops}", "use read and/or write") from None
    if not ops or not params.block_sizes_bytes or not params.batch_sizes:
        raise UsageError("the sweep is empty", "give ops, block sizes and batch sizes")
    if min(params.block_sizes_bytes) <= 0 or min(params.batch_sizes) <= 0 or \
            params.threads <= 0:
        raise UsageError("block size, batch size and threads must be positive",
                         "give positive sizes")
    sizing = None
    if params.model and params.tokens_per_block and params.kv_bytes_per_token:
        sizing = ModelSizing(params.model, params.kv_bytes_per_token, params.tokens_per_block,
                             params.block_sizes_bytes[0], "client")
    sweep = Sweep(
        ops=ops, transports=parse_transports(",".join(params.transports)),
        block_sizes_bytes=tuple(params.block_sizes_bytes),
        batch_sizes=tuple(params.batch_sizes), threads=params.threads,
        duration_s=params.duration_s, iterations=params.iterations,
        warmup_batches=params.warmup, verify=params.verify,
        local=parse_location(params.local_location, what="local location"),
        remote=parse_location(params.remote_location, what="remote location"), sizing=sizing)
    _check_region(sweep.region_bytes, max_region_bytes)
    return sweep


def _check_region(size: int, limit: int) -> None:
    if size > limit:
        raise UsageError(f"the job asks for {format_size(size)} of buffer, over this agent's "
                         f"limit of {format_size(limit)}",
                         "use smaller --block-size/--batch-size, or start the agent with a "
                         "larger --max-buffer")


# ---------------------------------------------------------------- bench target and initiator


def _check_own_address(host: HostRecord, address: str) -> None:
    if address not in host.addresses and address != host.address and \
            address not in (r.address for r in host.rails):
        raise UsageError(f"{address} is not an address of {host.hostname}",
                         f"its addresses: {', '.join(host.addresses) or 'none'}")


def serve_target(ctx: JobContext, *, max_region_bytes: int) -> None:
    """Serve a segment sized for the client's sweep until the job is deleted."""
    from kvctl.bench.target.kvctl import DEFAULT_SEGMENT, TargetSpec
    from kvctl.bench.target.serve import TargetSet

    p: TargetParams = ctx.params(TargetParams)
    _check_region(p.region_bytes, max_region_bytes)
    address = p.address or ctx.host.address
    if p.address is not None:
        _check_own_address(ctx.host, p.address)
    spec = TargetSpec(region_bytes=p.region_bytes, location=p.location,
                      listen=join_host_port(address, 0), metadata=None,
                      segment=DEFAULT_SEGMENT, token=ctx.token,
                      advertise=(address,))
    with TargetSet(spec, p.engines, p.transports) as targets:
        info = targets.info
        if info is None:  # pragma: no cover - start() sets it
            raise UnavailableError("the target did not start", "see the agent's log")
        ctx.ready(TargetReady(
            peer=info.peer, address=info.address or info.peer, engines=list(info.engines),
            skipped=[f"{s.engine}{'/' + s.transport if s.transport else ''}: {s.reason}"
                     for s in info.skipped]))
        ctx.hold()


def run_bench(ctx: JobContext, *, topology: Topology | None,
              max_region_bytes: int) -> BenchResult:
    """Run the sweep against the peer's target; the rows come back."""
    from kvctl.bench.session import (
        RunOptions,
        nic_rates_for,
        run_transfer_bench,
        validate_engines,
    )

    p: BenchParams = ctx.params(BenchParams)
    sweep = sweep_from(p.sweep, max_region_bytes=max_region_bytes)
    if p.local_address is not None:
        _check_own_address(ctx.host, p.local_address)
    options = RunOptions(engines=validate_engines(p.engines), peer=p.peer,
                         timeout_s=p.timeout_s, token=ctx.token,
                         nic_rates=nic_rates_for(p.sweep.local_location, topology),
                         local_addresses=(p.local_address,) if p.local_address else ())
    report = run_transfer_bench(sweep, options, on_progress=lambda _e: ctx.check_cancelled())
    rows = [RowSummary(
        engine=r.engine, op=r.op, transport=r.transport, block_size_bytes=r.block_size_bytes,
        batch_size=r.batch_size, gbps=r.throughput_gbytes_per_s, errors=r.errors,
        verified=r.verified, path=r.path, requests=r.requests, elapsed_s=r.elapsed_s,
        line_rate_gbps=r.line_rate_gbytes_per_s,
        batch_latency_p50_us=r.batch_latency_p50_us,
        batch_latency_p99_us=r.batch_latency_p99_us) for r in report.rows]
    skipped = [f"{s.engine}{'/' + s.transport if s.transport else ''}: {s.reason}"
               for s in report.skipped]
    return BenchResult(rows=rows, skipped=skipped)


# ---------------------------------------------------------------- runbook and keys


def run_book(ctx: JobContext, *, config_file: Path | None) -> RunbookResult:
    """The client's runbook (or the built-in single-host one) on this host."""
    from kvctl.runbook.model import parse_runbook
    from kvctl.runbook.runner import builtin_runbook, run_runbook
    from kvctl.yamlfile import load_yaml

    p: RunbookParams = ctx.params(RunbookParams)
    if p.yaml is None:
        book = builtin_runbook()
    else:
        source = f"runbook {p.name} (from the client)"
        book = parse_runbook(load_yaml(p.yaml, source, what="runbook"), source)
    report = run_runbook(book, config_file=config_file)
    return RunbookResult(name=report.name, passed=report.passed, duration_s=report.duration_s,
                         results=[CheckRow(r.check, r.verdict.value, r.measured, r.threshold,
                                           r.hint) for r in report.results])


def key_manifest(ctx: JobContext) -> dict[str, Any]:
    """This host's key manifest for the client's prompts (as ``verify-keys emit`` writes)."""
    from kvctl.keys.manifest import config_from_settings, emit, manifest_to_json
    from kvctl.keys.prompts import read_prompts
    from kvctl.keys.settings import KeysSettings

    p: KeysParams = ctx.params(KeysParams)
    config = config_from_settings(KeysSettings(profile=p.profile, block_size=p.block_size))
    with tempfile.TemporaryDirectory(prefix="kvctl-agent-keys-") as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text(p.prompts_jsonl, encoding="utf-8")
        prompts = read_prompts(path)
    return manifest_to_json(emit(config, prompts))


# ---------------------------------------------------------------- store roles


class _Child:
    """A ``kvctl`` child process whose first JSON document is its address."""

    def __init__(self, what: str, args: Sequence[str], token: str | None) -> None:
        self.what = what
        env = dict(os.environ)
        if token:
            env["KVCTL_TOKEN"] = token
        self._err: IO[bytes] = tempfile.TemporaryFile(prefix="kvctl-agent-child-")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "kvctl", *args, "--json"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env, start_new_session=True)

    def document(self, timeout_s: float = CHILD_START_S) -> dict[str, Any]:
        """The child's first JSON document (bounded by ``timeout_s``).

        Raises:
            UnavailableError: it exited or printed nothing in time (its stderr's end named).
        """
        stdout = self.proc.stdout
        if stdout is None:  # pragma: no cover - always piped
            raise UnavailableError(f"{self.what} has no output", None)
        deadline = time.monotonic() + timeout_s
        data = b""
        while b"\n}\n" not in data and time.monotonic() < deadline:
            ready, _, _ = select.select([stdout], [], [], 0.2)
            if ready:
                chunk = os.read(stdout.fileno(), 65536)
                if not chunk:
                    break
                data += chunk
        if b"\n}\n" in data:
            try:
                doc = json.loads(data[:data.index(b"\n}\n") + 3])
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                return doc
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)  # its output ended: let its exit status arrive
        raise UnavailableError(f"{self.what} did not start: {self.exit_reason() or 'no address'}"
                               f"{self._stderr_tail()}", "run the same kvctl command by hand "
                               "on that host to see why")

    def exit_reason(self) -> str | None:
        """Why the child is gone (``exited 1``, ``killed by SIGKILL``), ``None`` if running."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            with_name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
            return f"{self.what} was killed by {with_name}"
        return f"{self.what} exited {code}"

    def _stderr_tail(self) -> str:
        try:
            self._err.seek(0)
            text = self._err.read()[-600:].decode(errors="replace").strip()
        except OSError:
            return ""
        return f" ({text.splitlines()[-1]})" if text else ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; reaped. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


def store_master(ctx: JobContext) -> None:
    """``kvctl store master`` on this host until the job is deleted."""
    p: StoreMasterParams = ctx.params(StoreMasterParams)
    address = p.address or ctx.host.address
    child = _Child("store master", ["store", "master", "--listen", join_host_port(address, 0)],
                   ctx.token)
    try:
        doc = child.document()
        ctx.ready(StoreMasterReady(master=str(doc["master"]), pid=child.proc.pid))
        ctx.hold(child.exit_reason)
    finally:
        child.stop()


def store_node(ctx: JobContext, *, max_region_bytes: int) -> None:
    """``kvctl store node`` for the client's master until the job is deleted."""
    p: StoreNodeParams = ctx.params(StoreNodeParams)
    _check_region(p.capacity_bytes, max_region_bytes)
    child = _Child(f"store node {p.node_id}",
                   ["store", "node", "--master", p.master, "--capacity", str(p.capacity_bytes),
                    "--node-id", p.node_id], ctx.token)
    try:
        doc = child.document()
        ctx.ready(StoreNodeReady(node_id=str(doc["node_id"]), endpoint=str(doc["endpoint"]),
                                 pid=child.proc.pid))
        ctx.hold(child.exit_reason)
    finally:
        child.stop()


def object_content(key: str, size: int) -> bytes:
    """The bytes a cluster smoke stores under ``key``: a function of the key, so any host can
    check what it reads without being sent the expected bytes."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def store_client(ctx: JobContext, *, max_region_bytes: int) -> StoreClientResult:
    """Write, read back (every byte checked) or report the master's nodes."""
    from kvctl.store.client import StoreClient

    p: StoreClientParams = ctx.params(StoreClientParams)
    _check_region(p.count * p.size_bytes * max(1, len(p.read_prefixes)), max_region_bytes)
    errors: list[str] = []
    ok = failed = 0
    with StoreClient(p.master, token=ctx.token, replicas=p.replicas, timeout_s=10.0) as client:
        if p.phase == "status":
            st = client.status()
            return StoreClientResult(ok=len(st.nodes), failed=0, nodes=[
                NodeView(n.node_id, n.alive, n.objects, n.used_bytes, n.endpoint)
                for n in st.nodes])
        if p.phase == "write":
            keys = [f"{p.prefix}/{i}" for i in range(p.count)]
            for start in range(0, len(keys), STORE_BATCH):
                chunk = keys[start:start + STORE_BATCH]
                answers = client.batch_put([(k, object_content(k, p.size_bytes))
                                            for k in chunk])
                for key, err in zip(chunk, answers, strict=True):
                    if err is None:
                        ok += 1
                    else:
                        failed += 1
                        errors.append(f"put {key}: {err.cause}")
        elif p.phase == "read":
            keys = [f"{pre}/{i}" for pre in p.read_prefixes for i in range(p.count)]
            for start in range(0, len(keys), STORE_BATCH):
                chunk = keys[start:start + STORE_BATCH]
                for key, got in zip(chunk, client.batch_get(chunk), strict=True):
                    if isinstance(got, KvctlError):
                        failed += 1
                        errors.append(f"get {key}: {got.cause}")
                    elif got != object_content(key, p.size_bytes):
                        failed += 1
                        errors.append(f"get {key}: {len(got)} bytes that differ from what "
                                      "was put")
                    else:
                        ok += 1
        else:
            raise UsageError(f"store-client phase {p.phase!r} is unknown",
                             "use write, read or status")
    return StoreClientResult(ok=ok, failed=failed, errors=errors[:5])


def default_handlers(*, topology: Topology | None = None, config_file: Path | None = None,
                     max_region_bytes: int = DEFAULT_MAX_REGION_BYTES) -> dict[str, Handler]:
    """Every job kind, backed by the real library."""
    return {
        TARGET: lambda ctx: serve_target(ctx, max_region_bytes=max_region_bytes),
        BENCH: lambda ctx: run_bench(ctx, topology=topology, max_region_bytes=max_region_bytes),
        RUNBOOK: lambda ctx: run_book(ctx, config_file=config_file),
        KEYS: key_manifest,
        STORE_MASTER: store_master,
        STORE_NODE: lambda ctx: store_node(ctx, max_region_bytes=max_region_bytes),
        STORE_CLIENT: lambda ctx: store_client(ctx, max_region_bytes=max_region_bytes),
    }
