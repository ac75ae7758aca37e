"""``kvctl store smoke``: an end-to-end validation of a store, as a list of checks.

Against kvctl's own store (embedded by default: a master and two nodes started in this
process, one with an SSD tier, small enough to test eviction) or an external master, or
against a Mooncake master through :mod:`kvctl.store.mooncake`. Every value is random and
verified byte for byte; absence must surface as ``ObjectNotFoundError``, never as bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvctl.errors import KvctlError, NotFoundError
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.wording import plural

if TYPE_CHECKING:
    from kvctl.store.mooncake import MooncakeStore
    from kvctl.store.mooncake_http import MooncakeMasterStatus

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)


class SmokeBackend(Protocol):
    """The operations the portable checks need (StoreClient and the Mooncake adapter)."""

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None: ...
    def get(self, key: str) -> bytes: ...
    def batch_put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]
                  ) -> list[KvctlError | None]: ...
    def batch_get(self, keys: Sequence[str]) -> list[bytes | KvctlError]: ...
    def exists(self, key: str) -> bool: ...
    def remove(self, key: str) -> bool: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One smoke check.

    Attributes:
        name: check name.
        status: ``pass``, ``fail`` or ``skip``.
        detail: what was verified, why it failed, or why it was skipped.
        duration_s: wall time, seconds.
        bytes_moved: payload bytes put and got.
    """

    name: str
    status: str
    detail: str
    duration_s: float
    bytes_moved: int = 0


@dataclasses.dataclass(frozen=True)
class SegmentTouch:
    """A segment (a storage process's memory) that held objects the smoke wrote.

    Attributes:
        name: the segment's name as the master reports it (its endpoint when the master's
            metrics endpoint was not read).
        endpoint: the transfer endpoint the replicas were read from.
        objects: how many of the smoke's objects had a replica there.
    """

    name: str
    endpoint: str
    objects: int


@dataclasses.dataclass(frozen=True)
class SmokeReport:
    """All checks of one run.

    Attributes:
        backend: ``kvctl`` or ``mooncake``.
        target: the master checked (or ``embedded ...``).
        checks: one result per check, in the order run.
        segments: segments that held the smoke's objects (Mooncake; empty for kvctl, whose
            ``failover`` check names the nodes).
        metrics_url: the Mooncake master's HTTP endpoint read, if it was.
    """

    backend: str
    target: str
    checks: list[CheckResult]
    segments: tuple[SegmentTouch, ...] = ()
    metrics_url: str | None = None

    @property
    def failed(self) -> list[CheckResult]:
        """Checks that failed."""
        return [c for c in self.checks if c.status == "fail"]


class _FailError(Exception):
    """A check's verdict is negative (message says why)."""


class _SkipError(Exception):
    """A check does not apply to this target (message says why)."""


def _value(size: int) -> bytes:
    return os.urandom(size)


class _Run:
    def __init__(self, backend: SmokeBackend, *, new_client: Callable[[], SmokeBackend],
                 prefix: str, progress: Callable[[str], None] | None) -> None:
        self.backend = backend
        self.new_client = new_client
        self.prefix = prefix
        self.progress = progress
        self.keys: set[str] = set()
        self.checks: list[CheckResult] = []
        self.moved = 0

    def key(self, name: str) -> str:
        key = f"{self.prefix}{name}"
        self.keys.add(key)
        return key

    def check(self, name: str, fn: Callable[[], str]) -> None:
        if self.progress is not None:
            self.progress(name)
        self.moved = 0
        start = time.perf_counter()
        try:
            detail, status = fn(), "pass"
        except _SkipError as exc:
            detail, status = str(exc), "skip"
        except _FailError as exc:
            detail, status = str(exc), "fail"
        except KvctlError as exc:
            detail, status = f"{type(exc).__name__}: {exc.cause}", "fail"
        self.checks.append(CheckResult(name, status, detail, time.perf_counter() - start,
                                       self.moved))

    def roundtrip(self, client: SmokeBackend, key: str, value: bytes) -> None:
        client.put(key, value)
        got = client.get(key)
        self.moved += 2 * len(value)
        if got != value:
            raise _FailError(f"{key}: got {len(got)} bytes that differ from the {len(value)} put")


