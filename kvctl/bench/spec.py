"""What a transfer benchmark runs: settings, buffer locations and the configuration sweep.

A sweep is the cross product ``ops x transports x block sizes x batch sizes``; each element is
a :class:`SweepConfig`. Every configuration runs ``warmup`` untimed batches, then timed
batches for ``duration`` seconds or ``iterations`` batches per thread.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from kvctl.config import register_section
from kvctl.errors import UsageError
from kvctl.models import ModelSpec
from kvctl.units import format_size, parse_size_list

#: Transports a sweep may name. ``auto`` lets the engine choose and reports what it chose.
KNOWN_TRANSPORTS = ("shm", "tcp", "rdma", "auto")
#: Seconds each configuration is timed when neither ``duration`` nor ``iterations`` is given.
DEFAULT_DURATION_S = 0.6
ROLES = ("local", "initiator", "target")


class Op(enum.Enum):
    """Direction of a request, seen from the initiator."""

    READ = "read"  # target → initiator
    WRITE = "write"  # initiator → target


@register_section("bench")
@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """Settings of ``kvctl bench transfer`` (YAML section ``bench``, env ``KVCTL_BENCH_*``).

    Attributes:
        op: ``read``, ``write`` or ``both``.
        transport: comma-separated transports (``shm``, ``tcp``, ``rdma``, ``auto``).
        block_size: sizes as a list (``4KiB,1MiB``) or power-of-two range (``4KiB-4MiB``).
        batch_size: comma-separated requests per batch.
        threads: initiator threads, each with its own batches in flight.
        duration: timed seconds per configuration (default 0.6 s unless ``iterations``).
        iterations: timed batches per thread and configuration (instead of ``duration``).
        warmup: untimed batches per thread before timing each configuration.
        local_location / remote_location: ``cpu:N``, ``cuda:N`` or ``file:PATH``.
        verify: check every block's pattern end to end after each configuration.
        engine: engines to run the sweep through (``kvctl``, ``mooncake``, ``nixl``).
        model / page_tokens: size blocks as KV pages of a model (name or config.json path).
        expect_line_rate: fail (exit 1) below this fraction of the path's line rate.
        expect_gbytes_per_s: fail (exit 1) below this throughput, in GB/s (gigabytes,
            decimal); the old key ``expect_gbps`` is accepted, deprecated, for one release.
        role: ``local`` (embedded target), ``initiator`` or ``target``.
        listen: target's listen address (``HOST:PORT``); empty: loopback, or with a
            ``metadata`` service on another host the address that routes to it.
        advertise: target's address(es) for peers, comma-separated ``HOST`` (default: the
            listen address, or this host's interface addresses for ``0.0.0.0``).
        peer: initiator's target: segment name (with ``metadata``) or ``HOST:PORT``.
        metadata: metadata URL for two-host runs (peers find the segment by name).
        segment: name the target publishes its segment under.
        max_buffer_bytes: refuse sweeps needing more memory per side than this.
        timeout: seconds one batch may take before it counts as failed.
        nic: RDMA NICs to use and nothing else, comma-separated ``mlx5_0`` or
            ``mlx5_0:1`` in order of preference (rdma and auto transports; empty: topo's
            ranking per buffer).
        gid_index: RoCE GID index on every port (default: each port's RoCE v2 IPv4-mapped
            entry).
    """

    op: str = "both"
    transport: str = "shm,tcp"
    block_size: str = "4KiB,64KiB,1MiB,4MiB"
    batch_size: str = "128"
    threads: int = 1
    duration: float | None = dataclasses.field(default=None, metadata={"unit": "duration"})
    iterations: int | None = None
    warmup: int = 2
    local_location: str = "cpu:0"
    remote_location: str = "cpu:0"
    verify: bool = False
    engine: tuple[str, ...] = ("kvctl",)
    model: str | None = None
    page_tokens: int = 16
    expect_line_rate: float | None = None
    expect_gbytes_per_s: float | None = dataclasses.field(
        default=None, metadata={"old_name": "expect_gbps"})
    role: str = "local"
    listen: str = ""
    advertise: str | None = None
    peer: str | None = None
    metadata: str | None = None
    segment: str = "kvctl-bench"
    max_buffer_bytes: int = dataclasses.field(default=2 << 30, metadata={"unit": "size"})
    timeout: float = dataclasses.field(default=30.0, metadata={"unit": "duration"})
    nic: str = ""
    gid_index: int | None = None


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a side's buffer lives.

    Attributes:
        kind: ``cpu`` (host DRAM on NUMA node ``index``), ``cuda`` (GPU ``index``) or ``file``.
        index: NUMA node or GPU index (0 for files).
        path: the file for ``file`` locations, else ``None``.
    """

    kind: str
    index: int = 0
    path: Path | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"file:{self.path}"
        return f"{self.kind}:{self.index}"


