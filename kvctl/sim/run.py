"""``kvctl sim pool`` as one library call: generate, replay every cell, explain the floor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvctl.errors import UsageError
from kvctl.models import resolve_model
from kvctl.sim.pool import LruPool, PoolBackend
from kvctl.sim.replay import AnswerKv, CellResult, Floor, PoolFactory, floor, run_grid
from kvctl.sim.settings import SimSettings
from kvctl.sim.timing import CellTime, TimeModel, time_view
from kvctl.sim.workload import WorkloadSpec, generate


@dataclasses.dataclass(frozen=True)
class WorkloadSummary:
    """What was replayed: the spec and the totals it produced."""

    spec: WorkloadSpec
    turns: int
    prefill_tokens: int
    instances: int
    pool_blocks: int
    answer_kv: AnswerKv
    pool_backend: str


@dataclasses.dataclass(frozen=True)
class TimeView:
    """The time view: its inputs and one row per cell."""

    model: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    pool_read_gbytes_per_s: float
    rows: list[CellTime]


@dataclasses.dataclass(frozen=True)
class PoolReport:
    """Everything ``kvctl sim pool`` reports."""

    workload: WorkloadSummary
    cells: list[CellResult]
    floor: Floor
    floor_explanation: str
    time_view: TimeView | None


def _time_model(settings: SimSettings) -> TimeModel | None:
    model, tps, gbps = settings.model, settings.prefill_tps, settings.pool_gbytes_per_s
    if model is None or tps is None or gbps is None:
        given = {"--model": model, "--prefill-tps": tps, "--pool-gbytes-per-s": gbps}
        missing = [flag for flag, value in given.items() if value is None]
        if len(missing) == len(given):
            return None
        raise UsageError(
            f"the time view needs --model, --prefill-tps and --pool-gbytes-per-s; missing "
            f"{', '.join(missing)}",
            "give all three (e.g. --model llama-3-70b --prefill-tps 5000 --pool-gbytes-per-s 20) "
            "or none",
        )
    return TimeModel(resolve_model(model), tps, gbps)


def explain_floor(spec: WorkloadSpec, fl: Floor, answer_kv: AnswerKv) -> str:
    """One paragraph saying why no cache gets below ``fl.fraction``."""
    if answer_kv is AnswerKv.RECOMPUTED:
        answer = (
            f" and, from the second turn on, the previous answer ({spec.answer_tokens} "
            "tokens): its KV was made by decode and is never offered to a cache (in "
            "disaggregated serving it stays on the decode instance), so the next prompt "
            "prefills it again (--answer-kv cached counts it as a hit instead)"
        )
    else:
        answer = " (the previous answer's KV is cached with the prompt: --answer-kv cached)"
    return (
        f"Floor {100 * fl.fraction:.1f}%: even one unbounded cache shared by every instance "
        f"recomputes, on every turn, the new user message ({spec.user_tokens} tokens, never "
        f"seen before){answer}. Add the first use of each system prompt and any partial last "
        f"block. Here: {fl.new_user_message_tokens:,} user-message + "
        f"{fl.previous_answer_tokens:,} answer + {fl.system_prompt_tokens:,} system-prompt + "
        f"{fl.partial_block_tokens:,} partial-block tokens = {fl.recomputed_tokens:,} of "
        f"{fl.prefill_tokens:,} prefill tokens."
    )


def simulate_pool(
    settings: SimSettings,
    *,
    pool_factory: PoolFactory = LruPool,
    on_cell: Callable[[CellResult], None] | None = None,
) -> PoolReport:
    """Run ``kvctl sim pool``: every routing x pool x local capacity on one workload.

    Raises:
        UsageError: a parameter is out of range or the time-view inputs are incomplete.
    """
    costs = _time_model(settings)  # validate before the long part
    if not settings.local_blocks:
        raise UsageError("--local-blocks is empty", "give capacities like --local-blocks 8000,2000")
    for capacity in settings.local_blocks:
        if capacity < 0:
            raise UsageError(f"--local-blocks {capacity} is negative", "give 0 or more blocks")
    if settings.pool_blocks <= 0:
        raise UsageError(f"--pool-blocks {settings.pool_blocks} is not positive",
                         "give --pool-blocks 1 or more")
    if settings.instances <= 0:
        raise UsageError(f"--instances {settings.instances} is not positive",
                         "give --instances 1 or more")
    spec = settings.workload_spec()
    workload = generate(spec)
    backends: list[str] = []

    def make_pool(capacity_blocks: int) -> PoolBackend:
        pool = pool_factory(capacity_blocks)
        backends.append(pool.name)
        return pool

    cells = run_grid(
        workload, instances=settings.instances, local_blocks=settings.local_blocks,
        pool_blocks=settings.pool_blocks, pool_factory=make_pool,
        answer_kv=settings.answer_kv, on_cell=on_cell,
    )
    fl = floor(workload, settings.answer_kv)
    view = None
    if costs is not None:
        view = TimeView(
            model=costs.model.name, kv_bytes_per_token=costs.model.kv_bytes_per_token,
            prefill_tokens_per_s=costs.prefill_tokens_per_s,
            pool_read_gbytes_per_s=costs.pool_read_gbytes_per_s, rows=time_view(cells, costs),
        )
    summary = WorkloadSummary(
        spec=spec, turns=workload.turns, prefill_tokens=workload.prefill_tokens,
        instances=settings.instances, pool_blocks=settings.pool_blocks,
        answer_kv=settings.answer_kv, pool_backend=backends[0] if backends else "none",
    )
    return PoolReport(summary, cells, fl, explain_floor(spec, fl, settings.answer_kv), view)