def _single(run: _Run) -> str:
    for size in SIZES:
        run.roundtrip(run.backend, run.key(f"single-{size}"), _value(size))
    return "put/get " + ", ".join(_fmt(s) for s in SIZES) + " verified byte for byte"


def _batch(run: _Run) -> str:
    for count, size in ((32, 64 * KiB), (8, 1 * MiB)):
        items = [(run.key(f"batch-{size}-{i}"), _value(size)) for i in range(count)]
        errors = [e for e in run.backend.batch_put(items) if e is not None]
        if errors:
            raise _FailError(f"batch_put of {count} x {_fmt(size)}: {errors[0]}")
        got = run.backend.batch_get([k for k, _ in items])
        run.moved += 2 * count * size
        for (key, value), result in zip(items, got, strict=True):
            if isinstance(result, KvctlError):
                raise _FailError(f"batch_get {key}: {result}")
            if result != value:
                raise _FailError(f"batch_get {key}: bytes differ")
    return "batch_put/batch_get 32 x 64 KiB and 8 x 1 MiB verified"


def _concurrent(run: _Run, clients: int = 4, ops: int = 16) -> str:
    failures: list[str] = []
    moved = [0]
    lock = threading.Lock()

    def worker(w: int) -> None:
        try:
            client = run.new_client()
        except KvctlError as exc:
            with lock:
                failures.append(f"client {w}: {exc.cause}")
            return
        try:
            for i in range(ops):
                key = run.key(f"conc-{w}-{i}")
                value = _value(64 * KiB + 4096 * w + i)
                client.put(key, value)
                if client.get(key) != value:
                    with lock:
                        failures.append(f"client {w}: {key} read back different bytes")
                    return
                with lock:
                    moved[0] += 2 * len(value)
        except KvctlError as exc:
            with lock:
                failures.append(f"client {w}: {type(exc).__name__}: {exc.cause}")
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    run.moved = moved[0]
    if failures:
        raise _FailError("; ".join(failures[:3]))
    return f"{clients} clients x {ops} put+get in parallel, verified"


def _exists_remove(run: _Run) -> str:
    key = run.key("exists")
    run.backend.put(key, b"x" * 100)
    if not run.backend.exists(key):
        raise _FailError(f"exists({key}) is False right after put")
    if not run.backend.remove(key):
        raise _FailError(f"remove({key}) returned False for a stored key")
    if run.backend.exists(key):
        raise _FailError(f"exists({key}) is True after remove")
    if run.backend.remove(key):
        raise _FailError(f"second remove({key}) returned True")
    for probe in (key, run.key("never-stored")):
        try:
            data = run.backend.get(probe)
        except NotFoundError:
            continue
        raise _FailError(f"get({probe}) of an absent key returned {len(data)} bytes, not NotFound")
    return "exists/remove semantics hold; absent keys raise NotFound (not a failure)"


def _prefix() -> str:
    """The key prefix of one smoke run: every key it writes starts with it."""
    return f"smoke/{secrets.token_hex(4)}/"


def run_portable(backend: SmokeBackend, *, new_client: Callable[[], SmokeBackend],
                 progress: Callable[[str], None] | None = None) -> tuple[_Run, list[str]]:
    """The checks every backend runs; returns the run (for more checks) and its keys."""
    run = _Run(backend, new_client=new_client, prefix=_prefix(), progress=progress)
    _portable_checks(run)
    return run, sorted(run.keys)


def _portable_checks(run: _Run) -> None:
    run.check("single", lambda: _single(run))
    run.check("batch", lambda: _batch(run))
    run.check("concurrent", lambda: _concurrent(run))
    run.check("exists-remove", lambda: _exists_remove(run))


