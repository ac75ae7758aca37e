"""When does reading KV back beat recomputing it? (``kvctl plan readback``)

Cost model, per request that reuses a prefix of ``n`` tokens:

- recompute: ``n / prefill_tokens_per_s``. The throughput is given, or derived from GPU peak
  TFLOP/s x efficiency with prefill FLOPs ~= 2 x active parameters per token (one multiply-add
  per weight). That approximation ignores attention's score/value products, which grow with
  the context, so it *understates* recompute for long prefixes.
- read back: ``latency_us + n x kv_bytes_per_token / (read_gbps x 10^9)`` (GB/s decimal).

Both are linear in ``n``, so past the fixed read-back cost the per-token costs decide: if a
token's KV reads back faster than it recomputes, reading back wins for every prefix longer
than ``latency / (per-token recompute - per-token read)``; otherwise it never wins. The
break-even bandwidth ``kv_bytes_per_token x prefill_tokens_per_s`` is the read rate above
which reading back wins for long prefixes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path

from kvctl.config import register_section
from kvctl.errors import UsageError
from kvctl.models import ModelSpec, resolve_model
from kvctl.plan.bandwidth import Bandwidth, read_bench_file


@register_section("plan")
@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """Inputs of ``kvctl plan readback``.

    Attributes:
        model: built-in name (``llama-3-70b``) or path to a config.json.
        params: parameter count used per token, overriding the model's (MoE: activated).
        prefill_tps: prefill throughput, tokens/s (or give gpu_tflops).
        gpu_tflops: GPU peak dense TFLOP/s at the model's dtype (with efficiency).
        efficiency: fraction of peak prefill reaches (0 < e <= 1).
        read_gbps: read-back bandwidth, GB/s decimal (or give bench_file).
        bench_file: a ``kvctl bench transfer --json`` result to take the bandwidth from.
        bench_size: pick the bench rows of this transfer size (bytes).
        latency_us: fixed cost of one read-back (lookup, setup), microseconds.
        prefix_tokens: prefix lengths to compare, tokens.
        sessions: sessions to hold on SSD (capacity view; with context_tokens).
        context_tokens: tokens per session (capacity view).
    """

    model: str | None = None
    params: int | None = None
    prefill_tps: float | None = None
    gpu_tflops: float | None = None
    efficiency: float = 0.5
    read_gbps: float | None = None
    bench_file: Path | None = None
    bench_size: int | None = dataclasses.field(default=None, metadata={"unit": "size"})
    latency_us: float = 0.0
    prefix_tokens: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
    sessions: int | None = None
    context_tokens: int | None = None


class Winner(enum.StrEnum):
    """Which side is faster for a prefix."""

    READ_BACK = "read-back"
    RECOMPUTE = "recompute"
    TIE = "tie"


@dataclasses.dataclass(frozen=True)
class PrefixCase:
    """One prefix length: both times (seconds), speedup = recompute_s / readback_s."""

    prefix_tokens: int
    kv_bytes: int
    recompute_s: float
    readback_s: float
    speedup: float
    winner: Winner


@dataclasses.dataclass(frozen=True)
class BreakEven:
    """Where the two sides cross.

    Attributes:
        prefix_tokens: shortest prefix for which reading back is at least as fast; 0 when it
            wins at every length; ``None`` when it never wins.
        read_gbps: read bandwidth (GB/s) above which reading back wins for long prefixes.
        summary: the same in one sentence.
    """

    prefix_tokens: int | None
    read_gbps: float
    summary: str


@dataclasses.dataclass(frozen=True)
class CapacityView:
    """KV bytes for ``sessions`` x ``context_tokens`` (GB decimal, GiB binary)."""

    sessions: int
    context_tokens: int
    tokens: int
    kv_bytes: int
    gb: float
    gib: float


@dataclasses.dataclass(frozen=True)
class ReadbackPlan:
    """Everything ``kvctl plan readback`` reports."""

    model: str
    model_source: str
    kv_bytes_per_token: int
    active_params: int | None
    prefill_tokens_per_s: float
    prefill_source: str
    read_gbps: float
    read_source: str
    latency_us: float
    cases: list[PrefixCase]
    break_even: BreakEven
    capacity: CapacityView | None
    assumptions: list[str]


#: Stated with every plan whose prefill rate comes from TFLOP/s.
FLOPS_ASSUMPTION = (
    "prefill FLOPs ~= 2 x params per token (one multiply-add per weight); this ignores "
    "attention's growth with context, so long prefixes cost more to recompute than shown"
)
#: Stated with every plan.
READ_ASSUMPTION = (
    "read-back = fixed cost + bytes / bandwidth, not overlapped with compute; GB/s is decimal "
    "(10^9 bytes/s)"
)


def _positive(value: float | None, flag: str) -> None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise UsageError(f"{flag} {value} is not a positive number", f"give {flag} above 0")


def prefill_rate(settings: PlanSettings, model: ModelSpec) -> tuple[float, str]:
    """Prefill tokens/s and a sentence saying where it came from."""
    _positive(settings.prefill_tps, "--prefill-tps")
    _positive(settings.gpu_tflops, "--gpu-tflops")
    if settings.prefill_tps is not None and settings.gpu_tflops is not None:
        raise UsageError(
            "both --prefill-tps and --gpu-tflops are given", "give one way to rate prefill"
        )
    if settings.prefill_tps is not None:
        return settings.prefill_tps, "--prefill-tps"
    if settings.gpu_tflops is None:
        raise UsageError(
            "no prefill rate: give --prefill-tps (tokens/s) or --gpu-tflops (with --efficiency)",
            "e.g. --prefill-tps 5000, or --gpu-tflops 989 --efficiency 0.5",
        )
    if not math.isfinite(settings.efficiency) or not 0 < settings.efficiency <= 1:
        raise UsageError(
            f"--efficiency {settings.efficiency} is outside (0, 1]", "give e.g. --efficiency 0.5"
        )
    params = settings.params if settings.params is not None else model.active_params
    if params is None:
        raise UsageError(
            f"the parameter count of {model.name} is unknown (MoE or incomplete config.json)",
            "give --params (activated parameters per token) or --prefill-tps",
        )
    if params <= 0:
        raise UsageError(f"--params {params} is not positive", "give the parameter count")
    flops_per_token = 2.0 * params
    tps = settings.gpu_tflops * 1e12 * settings.efficiency / flops_per_token
    return tps, (
        f"{settings.gpu_tflops:g} TFLOP/s x {settings.efficiency:g} efficiency / "
        f"(2 x {params / 1e9:.1f}B params per token)"
    )


def read_bandwidth(settings: PlanSettings) -> Bandwidth:
    """The read-back bandwidth from ``--read-gbps`` or ``--bench-file``."""
    _positive(settings.read_gbps, "--read-gbps")
    if settings.read_gbps is not None and settings.bench_file is not None:
        raise UsageError(
            "both --read-gbps and --bench-file are given", "give one source of read bandwidth"
        )
    if settings.read_gbps is not None:
        return Bandwidth(settings.read_gbps, "--read-gbps")
    if settings.bench_file is None:
        raise UsageError(
            "no read-back bandwidth: give --read-gbps (GB/s) or --bench-file",
            "e.g. --read-gbps 20, or --bench-file result.json from 'kvctl bench transfer --json'",
        )
    return read_bench_file(settings.bench_file, size_bytes=settings.bench_size)


def compare(
    prefix_tokens: int, *, kv_bytes_per_token: int, prefill_tokens_per_s: float,
    read_gbps: float, latency_us: float = 0.0,
) -> PrefixCase:
    """Recompute versus read-back time for one prefix length."""
    kv_bytes = prefix_tokens * kv_bytes_per_token
    recompute = prefix_tokens / prefill_tokens_per_s
    readback = latency_us * 1e-6 + kv_bytes / (read_gbps * 1e9)
    if math.isclose(recompute, readback, rel_tol=1e-9, abs_tol=1e-15):
        winner = Winner.TIE
    else:
        winner = Winner.READ_BACK if readback < recompute else Winner.RECOMPUTE
    speedup = recompute / readback if readback > 0 else math.inf
    return PrefixCase(prefix_tokens, kv_bytes, recompute, readback, speedup, winner)


def break_even(
    *, kv_bytes_per_token: int, prefill_tokens_per_s: float, read_gbps: float,
    latency_us: float = 0.0,
) -> BreakEven:
    """The shortest prefix for which reading back is at least as fast, and the bandwidth."""
    recompute_per_token = 1.0 / prefill_tokens_per_s
    read_per_token = kv_bytes_per_token / (read_gbps * 1e9)
    needed_gbps = kv_bytes_per_token * prefill_tokens_per_s / 1e9
    margin = recompute_per_token - read_per_token
    if margin <= 0 or math.isclose(recompute_per_token, read_per_token, rel_tol=1e-12):
        return BreakEven(
            None, needed_gbps,
            f"reading back never wins: at {read_gbps:g} GB/s a token's KV takes "
            f"{read_per_token * 1e6:.3g} us to read and {recompute_per_token * 1e6:.3g} us to "
            f"recompute; it needs more than {needed_gbps:.3g} GB/s",
        )
    if latency_us <= 0:
        return BreakEven(
            0, needed_gbps,
            f"reading back wins at every prefix length ({read_gbps:g} GB/s is above the "
            f"{needed_gbps:.3g} GB/s break-even bandwidth; no fixed read-back cost given)",
        )
    tokens = math.ceil(latency_us * 1e-6 / margin)
    return BreakEven(
        tokens, needed_gbps,
        f"reading back wins for prefixes of {tokens} tokens or more (the {latency_us:g} us "
        f"fixed cost is repaid after that; bandwidth break-even {needed_gbps:.3g} GB/s)",
    )


def capacity(model: ModelSpec, sessions: int, context_tokens: int) -> CapacityView:
    """KV bytes to keep ``sessions`` contexts of ``context_tokens`` tokens."""
    if sessions <= 0 or context_tokens <= 0:
        raise UsageError(
            f"capacity view needs positive --sessions and --context-tokens "
            f"(got {sessions}, {context_tokens})",
            "e.g. --sessions 1000 --context-tokens 1000",
        )
    tokens = sessions * context_tokens
    kv_bytes = model.kv_bytes(tokens)
    return CapacityView(sessions, context_tokens, tokens, kv_bytes, kv_bytes / 1e9,
                        kv_bytes / 2**30)


def plan_readback(settings: PlanSettings) -> ReadbackPlan:
    """Run ``kvctl plan readback``.

    Raises:
        UsageError: a missing or contradictory input, an unknown model, a bad bench file.
    """
    if settings.model is None:
        raise UsageError("no model given", "give --model NAME (e.g. llama-3-70b) or a config.json")
    model = resolve_model(settings.model)
    tps, tps_source = prefill_rate(settings, model)
    bandwidth = read_bandwidth(settings)
    if not math.isfinite(settings.latency_us) or settings.latency_us < 0:
        raise UsageError(f"--latency-us {settings.latency_us} is negative", "give 0 or more")
    if not settings.prefix_tokens:
        raise UsageError("--prefix-tokens is empty", "give lengths like --prefix-tokens 1024,8192")
    for n in settings.prefix_tokens:
        if n <= 0:
            raise UsageError(f"prefix length {n} is not positive", "give token counts above 0")
    kvb = model.kv_bytes_per_token
    cases = [
        compare(n, kv_bytes_per_token=kvb, prefill_tokens_per_s=tps, read_gbps=bandwidth.gbps,
                latency_us=settings.latency_us)
        for n in settings.prefix_tokens
    ]
    view = None
    if settings.sessions is not None or settings.context_tokens is not None:
        if settings.sessions is None or settings.context_tokens is None:
            raise UsageError(
                "the capacity view needs both --sessions and --context-tokens",
                "e.g. --sessions 1000 --context-tokens 1000",
            )
        view = capacity(model, settings.sessions, settings.context_tokens)
    return ReadbackPlan(
        model=model.name, model_source=model.source, kv_bytes_per_token=kvb,
        active_params=settings.params if settings.params is not None else model.active_params,
        prefill_tokens_per_s=tps, prefill_source=tps_source,
        read_gbps=bandwidth.gbps, read_source=bandwidth.source, latency_us=settings.latency_us,
        cases=cases,
        break_even=break_even(kv_bytes_per_token=kvb, prefill_tokens_per_s=tps,
                              read_gbps=bandwidth.gbps, latency_us=settings.latency_us),
        capacity=view,
        assumptions=[FLOPS_ASSUMPTION, READ_ASSUMPTION] if settings.gpu_tflops is not None
        else [READ_ASSUMPTION],
    )
