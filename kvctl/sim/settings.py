"""Settings of ``kvctl sim pool`` (section ``sim``; defaults are the reference workload)."""

from __future__ import annotations

import dataclasses

from kvctl.config import register_section
from kvctl.sim.replay import AnswerKv
from kvctl.sim.workload import WorkloadSpec


@register_section("sim")
@dataclasses.dataclass(frozen=True)
class SimSettings:
    """Workload, cluster and time-view parameters of ``kvctl sim pool``.

    Attributes:
        sessions, system_prompts, system_prompt_tokens, min_turns, max_turns, user_tokens,
            answer_tokens, block_size, seed: see :class:`~kvctl.sim.workload.WorkloadSpec`.
        instances: inference instances.
        local_blocks: local prefix-cache capacities per instance to compare, in blocks.
        pool_blocks: shared pool capacity in blocks.
        answer_kv: ``recomputed`` (decode KV never cached: the published model) or ``cached``.
        model: model name or config.json for the time view (``None``: no time view).
        prefill_tps: prefill throughput, tokens/s (time view).
        pool_gbytes_per_s: pool read-back bandwidth, GB/s decimal (time view); the old key
            ``pool_gbps`` is accepted, deprecated, for one release.
    """

    sessions: int = 300
    system_prompts: int = 3
    system_prompt_tokens: int = 512
    min_turns: int = 2
    max_turns: int = 6
    user_tokens: int = 128
    answer_tokens: int = 256
    block_size: int = 16
    seed: int = 0
    instances: int = 4
    local_blocks: tuple[int, ...] = (8000, 2000)
    pool_blocks: int = 400_000
    answer_kv: AnswerKv = AnswerKv.RECOMPUTED
    model: str | None = None
    prefill_tps: float | None = None
    pool_gbytes_per_s: float | None = dataclasses.field(
        default=None, metadata={"old_name": "pool_gbps"})

    def workload_spec(self) -> WorkloadSpec:
        """The workload part of these settings."""
        return WorkloadSpec(
            sessions=self.sessions, system_prompts=self.system_prompts,
            system_prompt_tokens=self.system_prompt_tokens, min_turns=self.min_turns,
            max_turns=self.max_turns, user_tokens=self.user_tokens,
            answer_tokens=self.answer_tokens, block_size=self.block_size, seed=self.seed,
        )