#: Host memory on NUMA node 0, the default of both sides.
CPU0 = Location("cpu", 0)


def parse_location(text: str, *, what: str = "location") -> Location:
    """Parse ``cpu:N``, ``cuda:N`` or ``file:PATH`` (``cpu`` alone means ``cpu:0``).

    Raises:
        UsageError: any other spelling.
    """
    kind, sep, rest = text.strip().partition(":")
    if kind == "file" and sep and rest:
        return Location("file", 0, Path(rest).expanduser())
    if kind in ("cpu", "cuda") and (not sep or (rest.isascii() and rest.isdigit())):
        return Location(kind, int(rest) if rest else 0)
    raise UsageError(
        f"{what} {text!r} is not a buffer location",
        "write cpu:N (host memory), cuda:N (GPU) or file:PATH",
    )


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """One configuration of a sweep.

    Attributes:
        op: READ or WRITE.
        transport: requested transport (``auto`` lets the engine pick).
        block_size_bytes: bytes per request.
        batch_size: requests per batch.
    """

    op: Op
    transport: str
    block_size_bytes: int
    batch_size: int

    @property
    def batch_bytes(self) -> int:
        """Bytes one batch moves."""
        return self.block_size_bytes * self.batch_size

    def label(self) -> str:
        """``write tcp 64 KiB x128``: how output and errors name the configuration."""
        return (f"{self.op.value} {self.transport} {format_size(self.block_size_bytes)} "
                f"x{self.batch_size}")


@dataclasses.dataclass(frozen=True)
class ModelSizing:
    """Blocks sized as KV pages of a model.

    Attributes:
        model: the model's name.
        kv_bytes_per_token: KV bytes one token occupies across all layers.
        tokens_per_block: tokens per page (``--page-tokens``).
        block_size_bytes: ``kv_bytes_per_token x tokens_per_block``.
        source: ``built-in`` or the config.json read.
    """

    model: str
    kv_bytes_per_token: int
    tokens_per_block: int
    block_size_bytes: int
    source: str


def model_sizing(model: ModelSpec, page_tokens: int) -> ModelSizing:
    """The KV page size of ``model`` at ``page_tokens`` tokens per page."""
    return ModelSizing(
        model=model.name,
        kv_bytes_per_token=model.kv_bytes_per_token,
        tokens_per_block=page_tokens,
        block_size_bytes=model.block_bytes(page_tokens),
        source=model.source,
    )


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A validated sweep.

    Attributes:
        ops / transports / block_sizes_bytes / batch_sizes: the axes, in run order.
        threads: initiator threads.
        duration_s: timed seconds per configuration, or ``None`` when ``iterations`` is set.
        iterations: timed batches per thread, or ``None`` when ``duration_s`` is set.
        warmup_batches: untimed batches per thread before timing.
        verify: check patterns after each configuration.
        local / remote: buffer locations.
        sizing: model sizing when blocks are KV pages, else ``None``.
        nics / gid_index: RDMA NIC pins and GID index (see :class:`BenchSettings`).
    """

    ops: tuple[Op, ...]
    transports: tuple[str, ...]
    block_sizes_bytes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    threads: int = 1
    duration_s: float | None = DEFAULT_DURATION_S
    iterations: int | None = None
    warmup_batches: int = 2
    verify: bool = False
    local: Location = CPU0
    remote: Location = CPU0
    sizing: ModelSizing | None = None
    nics: tuple[str, ...] = ()
    gid_index: int | None = None

    def configs(self) -> list[SweepConfig]:
        """Every configuration: transport-major, then op, block size, batch size."""
        return [
            SweepConfig(op, transport, block, batch)
            for transport in self.transports
            for op in self.ops
            for block in self.block_sizes_bytes
            for batch in self.batch_sizes
        ]

    @property
    def region_bytes(self) -> int:
        """Bytes of buffer each side needs: the largest batch, once per thread."""
        largest = max(b * n for b in self.block_sizes_bytes for n in self.batch_sizes)
        return largest * self.threads


def parse_ops(text: str) -> tuple[Op, ...]:
    """``read``, ``write`` or ``both`` (also ``read,write``)."""
    ops: list[Op] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if part == "both":
            ops.extend([Op.READ, Op.WRITE])
        elif part in ("read", "write"):
            ops.append(Op(part))
        else:
            raise UsageError(f"operation {part!r} is unknown", "use --op read, write or both")
    return tuple(dict.fromkeys(ops))


def parse_transports(text: str) -> tuple[str, ...]:
    """Comma-separated transports, each one of :data:`KNOWN_TRANSPORTS`."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError("no transport given", f"use --transport {'|'.join(KNOWN_TRANSPORTS)}")
    for name in names:
        if name not in KNOWN_TRANSPORTS:
            raise UsageError(
                f"transport {name!r} is unknown", f"known transports: {', '.join(KNOWN_TRANSPORTS)}"
            )
    return tuple(dict.fromkeys(names))