# ---------------------------------------------------------------- kvctl-only checks


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _failover(run: _Run, client: StoreClient, stop_node: Callable[[str], None] | None,
              replicated: Callable[[], StoreClient]) -> str:
    nodes = [n for n in client.status().nodes if n.alive]
    if len(nodes) < 2:
        raise _SkipError(f"needs 2 or more nodes ({len(nodes)} live)")
    with replicated() as c2:
        key = run.key("failover")
        value = _value(256 * KiB)
        c2.put(key, value)
        info = c2.stat(key)
        if len(set(info.replicas)) != 2:
            raise _FailError(f"{key}: replicas on {info.replicas}, expected 2 distinct nodes")
        if stop_node is None:
            if c2.get(key) != value:
                raise _FailError(f"{key}: bytes differ")
            raise _SkipError("external store: replicas placed on distinct nodes "
                        f"({', '.join(info.replicas)}); stopping a node is left to operators")
        # Stop a node without an SSD tier if there is one (the SSD check needs the other).
        plain = {n.node_id for n in nodes if n.ssd_policy == "off"}
        victim = next((r for r in info.replicas if r in plain), info.replicas[0])
        stop_node(victim)
        got = c2.get(key)
        run.moved += 2 * len(value)
        if got != value:
            raise _FailError(f"{key}: bytes differ after node {victim} stopped")
        # The next checks place objects: none may land on the stopped node while the master
        # still takes it for alive (a loaded machine stretches that window past the checks'
        # first puts), so it is dropped now, as 'kvctl store node rm' does.
        client.drop_node(victim)
        if _is_alive(client, victim):
            raise _FailError(f"{victim} dropped after it stopped, but the master lists it alive")
    return (f"replicas on {info.replicas[0]} and {info.replicas[1]}; read back after "
            f"stopping {victim}, then dropped it")


def _is_alive(client: StoreClient, node_id: str) -> bool:
    return any(n.node_id == node_id and n.alive for n in client.status().nodes)


def _eviction(run: _Run, client: StoreClient, *, budget_bytes: int = 256 * MiB) -> str:
    status = client.status()
    capacity = status.capacity_bytes
    if capacity * 1.5 > budget_bytes:
        most = budget_bytes * 2 // 3 // MiB * MiB
        raise _SkipError(f"filling a {_fmt(capacity)} store past eviction takes writing "
                         f"{_fmt(int(capacity * 1.5))}, over this check's {_fmt(budget_bytes)} "
                         f"budget; run it against a store of at most {_fmt(most)} (or without "
                         "--master: the embedded one)")
    size = 1 * MiB
    count = int(capacity * 1.5) // size
    keys = [run.key(f"evict-{i}") for i in range(count)]
    values: dict[str, bytes] = {}
    for start in range(0, count, 16):
        chunk = [(k, _value(size)) for k in keys[start:start + 16]]
        errors = [e for e in client.batch_put(chunk) if e is not None]
        if errors:
            raise _FailError(f"put under pressure failed: {errors[0]}")
        values.update(chunk)
    evicted = ok = 0
    for start in range(0, count, 16):
        got = client.batch_get(keys[start:start + 16])
        for key, result in zip(keys[start:start + 16], got, strict=True):
            if isinstance(result, ObjectNotFoundError):
                if not result.evicted:
                    raise _FailError(f"{key}: missing but not reported as evicted")
                evicted += 1
            elif isinstance(result, KvctlError):
                raise _FailError(f"{key}: {type(result).__name__}: {result.cause}")
            elif result != values[key]:
                raise _FailError(f"{key}: evicted store returned corrupted bytes")
            else:
                ok += 1
    run.moved = count * size + ok * size
    after = client.status()
    if after.evictions <= status.evictions:
        raise _FailError(f"wrote {_fmt(count * size)} into {_fmt(capacity)}: nothing evicted")
    return (f"{count} x 1 MiB into {_fmt(capacity)}: {ok} intact, {evicted} reported evicted "
            f"({after.evictions - status.evictions} DRAM evictions)")


class _SsdProbe:
    def __init__(self) -> None:
        self.key = ""
        self.value = b""


