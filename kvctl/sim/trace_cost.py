"""What the hits of a trace replay are worth: GPU-seconds and read-back bandwidth.

The planner's model (:mod:`kvctl.plan.readback`, ``kvctl plan readback``) applied to real
traffic:

- **GPU-seconds saved** = hit tokens (local + pool) / prefill tokens per second, where the
  rate is ``--prefill-tps`` or a GPU's peak x efficiency / (2 x active parameters) FLOPs
  per token, exactly as ``plan readback`` derives it.
- **Read-back bandwidth** = pool hit tokens x KV bytes per token / the trace's duration: the
  mean rate an instance's NIC must sustain to read its pool hits at the trace's own arrival
  rate, and the pool's total egress. Local hits do not cross the NIC and cost nothing here.
  Compared with ``--nic-gbytes-per-s`` (or a ``kvctl bench transfer --json`` result) when
  given: the share of the NIC's rate the reads take, on average (bursts need more).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.models import resolve_model
from kvctl.plan.readback import PlanSettings, prefill_rate, read_bandwidth
from kvctl.sim.trace import TraceReplay, TraceResult


@dataclasses.dataclass(frozen=True)
class InstanceCost:
    """One instance: GPU-seconds its hits saved, mean read-back GB/s (decimal), NIC share.

    ``readback_gbytes_per_s`` is ``None`` when the trace lasts 0 s and something was read
    back: bytes in no time have no rate (0 would say the NIC is idle)."""

    index: int
    gpu_seconds_saved: float | None
    readback_gbytes_per_s: float | None
    nic_share: float | None


@dataclasses.dataclass(frozen=True)
class ResultCost:
    """One configuration.

    Attributes:
        gpu_seconds_no_cache: prefilling every input token, summed over instances.
        gpu_seconds_saved: the hits' tokens at the prefill rate.
        pool_readback_gbytes_per_s: the pool's mean egress over the trace, GB/s (``None``:
            pool hits in a trace that lasts 0 s, which have no rate).
        busiest_nic_share: the largest per-instance NIC share (``None``: no NIC rate, or
            no read-back rate).
    """

    label: str
    gpu_seconds_no_cache: float | None
    gpu_seconds_saved: float | None
    pool_readback_gbytes_per_s: float | None
    busiest_nic_share: float | None
    per_instance: list[InstanceCost]


@dataclasses.dataclass(frozen=True)
class TraceCost:
    """The cost view: its inputs (with where each came from) and one row per configuration."""

    model: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float | None
    prefill_source: str
    nic_gbytes_per_s: float | None
    nic_source: str
    duration_s: float
    rows: list[ResultCost]


def _row(result: TraceResult, *, kvb: int, tps: float | None, nic: float | None,
         duration_s: float) -> ResultCost:
    def gbps(tokens: int) -> float | None:
        if duration_s > 0:
            return tokens * kvb / duration_s / 1e9
        return 0.0 if tokens == 0 else None  # bytes in no time: no rate

    per = []
    for inst in result.per_instance:
        rate = gbps(inst.pool_hit_tokens)
        per.append(InstanceCost(
            inst.index,
            None if tps is None else (inst.local_hit_tokens + inst.pool_hit_tokens) / tps,
            rate, None if nic is None or rate is None else rate / nic,
        ))
    shares = [p.nic_share for p in per if p.nic_share is not None]
    if len(shares) < len(per):  # no NIC rate, or a rate that does not exist
        shares = []
    hits = result.local_hit_tokens + result.pool_hit_tokens
    return ResultCost(
        label=result.label,
        gpu_seconds_no_cache=None if tps is None else result.input_tokens / tps,
        gpu_seconds_saved=None if tps is None else hits / tps,
        pool_readback_gbytes_per_s=gbps(result.pool_hit_tokens),
        busiest_nic_share=max(shares) if shares else None, per_instance=per,
    )


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The cost view's inputs, resolved and checked (before a replay: it can take a minute)."""

    model: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float | None
    prefill_source: str
    nic_gbytes_per_s: float | None
    nic_source: str


def cost_model(
    *,
    model: str,
    prefill_tps: float | None = None,
    gpu: str | None = None,
    gpu_tflops: float | None = None,
    gpus: int = 1,
    efficiency: float = 0.5,
    nic_gbytes_per_s: float | None = None,
    bench_file: Path | None = None,
) -> CostModel:
    """Resolve the model, the prefill rate and the NIC's rate as ``plan readback`` does.

    Raises:
        UsageError: an unknown model or GPU, contradictory or invalid rates, a bad bench file.
    """
    spec = resolve_model(model)
    if nic_gbytes_per_s is not None and not (0 < nic_gbytes_per_s < math.inf):
        raise UsageError(f"--nic-gbytes-per-s {nic_gbytes_per_s} is not a positive number",
                         "give the NIC's rate in GB/s (10^9 bytes/s), e.g. 50 for 400 Gb/s")
    if nic_gbytes_per_s is not None and bench_file is not None:
        raise UsageError("both --nic-gbytes-per-s and --bench-file are given",
                         "give one source of the NIC's rate")
    settings = PlanSettings(model=model, prefill_tps=prefill_tps, gpu=gpu,
                            gpu_tflops=gpu_tflops, gpus=gpus, efficiency=efficiency,
                            read_gbytes_per_s=nic_gbytes_per_s, bench_file=bench_file,
                            nvml=False)
    rate = prefill_rate(settings, spec)
    bandwidth = read_bandwidth(settings)
    return CostModel(
        model=spec.name, kv_bytes_per_token=spec.kv_bytes_per_token,
        prefill_tokens_per_s=rate.tokens_per_s,
        prefill_source=rate.source if rate.tokens_per_s is not None else
        "no prefill rate (give --prefill-tps, --gpu NAME or --gpu-tflops)",
        nic_gbytes_per_s=None if bandwidth is None else bandwidth.gbytes_per_s,
        nic_source="no NIC rate (give --nic-gbytes-per-s or --bench-file)" if bandwidth is None
        else "--nic-gbytes-per-s" if nic_gbytes_per_s is not None else bandwidth.source,
    )


def apply_cost(replay: TraceReplay, costs: CostModel) -> TraceCost:
    """The cost view of ``replay`` under ``costs``."""
    duration = replay.summary.duration_s
    rows = [_row(r, kvb=costs.kv_bytes_per_token, tps=costs.prefill_tokens_per_s,
                 nic=costs.nic_gbytes_per_s, duration_s=duration) for r in replay.results]
    return TraceCost(
        model=costs.model, kv_bytes_per_token=costs.kv_bytes_per_token,
        prefill_tokens_per_s=costs.prefill_tokens_per_s, prefill_source=costs.prefill_source,
        nic_gbytes_per_s=costs.nic_gbytes_per_s, nic_source=costs.nic_source,
        duration_s=duration, rows=rows,
    )
