"""Run a sweep through one engine driver and produce :class:`~kvctl.bench.result.ResultRow`s.

Per configuration:

1. ``warmup`` untimed batches per thread;
2. the timed phase: every thread submits a batch and waits for it, again and again, until
   ``duration`` passes or it ran ``iterations`` batches; throughput is the bytes of completed
   requests over the wall time from the common start to the last thread's end;
3. request latency: single requests of the same size, one at a time (unloaded latency);
4. with ``verify``: every block of every thread's batch is filled with its own pattern
   (run id, block index, offset), written to the target, the local copy cleared, read back and
   checked byte for byte; the first bad offset fails the run;
5. the line rate, measured right then with this configuration's block size, batch size and
   threads (:mod:`kvctl.bench.linerate`; cached for the other op of the same shape, measured
   again once if the row beat it).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from kvctl.bench.engines.base import BatchOutcome, DriverPlan, EngineDriver, PathInfo
from kvctl.bench.linerate import LineRate, LineRates, Shape
from kvctl.bench.result import ResultRow
from kvctl.bench.spec import Op, Sweep, SweepConfig
from kvctl.bench.stats import summarize
from kvctl.bench.verify import Pattern, check_block
from kvctl.errors import CheckFailedError, KvctlError, UnavailableError

_log = logging.getLogger("kvctl.bench")

#: Upper bound of timed batches per thread in duration mode (bounds the loop).
MAX_BATCHES = 10_000_000
#: Single-request latency samples per configuration (at most).
MAX_REQUEST_SAMPLES = 200
#: Share of ``duration`` spent on single-request latency samples.
REQUEST_SHARE = 0.15
#: Single-request latency sampling stops after this many failures in a row.
MAX_FAILED_SAMPLES = 5
#: Most characters of an engine's cause a row (``first_error``) or an error repeats.
MAX_CAUSE_CHARS = 300


def one_line(cause: str) -> str:
    """An engine's cause as one printable line of at most :data:`MAX_CAUSE_CHARS`: it may
    carry a target's own error text (up to 64 KiB off the wire), and it lands in a table,
    a CSV row that must stay one line, and the ``Error:`` line on a terminal."""
    text = "".join(c if c.isprintable() else " " for c in cause[:4 * MAX_CAUSE_CHARS])
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[:MAX_CAUSE_CHARS - 3] + "..."


@dataclasses.dataclass(frozen=True)
class ProgressEvent:
    """A configuration is about to run.

    Attributes:
        engine: engine name.
        index: 0-based configuration number; ``total``: configurations of this engine.
        label: the configuration (``write tcp 64 KiB x128``).
    """

    engine: str
    index: int
    total: int
    label: str


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A transport an engine could not use here.

    Attributes:
        engine / transport: what was skipped (``transport`` ``None``: the whole engine).
        reason / hint: why, and how to make it work.
    """

    engine: str
    transport: str | None
    reason: str
    hint: str | None


#: Called between writing the verification pattern and reading it back: (driver, transport,
#: thread stride). Tests plant corruption with :meth:`EngineDriver.poke_remote`.
Tamper = Callable[[EngineDriver, str, int], None]


def plan_for(sweep: Sweep, *, timeout_s: float = 30.0, peer: str | None = None,
             metadata: str | None = None, token: str | None = None,
             local_addresses: tuple[str, ...] = ()) -> DriverPlan:
    """The driver plan a sweep needs: one region per thread, sized for its largest batch."""
    stride = sweep.region_bytes // sweep.threads
    return DriverPlan(region_bytes=sweep.region_bytes, thread_stride_bytes=stride,
                      threads=sweep.threads, local=sweep.local, remote=sweep.remote,
                      timeout_s=timeout_s, peer=peer, metadata=metadata, token=token,
                      nics=sweep.nics, gid_index=sweep.gid_index,
                      local_addresses=local_addresses)


def new_run_id() -> int:
    """A random 32-bit run id (patterns of different runs never match)."""
    return secrets.randbits(32)