def _ssd_prepare(run: _Run, client: StoreClient, probe: _SsdProbe) -> str:
    ssd_nodes = {n.node_id for n in client.status().nodes if n.alive and n.ssd_policy != "off"}
    if not ssd_nodes:
        raise _SkipError("no node has an SSD tier")
    for i in range(16):
        key, value = run.key(f"ssd-{i}"), _value(1 * MiB)
        client.put(key, value)
        info = client.stat(key)
        if set(info.replicas) & ssd_nodes:
            probe.key, probe.value = key, value
            break
    else:
        raise _SkipError("could not place an object on an SSD node in 16 tries")
    if not _wait_for(lambda: "ssd" in client.stat(probe.key).tier, 10.0):
        write_back = all(n.ssd_policy == "write-back" for n in client.status().nodes
                         if n.node_id in ssd_nodes)
        if not write_back:
            raise _FailError(f"{probe.key} not persisted to SSD within 10 s (write-through)")
    return f"{probe.key} on {client.stat(probe.key).tier}"


def _tiers(tier: str) -> set[str]:
    return set(tier.split("+"))


def _evict_probe(run: _Run, client: StoreClient, probe: _SsdProbe, *,
                 budget_bytes: int = 256 * MiB) -> str:
    """Push the probe out of DRAM (1 MiB objects, LRU evicts the oldest first) so the read
    that follows has only its SSD copy to come from; its tier before that read."""
    tier = client.stat(probe.key).tier
    capacity = client.status().capacity_bytes
    if "dram" in _tiers(tier) and capacity * 1.5 > budget_bytes:
        # as the eviction check: skip before writing what could not push it out anyway
        most = budget_bytes * 2 // 3 // MiB * MiB
        raise _SkipError(f"pushing {probe.key} out of a {_fmt(capacity)} store's DRAM takes "
                         f"writing up to {_fmt(int(capacity * 1.5))}, over this check's "
                         f"{_fmt(budget_bytes)} budget: the SSD read path was not exercised; "
                         f"run it against a store of at most {_fmt(most)} (or without "
                         "--master: the embedded one)")
    limit = min(budget_bytes, int(capacity * 1.5))
    written = 0
    while "dram" in _tiers(tier) and written < limit:
        chunk = [(run.key(f"ssd-push-{written // MiB + i}"), _value(1 * MiB))
                 for i in range(16)]
        errors = [e for e in client.batch_put(chunk) if e is not None]
        if errors:
            raise _FailError(f"put while pushing {probe.key} out of DRAM failed: {errors[0]}")
        written += len(chunk) * MiB
        run.moved += len(chunk) * MiB
        tier = client.stat(probe.key).tier
    if "dram" in _tiers(tier):
        raise _SkipError(f"{probe.key} still in DRAM ({tier}) after writing {_fmt(written)} "
                         f"into {_fmt(capacity)}: the SSD read path was not exercised; run "
                         "it against a smaller store (or without --master: the embedded one)")
    return tier


def _ssd_verify(run: _Run, client: StoreClient, probe: _SsdProbe) -> str:
    """Read the probe with no DRAM copy left, so its bytes come from its SSD copy (loaded
    into DRAM by the master, then read): pass only when that is what happened."""
    if not probe.key:
        raise _SkipError("no SSD object was placed")
    before = _evict_probe(run, client, probe)
    if "ssd" not in _tiers(before):
        raise _FailError(f"{probe.key}: out of DRAM but no SSD copy left ({before})")
    got = client.get(probe.key)
    run.moved += len(got)
    if got != probe.value:
        raise _FailError(f"{probe.key}: bytes read back from its SSD copy differ")
    after = client.stat(probe.key).tier
    if "dram" not in _tiers(after):
        raise _FailError(f"{probe.key}: read from {before}, but not loaded back into DRAM "
                         f"({after}): the SSD read path was not taken")
    return (f"evicted from DRAM ({before}), loaded from SSD and read back byte for byte "
            f"(now {after})")


