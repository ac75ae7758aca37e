"""When does reading KV back beat recomputing it? (``kvctl plan readback``)

Cost model, per request that reuses a prefix of ``n`` tokens:

- recompute: ``n / prefill_tokens_per_s``. The throughput is given, or derived from GPU peak
  TFLOP/s x efficiency with prefill FLOPs ~= 2 x active parameters per token (one multiply-add
  per weight). That approximation ignores attention's score/value products, which grow with
  the context, so it *understates* recompute for long prefixes.
- read back: ``latency_us + n x kv_bytes_per_token / (read_gbytes_per_s x 10^9)`` (GB/s decimal).

Both are linear in ``n``, so past the fixed read-back cost the per-token costs decide: if a
token's KV reads back faster than it recomputes, reading back wins for every prefix longer
than ``latency / (per-token recompute - per-token read)``; otherwise it never wins. The
break-even bandwidth ``kv_bytes_per_token x prefill_tokens_per_s`` is the read rate above
which reading back wins for long prefixes.

Rates, in order: ``--prefill-tps``; ``--gpu-tflops``; the peak of ``--gpu NAME``; the peak of
the GPU NVML reports (:mod:`kvctl.plan.gpus`, a cited table); the read rate from
``--read-gbytes-per-s`` or a ``--bench-file``. Whatever is missing, the plan still sizes the KV
(bytes per token, per prefix, per GiB and TB, the capacity view) and says what to give for
the rest: only the comparison needs both rates.
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
from kvctl.plan.gpus import GpuPeak, gpu_peak, peak_from_nvml
from kvctl.probe.nvml import NvmlBackend, NvmlReport
from kvctl.probe.types import Unavailable


@register_section("plan")
@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """Inputs of ``kvctl plan readback``.

    Attributes:
        model: built-in name (``llama-3-70b``) or path to a config.json.
        params: parameter count used per token, overriding the model's (MoE: activated).
        prefill_tps: prefill throughput, tokens/s (or give gpu_tflops or gpu).
        gpu_tflops: GPU peak dense TFLOP/s at the model's dtype (with efficiency).
        gpu: GPU model whose table peak to use (``H100 SXM``, ``L40S``, or NVML's product
            name); without it and without a rate, NVML's GPU 0.
        gpus: GPUs one prefill runs on (tensor parallelism): the peak is multiplied by it.
        nvml: ask NVML for this host's GPU (its model when no rate is given, its memory for
            the sizing view); off when planning for another host.
        efficiency: fraction of peak prefill reaches (0 < e <= 1).
        read_gbytes_per_s: read-back bandwidth, GB/s decimal (or give bench_file).
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
    gpu: str | None = None
    gpus: int = 1
    nvml: bool = True
    efficiency: float = 0.5
    read_gbytes_per_s: float | None = dataclasses.field(
        default=None, metadata={"old_name": "read_gbps"})
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
    """One prefix length: its KV bytes, both times (seconds), speedup = recompute_s /
    readback_s. A time is ``None`` when its rate is not known (then so are speedup and
    winner)."""

    prefix_tokens: int
    kv_bytes: int
    recompute_s: float | None
    readback_s: float | None
    speedup: float | None
    winner: Winner | None


@dataclasses.dataclass(frozen=True)
class BreakEven:
    """Where the two sides cross.

    Attributes:
        prefix_tokens: shortest prefix for which reading back is at least as fast; 0 when it
            wins at every length; ``None`` when it never wins.
        read_gbytes_per_s: read bandwidth (GB/s) above which reading back wins for long prefixes.
        summary: the same in one sentence.
    """

    prefix_tokens: int | None
    read_gbytes_per_s: float
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
class KvSizing:
    """How much KV the model keeps, whatever the rates.

    Attributes:
        kv_bytes_per_token: every layer's K and V of one token, bytes.
        tokens_per_gib: tokens whose KV fits in 2^30 bytes.
        tokens_per_tb: tokens whose KV fits in 10^12 bytes (an SSD's decimal TB).
        gpu_memory_bytes: the framebuffer NVML reports for GPU 0, when it was asked.
        tokens_per_gpu_memory: tokens whose KV fills that memory (before weights and
            activations take their share: an upper bound).
    """

    kv_bytes_per_token: int
    tokens_per_gib: int
    tokens_per_tb: int
    gpu_memory_bytes: int | None = None
    tokens_per_gpu_memory: int | None = None