def parse_counts(text: str, *, what: str) -> tuple[int, ...]:
    """Comma-separated positive integers (``--batch-size 1,32,128``)."""
    values: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not (part.isascii() and part.isdigit()) or int(part) <= 0:
            raise UsageError(f"{what} {part!r} is not a positive integer",
                             f"write e.g. --{what.replace(' ', '-')} 1,32,128")
        values.append(int(part))
    return tuple(dict.fromkeys(values))


def parse_rdma_pins(nic: str, gid_index: int | None) -> tuple[tuple[str, ...], int | None]:
    """``--nic mlx5_0,mlx5_1:1`` and ``--gid-index`` checked for form (whether the devices
    exist is the rdma transport's check, on the host that opens them).

    Raises:
        UsageError: a malformed NIC, an empty item (``--nic ,`` pins nothing: it would
            quietly mean topo's ranking), or an index outside 0-255.
    """
    from kvctl.transfer.transports.rdma.devices import RdmaOptions

    items = [n.strip() for n in nic.split(",")] if nic.strip() else []
    if "" in items:
        raise UsageError(f"--nic {nic!r} has an empty item: it would pin no NIC",
                         "name each NIC once, e.g. --nic mlx5_0,mlx5_1:1, or leave --nic out "
                         "for topo's ranking")
    nics = tuple(dict.fromkeys(items))
    try:
        RdmaOptions(nics=nics, gid_index=gid_index).check()
    except UsageError as exc:
        raise UsageError(f"--nic/--gid-index: {exc.cause.removeprefix('bad rdma settings: ')}",
                         "write --nic mlx5_0,mlx5_1:1 (ibv_devices lists the devices) and "
                         "--gid-index 0-255") from None
    return nics, gid_index


def build_sweep(settings: BenchSettings, *, model: ModelSpec | None = None) -> Sweep:
    """Validate ``settings`` into a :class:`Sweep`.

    With ``model``, the block size is one KV page (``page_tokens`` tokens) of that model and
    ``block_size`` is ignored.

    Raises:
        UsageError: a bad op, transport, size, count, location, or a sweep too large.
    """
    sizing = None
    if model is not None:
        sizing = model_sizing(model, settings.page_tokens)
        blocks: tuple[int, ...] = (sizing.block_size_bytes,)
    else:
        blocks = tuple(dict.fromkeys(parse_size_list(settings.block_size, what="block size")))
    for size in blocks:
        if size <= 0:
            raise UsageError(f"block size {size} is not positive", "use e.g. --block-size 64KiB")
    if settings.threads <= 0:
        raise UsageError(f"threads {settings.threads} is not positive", "use --threads 1 or more")
    if settings.warmup < 0:
        raise UsageError(f"warmup {settings.warmup} is negative", "use --warmup 0 or more")
    if settings.iterations is not None and settings.duration is not None:
        raise UsageError("both --duration and --iterations given", "give one of them")
    if settings.iterations is not None and settings.iterations <= 0:
        raise UsageError(f"iterations {settings.iterations} is not positive",
                         "use --iterations 1 or more")
    duration = settings.duration
    if settings.iterations is None:
        duration = DEFAULT_DURATION_S if duration is None else duration
        if duration <= 0:
            raise UsageError(f"duration {duration}s is not positive", "use e.g. --duration 2s")
    nics, gid_index = parse_rdma_pins(settings.nic, settings.gid_index)
    sweep = Sweep(
        ops=parse_ops(settings.op),
        transports=parse_transports(settings.transport),
        block_sizes_bytes=blocks,
        batch_sizes=parse_counts(settings.batch_size, what="batch size"),
        threads=settings.threads,
        duration_s=duration,
        iterations=settings.iterations,
        warmup_batches=settings.warmup,
        verify=settings.verify,
        local=parse_location(settings.local_location, what="local location"),
        remote=parse_location(settings.remote_location, what="remote location"),
        sizing=sizing,
        nics=nics,
        gid_index=gid_index,
    )
    if (nics or gid_index is not None) and not {"rdma", "auto"} & set(sweep.transports):
        raise UsageError("--nic and --gid-index pick RDMA ports, and the sweep has no rdma "
                         "or auto transport", "add -t rdma (or auto), or drop them")
    if sweep.region_bytes > settings.max_buffer_bytes:
        raise UsageError(
            f"the sweep needs {format_size(sweep.region_bytes)} of buffer per side "
            f"(largest batch x threads), over the limit of "
            f"{format_size(settings.max_buffer_bytes)}",
            "use smaller --block-size/--batch-size/--threads or raise --max-buffer",
        )
    return sweep