def run_kvctl(master: str | None = None, *, token: str | None = None,
              progress: Callable[[str], None] | None = None,
              transport: str = "auto") -> SmokeReport:
    """Run every check against ``master``, or against an embedded store started here;
    every client moves bytes over ``transport`` (``auto``, ``shm`` or ``tcp``)."""
    embedded: _EmbeddedCluster | None = None
    if master is None:
        embedded = _EmbeddedCluster()
        master = embedded.address
    try:
        def new_client(replicas: int = 1) -> StoreClient:
            return StoreClient(master, token=token, transport=transport, replicas=replicas)

        client = new_client()
        try:
            run, _ = run_portable(client, new_client=new_client,
                                  progress=progress)
            probe = _SsdProbe()
            run.check("ssd-persist", lambda: _ssd_prepare(run, client, probe))
            run.check("failover", lambda: _failover(
                run, client, embedded.stop_node if embedded else None,
                lambda: new_client(replicas=2)))
            run.check("eviction", lambda: _eviction(run, client))
            run.check("ssd-read", lambda: _ssd_verify(run, client, probe))
            run.check("shared-tier", lambda: _shared_tier(run, client, new_client, embedded))
            for start in range(0, len(run.keys), 1024):
                client.batch_remove(sorted(run.keys)[start:start + 1024])
        finally:
            client.close()
    finally:
        if embedded is not None:
            embedded.close()
    return SmokeReport("kvctl", "embedded" if embedded else master, run.checks)


def _shared_tier(run: _Run, client: StoreClient, new_client: Callable[[], StoreClient],
                 embedded: _EmbeddedCluster | None) -> str:
    from kvctl.store.sharedtier import smokecheck

    try:
        return smokecheck.run_check(
            client, run.key, new_client,
            functools.partial(embedded.writers.start, embedded.address) if embedded else None,
            sorted(k for k in run.keys if "evict-" in k))
    except smokecheck.SharedCheckSkipError as exc:
        raise _SkipError(str(exc)) from None
    except smokecheck.SharedCheckFailError as exc:
        raise _FailError(str(exc)) from None


#: The embedded store's node timeout, seconds (see :class:`_EmbeddedCluster`).
NODE_TIMEOUT_S = 10.0


class _EmbeddedCluster:
    """Master + two 48 MiB nodes (one with a write-through SSD tier) in this process, a
    write-through shared tier in a temporary directory, and (for the shared-tier check) a
    16 MiB node in a child process that the check kills."""

    def __init__(self) -> None:
        from kvctl.store.sharedtier.config import SharedTierConfig
        from kvctl.store.sharedtier.smokecheck import Writers

        self._tmp = tempfile.TemporaryDirectory(prefix="kvctl-smoke-")
        # A node timeout well above the heartbeat (0.25 s): on a loaded machine a node's
        # heartbeat thread, in this process, may wait seconds for the interpreter; the
        # checks that stop a node drop it themselves.
        self.server = MasterServer(MasterCore(
            MasterConfig(node_timeout_s=NODE_TIMEOUT_S), shared_tier=SharedTierConfig(
                Path(self._tmp.name) / "shared", policy="write-through")))
        self.nodes: dict[str, StorageNode] = {}
        self.writers = Writers()
        try:
            for nid, ssd in (("smoke-a", Path(self._tmp.name)), ("smoke-b", None)):
                self.nodes[nid] = StorageNode(self.server.address, node_id=nid,
                                              capacity_bytes=48 * MiB, ssd_dir=ssd,
                                              heartbeat_s=0.25)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self.server.address

    def stop_node(self, node_id: str) -> None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            node.close()

    def close(self) -> None:
        self.writers.kill_all()
        for node in self.nodes.values():
            node.close()
        self.nodes.clear()
        self.server.close()
        self._tmp.cleanup()


def _fmt(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


class _Shared:
    """One Mooncake client shared by the concurrency check's threads (it is thread-safe;
    several ``MooncakeDistributedStore`` instances in one process are not supported)."""

    def __init__(self, inner: SmokeBackend) -> None:
        self._inner = inner

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        self._inner.put(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def batch_put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]
                  ) -> list[KvctlError | None]:
        return self._inner.batch_put(items)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | KvctlError]:
        return self._inner.batch_get(keys)

    def exists(self, key: str) -> bool:
        return self._inner.exists(key)

    def remove(self, key: str) -> bool:
        return self._inner.remove(key)

    def close(self) -> None:
        pass


#: Checks of kvctl's store that the Mooncake smoke reports as skipped.
_KVCTL_ONLY = ("ssd-persist", "failover", "eviction", "ssd-read")