@dataclasses.dataclass(frozen=True)
class ReadbackPlan:
    """Everything ``kvctl plan readback`` reports.

    ``prefill_tokens_per_s`` and ``read_gbytes_per_s`` are ``None`` when no source gave them (the
    ``*_source`` field then says why, and ``missing`` what to give for each);
    ``break_even`` needs both, ``break_even_gbytes_per_s`` the prefill rate only.
    """

    model: str
    model_source: str
    kv_bytes_per_token: int
    active_params: int | None
    prefill_tokens_per_s: float | None
    prefill_source: str
    read_gbytes_per_s: float | None
    read_source: str
    latency_us: float
    cases: list[PrefixCase]
    break_even: BreakEven | None
    break_even_gbytes_per_s: float | None
    capacity: CapacityView | None
    sizing: KvSizing
    gpu: GpuPeak | None
    missing: list[str]
    assumptions: list[str]


#: Stated with every plan whose prefill rate comes from TFLOP/s.
FLOPS_ASSUMPTION = (
    "prefill FLOPs ~= 2 x params per token (one multiply-add per weight); this ignores "
    "attention's growth with context, so long prefixes cost more to recompute than shown"
)
#: Stated with every plan whose prefill rate comes from the GPU table.
GPU_PEAK_ASSUMPTION = (
    "the GPU's peak is the vendor's dense BF16 (FP16 without BF16) tensor figure, without "
    "sparsity, at the boost clock; FP8 models prefill faster than that"
)
#: Stated with every plan that has a read rate.
READ_ASSUMPTION = (
    "read-back = fixed cost + bytes / bandwidth, not overlapped with compute; GB/s is decimal "
    "(10^9 bytes/s)"
)


def _positive(value: float | None, flag: str) -> None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise UsageError(f"{flag} {value} is not a positive number", f"give {flag} above 0")


@dataclasses.dataclass(frozen=True)
class PrefillRate:
    """The prefill rate and where it came from.

    Attributes:
        tokens_per_s: tokens/s, or ``None`` when no source gave one.
        source: one sentence: the source, or why there is none.
        gpu: the table entry used, if the rate came from a GPU's peak.
        from_flops: the rate is derived from TFLOP/s (2 x params FLOPs per token).
    """

    tokens_per_s: float | None
    source: str
    gpu: GpuPeak | None = None
    from_flops: bool = False


NO_PREFILL_HINT = ("a prefill rate: --prefill-tps (tokens/s), --gpu-tflops (with --efficiency), "
                   "or --gpu NAME (e.g. --gpu 'H100 SXM')")


NvmlAnswer = NvmlReport | Unavailable | None  # None: NVML was not asked


def _tflops_source(settings: PlanSettings, nvml: NvmlAnswer
                   ) -> tuple[float | None, str, GpuPeak | None]:
    """Peak TFLOP/s (all ``gpus``), where it came from, and the table entry used."""
    if settings.gpu_tflops is not None:
        return settings.gpu_tflops * settings.gpus, "--gpu-tflops", None
    if settings.gpu is not None:
        peak = gpu_peak(settings.gpu)
        return peak.tflops * settings.gpus, f"--gpu {settings.gpu!r} ({peak.name})", peak
    if nvml is None:
        return None, "no prefill rate given (NVML not asked)", None
    found = peak_from_nvml(nvml)
    if found.peak is None:
        return None, f"no prefill rate given, and {found.reason}", None
    return (found.peak.tflops * settings.gpus,
            f"NVML GPU 0 {found.reported!r} ({found.peak.name})", found.peak)