@dataclasses.dataclass
class _Timed:
    latencies_s: list[float]
    batches: int
    errors: int
    retries: int | None
    elapsed_s: float
    path: str | None
    first_error: str | None = None


class SweepRunner:
    """Runs the configurations of ``sweep`` through a started ``driver``.

    Args:
        driver: a driver whose :meth:`~EngineDriver.start` was called with :func:`plan_for`.
        sweep: the configurations.
        line_rates: cache of measured baselines (share one across engines).
        nic_rates: line rate of cross-host paths by medium (``tcp``, ``rdma``): NIC port rates.
        run_id: 32-bit id mixed into verification patterns.
        on_progress: called before each configuration.
        tamper: verification hook (tests only), see :data:`Tamper`.
    """

    def __init__(self, driver: EngineDriver, sweep: Sweep, *, line_rates: LineRates,
                 nic_rates: Mapping[str, LineRate] | None = None, run_id: int | None = None,
                 on_progress: Callable[[ProgressEvent], None] | None = None,
                 tamper: Tamper | None = None) -> None:
        self.driver = driver
        self.sweep = sweep
        self.line_rates = line_rates
        self.nic_rates = dict(nic_rates or {})
        self.run_id = new_run_id() if run_id is None else run_id
        self.on_progress = on_progress
        self.tamper = tamper
        self._paths: dict[str, PathInfo] = {}
        self.skipped: list[Skipped] = []
        self._seen_paths: dict[str, str] = {}
        self._stride = sweep.region_bytes // sweep.threads

    def rows(self) -> Iterator[ResultRow]:
        """Run every configuration in order, yielding its row as soon as it is measured.

        A transport the engine cannot use here is skipped and recorded in :attr:`skipped`.

        Raises:
            IntegrityError: ``verify`` found a block that differs (first bad offset named).
            KvctlError: the engine failed outright (target gone, transport unavailable).
        """
        configs = self.sweep.configs()
        unavailable: set[str] = set()
        for index, config in enumerate(configs):
            if config.transport in unavailable:
                continue
            try:
                self._path(config.transport)
            except UnavailableError as exc:
                unavailable.add(config.transport)
                self.skipped.append(Skipped(self.driver.name, config.transport, exc.cause,
                                            exc.hint))
                _log.warning("%s: skipping transport %s: %s", self.driver.name,
                             config.transport, exc.cause)
                continue
            if self.on_progress is not None:
                self.on_progress(ProgressEvent(self.driver.name, index, len(configs),
                                               config.label()))
            yield self.run_config(index, config)

    def run_config(self, index: int, config: SweepConfig) -> ResultRow:
        """Measure one configuration (``index`` makes its verification pattern unique)."""
        info = self._path(config.transport)
        sweep = self.sweep
        for thread in range(sweep.threads):
            for _ in range(sweep.warmup_batches):
                outcome = self.driver.run_batch(config.transport, config.op,
                                                config.block_size_bytes, config.batch_size,
                                                thread)
                self._note_path(config.transport, outcome.path)
        timed = self._timed(config)
        self._note_path(config.transport, timed.path)
        request_samples = self._request_latencies(config)
        verified: bool | None = None
        if sweep.verify:
            self._verify(index, config)
            verified = True
        requests = timed.batches * config.batch_size
        completed = requests - timed.errors
        bytes_moved = completed * config.block_size_bytes
        gbps = bytes_moved / timed.elapsed_s / 1e9 if timed.elapsed_s > 0 else 0.0
        batch_stats = summarize(timed.latencies_s)
        request_stats = summarize(request_samples)
        medium = info.medium or info.transport
        # measured now, with this row's shape, and again if the row beat it
        line = self.line_rates.for_path(
            medium, loopback=info.loopback, nic_rate=self.nic_rates.get(medium),
            shape=Shape(config.block_size_bytes, config.batch_size, sweep.threads),
            beaten_by=gbps)
        fraction = (gbps / line.gbytes_per_s if line is not None and line.gbytes_per_s > 0
                    else None)
        sizing = sweep.sizing
        return ResultRow(
            engine=self.driver.name,
            op=config.op.value,
            transport=info.transport,
            transport_requested=config.transport,
            path=self._seen_paths.get(config.transport, info.path),
            block_size_bytes=config.block_size_bytes,
            batch_size=config.batch_size,
            threads=sweep.threads,
            local_location=str(sweep.local),
            remote_location=str(sweep.remote),
            batches=timed.batches,
            requests=requests,
            bytes_moved=bytes_moved,
            elapsed_s=timed.elapsed_s,
            throughput_gbytes_per_s=gbps,
            throughput_gbits_per_s=gbps * 8,
            requests_per_s=completed / timed.elapsed_s if timed.elapsed_s > 0 else 0.0,
            batch_latency_p50_us=batch_stats.p50_us,
            batch_latency_p99_us=batch_stats.p99_us,
            batch_latency_p999_us=batch_stats.p999_us,
            batch_latency_mean_us=batch_stats.mean_us,
            batch_latency_stddev_us=batch_stats.stddev_us,
            request_latency_p50_us=request_stats.p50_us,
            request_latency_p99_us=request_stats.p99_us,
            request_latency_p999_us=request_stats.p999_us,
            request_latency_stddev_us=request_stats.stddev_us,
            errors=timed.errors,
            retries=timed.retries,
            line_rate_gbytes_per_s=line.gbytes_per_s if line is not None else None,
            line_rate_source=line.source if line is not None else None,
            line_rate_fraction=fraction,
            line_rate_valid=None if fraction is None else fraction <= 1.0,
            verified=verified,
            model=sizing.model if sizing is not None else None,
            tokens_per_block=sizing.tokens_per_block if sizing is not None else None,
            first_error=timed.first_error,
        )

    def _note_path(self, transport: str, path: str | None) -> None:
        if path is not None:
            self._seen_paths[transport] = path

    def _path(self, transport: str) -> PathInfo:
        info = self._paths.get(transport)
        if info is None:
            info = self._paths[transport] = self.driver.prepare(transport)
            _log.info("%s: transport %s -> %s via %s", self.driver.name, transport,
                      info.transport, info.path)
        return info

    def _timed(self, config: SweepConfig) -> _Timed:
        sweep = self.sweep
        threads = sweep.threads
        latencies: list[list[float]] = [[] for _ in range(threads)]
        errors = [0] * threads
        retries: list[int | None] = [0] * threads
        paths: list[str | None] = [None] * threads
        causes: list[str | None] = [None] * threads
        failures: list[BaseException] = []
        start_gate = threading.Barrier(threads + 1) if threads > 1 else None
        deadline_box = [0.0]

        def work(thread: int) -> None:
            try:
                if start_gate is not None:
                    start_gate.wait(timeout=60)
                limit = sweep.iterations if sweep.iterations is not None else MAX_BATCHES
                deadline = deadline_box[0]
                samples = latencies[thread]
                for _ in range(limit):  # bounded: iterations, or MAX_BATCHES with a deadline
                    if sweep.iterations is None and time.perf_counter() >= deadline:
                        break
                    t0 = time.perf_counter()
                    outcome = self.driver.run_batch(config.transport, config.op,
                                                    config.block_size_bytes,
                                                    config.batch_size, thread)
                    samples.append(time.perf_counter() - t0)
                    errors[thread] += outcome.errors
                    if outcome.errors and causes[thread] is None:
                        causes[thread] = one_line(outcome.cause or "the engine gave no cause")
                    got = retries[thread]
                    retries[thread] = (None if got is None or outcome.retries is None
                                       else got + outcome.retries)
                    if outcome.path is not None:
                        paths[thread] = outcome.path
            except (KvctlError, OSError, threading.BrokenBarrierError) as exc:
                failures.append(exc)

        if threads == 1:
            start = time.perf_counter()
            deadline_box[0] = start + (sweep.duration_s or 0.0)
            work(0)
        else:
            workers = [threading.Thread(target=work, args=(t,), name=f"kvctl-bench-{t}",
                                        daemon=True) for t in range(threads)]
            for worker in workers:
                worker.start()
            start = time.perf_counter()
            deadline_box[0] = start + (sweep.duration_s or 0.0)
            start_gate.wait(timeout=60)  # type: ignore[union-attr]
            for worker in workers:
                worker.join()
        elapsed = time.perf_counter() - start
        if failures:
            raise failures[0]
        all_retries = None if any(r is None for r in retries) else sum(r or 0 for r in retries)
        return _Timed(
            latencies_s=[s for per in latencies for s in per],
            batches=sum(len(per) for per in latencies),
            errors=sum(errors),
            retries=all_retries,
            elapsed_s=elapsed,
            path=next((p for p in paths if p is not None), None),
            first_error=next((c for c in causes if c is not None), None),
        )

    def _request_latencies(self, config: SweepConfig) -> list[float]:
        sweep = self.sweep
        if sweep.iterations is not None:
            count = min(MAX_REQUEST_SAMPLES, max(5, sweep.iterations))
            budget_s = float("inf")
        else:
            count = MAX_REQUEST_SAMPLES
            budget_s = (sweep.duration_s or 0.0) * REQUEST_SHARE
        samples: list[float] = []
        failed = 0  # in a row
        end = time.perf_counter() + budget_s
        for _ in range(count):
            t0 = time.perf_counter()
            outcome = self.driver.run_batch(config.transport, config.op, config.block_size_bytes,
                                            1, 0)
            if outcome.errors == 0:
                samples.append(time.perf_counter() - t0)
                failed = 0
            else:
                failed += 1
            # A target that stopped answering fails every request: the timed batches have
            # already said so, and trying 200 more times only hides it for minutes.
            if failed >= MAX_FAILED_SAMPLES:
                break
            if time.perf_counter() >= end and (len(samples) >= 3 or failed):
                break
        return samples

    def _verify(self, index: int, config: SweepConfig) -> None:
        pattern = Pattern.for_config(self.run_id, index)
        size = config.block_size_bytes
        batch = config.batch_size
        where = f"{self.driver.name} {config.label()}"
        threads = range(self.sweep.threads)
        for thread in threads:
            for i in range(batch):
                view = self.driver.local_view(thread * self._stride + i * size, size)
                pattern.fill(view, thread * batch + i)
            self.driver.sync_local(thread * self._stride, batch * size)  # e.g. into GPU memory
        for thread in threads:
            self._must(self.driver.run_batch(config.transport, Op.WRITE, size, batch, thread),
                       where, "writing the pattern")
        if self.tamper is not None:
            self.tamper(self.driver, config.transport, self._stride)
        for thread in threads:
            view = self.driver.local_view(thread * self._stride, batch * size)
            view[:] = bytes(len(view))
            self.driver.sync_local(thread * self._stride, batch * size)
        for thread in threads:
            self._must(self.driver.run_batch(config.transport, Op.READ, size, batch, thread),
                       where, "reading the pattern back")
        for thread in threads:
            self.driver.refresh_local(thread * self._stride, batch * size)
            for i in range(batch):
                view = self.driver.local_view(thread * self._stride + i * size, size)
                check_block(pattern, view, thread * batch + i,
                            where=f"{where} (thread {thread})")
        _log.info("%s: %d blocks verified", where, batch * self.sweep.threads)

    @staticmethod
    def _must(outcome: BatchOutcome, where: str, what: str) -> None:
        if outcome.errors:
            raise CheckFailedError(
                f"{where}: {outcome.errors} request(s) failed while {what}"
                + (f" (first: {one_line(outcome.cause)})" if outcome.cause else ""),
                "the engine reported failures; rerun with -v for every cause")