def run_mooncake(master: str | None = None, *, metrics_url: str | None = None,
                 progress: Callable[[str], None] | None = None) -> SmokeReport:
    """The portable checks against a Mooncake master through ``MooncakeDistributedStore``
    over TCP, safe against a production cluster.

    Against ``master`` the client mounts no segment (``global_segment_size=0``), so objects
    land in the cluster's own storage; the master's HTTP endpoint (``metrics_url``, default
    ``http://<master host>:9003``) is read first, and a master with no storage mounted fails
    before anything is written. Every key written (all under one random ``smoke/<hex>/``
    prefix) is removed at the end, also when a check fails, and the report names the
    segments that held them. Without ``master`` a ``mooncake_master`` and a 512 MiB storage
    process start on loopback.

    Raises:
        UsageError: ``master`` is a kvctl store master, or not ``HOST:PORT``.
        MooncakeUnavailableError: the package, the master or (when given) its HTTP endpoint
            is unusable.
        MooncakeNoStorageError: the master reports no storage capacity.
    """
    from kvctl.store.mooncake import MooncakeMaster, probe_master
    from kvctl.store.mooncake_http import default_metrics_url, normalize_metrics_url

    started = MooncakeMaster(storage_bytes=512 << 20) if master is None else None
    try:
        if started is not None:
            address, url, explicit = started.address, started.metrics_url, True
        else:
            address = str(master)
            probe_master(address)  # a kvctl master or a dead port: fail before HTTP
            explicit = metrics_url is not None
            url = normalize_metrics_url(metrics_url) if metrics_url else \
                default_metrics_url(address)
        report = _MooncakeSmoke(address, url, explicit=explicit, progress=progress).run()
    finally:
        if started is not None:
            started.close()
    if started is not None:
        report = dataclasses.replace(report, target="embedded mooncake_master")
    return report