def prefill_rate(settings: PlanSettings, model: ModelSpec,
                 nvml: NvmlAnswer = None) -> PrefillRate:
    """Prefill tokens/s from the settings, a GPU's table peak, or NVML's GPU 0 (``nvml``:
    the answer of ``NvmlBackend.query()``, ``None`` when NVML was not asked).

    Raises:
        UsageError: contradictory or invalid inputs, an unknown ``--gpu``, or a parameter
            count that is unknown when a TFLOP/s figure needs it.
    """
    _positive(settings.prefill_tps, "--prefill-tps")
    _positive(settings.gpu_tflops, "--gpu-tflops")
    if settings.gpus <= 0:
        raise UsageError(f"--gpus {settings.gpus} is not positive",
                         "give the GPUs one prefill runs on (1 or more)")
    given = [flag for flag, value in (("--prefill-tps", settings.prefill_tps),
                                      ("--gpu-tflops", settings.gpu_tflops),
                                      ("--gpu", settings.gpu)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"both {given[0]} and {given[1]} are given",
                         "give one way to rate prefill")
    if settings.prefill_tps is not None:
        return PrefillRate(settings.prefill_tps, "--prefill-tps")
    if not math.isfinite(settings.efficiency) or not 0 < settings.efficiency <= 1:
        raise UsageError(
            f"--efficiency {settings.efficiency} is outside (0, 1]", "give e.g. --efficiency 0.5"
        )
    tflops, where, peak = _tflops_source(settings, nvml)
    if tflops is None:
        return PrefillRate(None, where)
    params = settings.params if settings.params is not None else model.active_params
    if params is None:
        raise UsageError(
            f"the parameter count of {model.name} is unknown (MoE or incomplete config.json)",
            "give --params (activated parameters per token) or --prefill-tps",
        )
    if params <= 0:
        raise UsageError(f"--params {params} is not positive", "give the parameter count")
    flops_per_token = 2.0 * params
    tps = tflops * 1e12 * settings.efficiency / flops_per_token
    gpus = f" x {settings.gpus} GPUs" if settings.gpus > 1 else ""
    per_gpu = tflops / settings.gpus
    return PrefillRate(tps, (
        f"{per_gpu:g} TFLOP/s{gpus} from {where} x {settings.efficiency:g} efficiency / "
        f"(2 x {params / 1e9:.1f}B params per token)"), gpu=peak, from_flops=True)


def read_bandwidth(settings: PlanSettings) -> Bandwidth | None:
    """The read-back bandwidth from ``--read-gbytes-per-s`` or ``--bench-file`` (``None``:
    neither)."""
    _positive(settings.read_gbytes_per_s, "--read-gbytes-per-s")
    if settings.read_gbytes_per_s is not None and settings.bench_file is not None:
        raise UsageError(
            "both --read-gbytes-per-s and --bench-file are given",
            "give one source of read bandwidth"
        )
    if settings.read_gbytes_per_s is not None:
        return Bandwidth(settings.read_gbytes_per_s, "--read-gbytes-per-s")
    if settings.bench_file is None:
        return None
    return read_bench_file(settings.bench_file, size_bytes=settings.bench_size)


NO_READ_HINT = ("a read-back bandwidth: --read-gbytes-per-s (GB/s) or --bench-file "
                "result.json from 'kvctl bench transfer --json'")


def compare(
    prefix_tokens: int, *, kv_bytes_per_token: int, prefill_tokens_per_s: float | None,
    read_gbytes_per_s: float | None, latency_us: float = 0.0,
) -> PrefixCase:
    """Recompute versus read-back time for one prefix length (a side whose rate is
    ``None`` has no time, and then there is no winner)."""
    kv_bytes = prefix_tokens * kv_bytes_per_token
    recompute = None if prefill_tokens_per_s is None else prefix_tokens / prefill_tokens_per_s
    readback = (None if read_gbytes_per_s is None
                else latency_us * 1e-6 + kv_bytes / (read_gbytes_per_s * 1e9))
    if recompute is None or readback is None:
        return PrefixCase(prefix_tokens, kv_bytes, recompute, readback, None, None)
    if math.isclose(recompute, readback, rel_tol=1e-9, abs_tol=1e-15):
        winner = Winner.TIE
    else:
        winner = Winner.READ_BACK if readback < recompute else Winner.RECOMPUTE
    speedup = recompute / readback if readback > 0 else math.inf
    return PrefixCase(prefix_tokens, kv_bytes, recompute, readback, speedup, winner)


def break_even(
    *, kv_bytes_per_token: int, prefill_tokens_per_s: float, read_gbytes_per_s: float,
    latency_us: float = 0.0,
) -> BreakEven:
    """The shortest prefix for which reading back is at least as fast, and the bandwidth."""
    recompute_per_token = 1.0 / prefill_tokens_per_s
    read_per_token = kv_bytes_per_token / (read_gbytes_per_s * 1e9)
    needed_gbps = kv_bytes_per_token * prefill_tokens_per_s / 1e9
    margin = recompute_per_token - read_per_token
    if margin <= 0 or math.isclose(recompute_per_token, read_per_token, rel_tol=1e-12):
        return BreakEven(
            None, needed_gbps,
            f"reading back never wins: at {read_gbytes_per_s:g} GB/s a token's KV takes "
            f"{read_per_token * 1e6:.3g} us to read and {recompute_per_token * 1e6:.3g} us to "
            f"recompute; it needs more than {needed_gbps:.3g} GB/s",
        )
    if latency_us <= 0:
        return BreakEven(
            0, needed_gbps,
            f"reading back wins at every prefix length ({read_gbytes_per_s:g} GB/s is above the "
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


def sizing(model: ModelSpec, gpu_memory_bytes: int | None = None) -> KvSizing:
    """The KV sizing view: bytes per token, tokens per GiB and per TB, per GPU memory."""
    kvb = model.kv_bytes_per_token
    return KvSizing(kvb, 2**30 // kvb, 10**12 // kvb, gpu_memory_bytes,
                    None if gpu_memory_bytes is None else gpu_memory_bytes // kvb)


def _gpu_memory(answer: NvmlAnswer) -> int | None:
    if not isinstance(answer, NvmlReport) or not answer.gpus:
        return None
    return answer.gpus[0].memory_total_bytes


def plan_readback(settings: PlanSettings, *, nvml: NvmlBackend | None = None) -> ReadbackPlan:
    """Run ``kvctl plan readback``.

    Args:
        settings: the inputs.
        nvml: where to find this host's GPU when no prefill rate is given (and its memory
            for the sizing view); ``None`` asks nobody.

    Raises:
        UsageError: a contradictory or invalid input, an unknown model or GPU, a bad bench
            file.
    """
    if settings.model is None:
        raise UsageError("no model given", "give --model NAME (e.g. llama-3-70b) or a config.json")
    model = resolve_model(settings.model)
    answer = None if nvml is None else nvml.query()
    rate = prefill_rate(settings, model, answer)
    bandwidth = read_bandwidth(settings)
    if not math.isfinite(settings.latency_us) or settings.latency_us < 0:
        raise UsageError(f"--latency-us {settings.latency_us} is negative", "give 0 or more")
    if not settings.prefix_tokens:
        raise UsageError("--prefix-tokens is empty", "give lengths like --prefix-tokens 1024,8192")
    for n in settings.prefix_tokens:
        if n <= 0:
            raise UsageError(f"prefix length {n} is not positive", "give token counts above 0")
    kvb = model.kv_bytes_per_token
    tps = rate.tokens_per_s
    gbps = None if bandwidth is None else bandwidth.gbytes_per_s
    cases = [
        compare(n, kv_bytes_per_token=kvb, prefill_tokens_per_s=tps, read_gbytes_per_s=gbps,
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
    missing = []
    if tps is None:
        missing.append(NO_PREFILL_HINT)
    if bandwidth is None:
        missing.append(NO_READ_HINT)
    assumptions = [FLOPS_ASSUMPTION] if rate.from_flops else []
    if rate.gpu is not None:
        assumptions.append(GPU_PEAK_ASSUMPTION)
    if bandwidth is not None:
        assumptions.append(READ_ASSUMPTION)
    return ReadbackPlan(
        model=model.name, model_source=model.source, kv_bytes_per_token=kvb,
        active_params=settings.params if settings.params is not None else model.active_params,
        prefill_tokens_per_s=tps, prefill_source=rate.source,
        read_gbytes_per_s=gbps, read_source="none given" if bandwidth is None else bandwidth.source,
        latency_us=settings.latency_us,
        cases=cases,
        break_even=None if tps is None or gbps is None else break_even(
            kv_bytes_per_token=kvb, prefill_tokens_per_s=tps, read_gbytes_per_s=gbps,
            latency_us=settings.latency_us),
        break_even_gbytes_per_s=None if tps is None else kvb * tps / 1e9,
        capacity=view,
        sizing=sizing(model, _gpu_memory(answer)),
        gpu=rate.gpu,
        missing=missing,
        assumptions=assumptions,
    )