class _MooncakeSmoke:
    """One Mooncake smoke run (see :func:`run_mooncake`)."""

    def __init__(self, address: str, metrics_url: str, *, explicit: bool,
                 progress: Callable[[str], None] | None) -> None:
        self.address = address
        self.metrics_url = metrics_url
        self.explicit = explicit
        self.progress = progress
        self.checks: list[CheckResult] = []
        #: why the master's HTTP endpoint was not read (when it was not).
        self.unread = ""

    def _row(self, name: str, status: str, detail: str, started: float) -> None:
        if self.progress is not None:
            self.progress(name)
        self.checks.append(CheckResult(name, status, detail, time.perf_counter() - started))

    def _read_status(self) -> MooncakeMasterStatus | None:
        """The master's HTTP status; ``None`` when the default endpoint is not there (a
        given one must answer)."""
        from kvctl.store.mooncake_http import MooncakeMetricsUnavailableError, read_master_status

        try:
            return read_master_status(self.address, self.metrics_url)
        except MooncakeMetricsUnavailableError as exc:
            if self.explicit:
                raise
            self.unread = exc.cause
            return None

    def run(self) -> SmokeReport:
        from kvctl.store.mooncake import MooncakeStore
        from kvctl.store.mooncake_http import require_storage

        t0 = time.perf_counter()
        before = self._read_status()
        if before is not None:
            require_storage(before)
        client = MooncakeStore(self.address)  # client-only: mounts nothing
        segments: tuple[SegmentTouch, ...] = ()
        try:
            self._storage(client, before, t0)
            self._client_only(client, before)
            run = _Run(_Shared(client), new_client=lambda: _Shared(client), prefix=_prefix(),
                       progress=self.progress)
            try:
                _portable_checks(run)
            finally:
                segments = self._cleanup(client, run, before)
            self.checks[2:2] = run.checks  # storage, client-only, then the portable checks
        finally:
            client.close()
        reason = ("kvctl store only (Mooncake's replicas, eviction and SSD offload are "
                  "configured on its master and clients, not driven by this smoke)")
        self.checks.extend(CheckResult(name, "skip", reason, 0.0) for name in _KVCTL_ONLY)
        return SmokeReport("mooncake", self.address, self.checks, segments,
                           self.metrics_url if before is not None else None)

    def _storage(self, client: MooncakeStore, before: MooncakeMasterStatus | None,
                 t0: float) -> None:
        from kvctl.store.errors import StoreFullError
        from kvctl.store.mooncake_http import MooncakeNoStorageError

        if before is not None:
            names = ", ".join(f"{s.name} ({_fmt(s.capacity_bytes)})" for s in before.segments)
            self._row("storage", "pass",
                      f"master {before.health} ({before.role}, {before.ha_state}): "
                      f"{len(before.segments)} segment(s) {names}; {_fmt(before.used_bytes)} "
                      f"of {_fmt(before.capacity_bytes)} used, {before.keys} keys", t0)
            return
        key = f"{_prefix()}storage-probe"
        try:
            client.put(key, _value(4 * KiB))
        except StoreFullError as exc:
            raise MooncakeNoStorageError(
                f"the master at {self.address} took no 4 KiB object ({exc.cause}): it has no "
                "storage mounted, or all of it is full",
                "start a mooncake storage process / client with global_segment_size > 0; "
                "pass --metrics HOST:PORT to read the master's segments") from None
        finally:
            with contextlib.suppress(KvctlError):
                client.remove(key)
        self._row("storage", "skip",
                  f"{self.unread}; a 4 KiB put was accepted, so some storage is mounted "
                  "(pass --metrics HOST:PORT to check health and segments)", t0)

    def _client_only(self, client: MooncakeStore, before: MooncakeMasterStatus | None
                     ) -> None:
        t0 = time.perf_counter()
        if before is None:
            self._row("client-only", "skip",
                      "this client mounted no segment (global_segment_size=0); not verified "
                      "without the master's metrics endpoint", t0)
            return
        after = self._read_status()
        if after is None:
            self._row("client-only", "skip", self.unread, t0)
            return
        old = {s.name for s in before.segments}
        new = sorted({s.name for s in after.segments} - old)
        mine = [n for n in new if n.rpartition(":")[0] == client.local_hostname]
        if mine:
            self._row("client-only", "fail",
                      f"the pool gained segment(s) {', '.join(mine)} named like this client "
                      f"({client.local_hostname}) after it connected", t0)
            return
        others = f"; {', '.join(new)} joined meanwhile" if new else ""
        self._row("client-only", "pass",
                  f"mounted no segment: the pool has its {len(old)} segment(s) and "
                  f"{_fmt(before.capacity_bytes)} of capacity as before{others}", t0)

    def _cleanup(self, client: MooncakeStore, run: _Run,
                 before: MooncakeMasterStatus | None) -> tuple[SegmentTouch, ...]:
        """Name the segments holding the run's objects, remove every key under its prefix
        and check none is left; a ``cleanup`` row says what happened."""
        t0 = time.perf_counter()
        keys = sorted(run.keys)
        touched: dict[str, int] = {}
        problems: list[str] = []
        try:
            present = [k for k, there in zip(keys, client.batch_exists(keys), strict=True)
                       if there]
            for places in client.replica_endpoints(present).values():
                for endpoint in set(places):
                    touched[endpoint] = touched.get(endpoint, 0) + 1
        except KvctlError as exc:
            problems.append(f"replicas not read: {exc.cause}")
        try:
            client.remove_prefix(run.prefix)
            left = [k for k, there in zip(keys, client.batch_exists(keys), strict=True)
                    if there]
        except KvctlError as exc:
            left = []
            problems.append(f"removal failed: {exc.cause}")
        if left:
            problems.append(f"{len(left)} of {len(keys)} keys still stored after removal "
                            f"(first {left[0]})")
        segments = tuple(
            SegmentTouch((before.segment_for_endpoint(ep) if before else None) or ep, ep, n)
            for ep, n in sorted(touched.items()))
        where = ", ".join(f"{s.name} ({plural(s.objects, 'object')})" for s in segments) or "none"
        if problems:
            self._row("cleanup", "fail", "; ".join(problems) + f"; segments: {where}", t0)
        else:
            self._row("cleanup", "pass",
                      f"removed all {len(keys)} keys it wrote under {run.prefix} (none left); "
                      f"objects were on segment(s) {where}", t0)
        return segments
