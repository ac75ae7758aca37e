"""The synthetic multi-turn chat workload that ``kvctl sim pool`` replays.

Each session opens with one of a few shared system prompts; then every turn adds a user
message, the whole conversation so far is prefilled (the *prompt*), and an answer is decoded
that becomes history for the next turn. Turns of different sessions arrive interleaved
uniformly at random (a random merge that keeps each session's turns in order). Token ids are
synthetic: random 32-bit values from the seeded RNG, so distinct messages never share blocks
and the shared system prompts always do.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from array import array

from kvctl.errors import UsageError
from kvctl.keys.chain import chain_keys

#: Seed of the block-key chain in simulations (any constant: keys only need to be consistent).
SIM_KEY_SEED = b"kvctl-sim"


class Segment(enum.StrEnum):
    """Where a prompt token came from."""

    SYSTEM = "system_prompt"
    USER = "user_message"
    ANSWER = "answer"


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Shape of the workload (defaults: the reference workload).

    Attributes:
        sessions: number of chat sessions.
        system_prompts: distinct system prompts; each session starts with one, at random.
        system_prompt_tokens: tokens of each system prompt.
        min_turns, max_turns: turns per session, uniform in [min, max].
        user_tokens: tokens of each user message.
        answer_tokens: tokens of each answer.
        block_size: tokens per KV block (only full blocks are cached).
        seed: RNG seed of the token ids, the session shapes and the arrival order.
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

    def validate(self) -> None:
        """Raise :class:`UsageError` naming the first out-of-range field."""
        positive = {
            "sessions": self.sessions, "system-prompts": self.system_prompts,
            "min-turns": self.min_turns, "user-tokens": self.user_tokens,
            "block-size": self.block_size,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise UsageError(f"--{flag} {value} is not positive", f"give --{flag} 1 or more")
        for flag, value in {"system-prompt-tokens": self.system_prompt_tokens,
                            "answer-tokens": self.answer_tokens}.items():
            if value < 0:
                raise UsageError(f"--{flag} {value} is negative", f"give --{flag} 0 or more")
        if self.max_turns < self.min_turns:
            raise UsageError(
                f"--max-turns {self.max_turns} is below --min-turns {self.min_turns}",
                "give --max-turns >= --min-turns",
            )


@dataclasses.dataclass(frozen=True)
class Turn:
    """One arrival: turn ``turn`` (0-based) of session ``session``."""

    session: int
    turn: int


@dataclasses.dataclass
class Session:
    """A session's whole conversation and where each turn's prompt ends.

    Attributes:
        system_prompt: index of its system prompt.
        tokens: system prompt, then for each turn the user message and the answer.
        keys: block keys of every full block of ``tokens`` (a prompt's keys are a prefix).
        prompt_ends: token count of turn i's prompt (everything up to its user message).
        answer_ends: token count after turn i's answer.
        segments: ``(start, end, Segment)`` token ranges of ``tokens``.
    """

    system_prompt: int
    tokens: array[int]
    keys: list[bytes]
    prompt_ends: list[int]
    answer_ends: list[int]
    segments: list[tuple[int, int, Segment]]


@dataclasses.dataclass
class Workload:
    """Generated sessions and their interleaved arrival order."""

    spec: WorkloadSpec
    sessions: list[Session]
    arrivals: list[Turn]

    @property
    def turns(self) -> int:
        """Number of turns (prefills) in the workload."""
        return len(self.arrivals)

    @property
    def prefill_tokens(self) -> int:
        """Σ prompt tokens over all turns: what prefill would compute with no cache at all."""
        return sum(end for s in self.sessions for end in s.prompt_ends)


def _random_tokens(rng: random.Random, count: int) -> array[int]:
    tokens = array("I")
    tokens.frombytes(rng.randbytes(4 * count))
    return tokens


def generate(spec: WorkloadSpec) -> Workload:
    """Build the workload of ``spec`` (deterministic in ``spec.seed``)."""
    spec.validate()
    rng = random.Random(spec.seed)
    system = [_random_tokens(rng, spec.system_prompt_tokens) for _ in range(spec.system_prompts)]
    sessions: list[Session] = []
    for _ in range(spec.sessions):
        which = rng.randrange(spec.system_prompts)
        turns = rng.randint(spec.min_turns, spec.max_turns)
        tokens = array("I", system[which])
        segments = [(0, len(tokens), Segment.SYSTEM)]
        prompt_ends: list[int] = []
        answer_ends: list[int] = []
        for _turn in range(turns):
            start = len(tokens)
            tokens.extend(_random_tokens(rng, spec.user_tokens))
            segments.append((start, len(tokens), Segment.USER))
            prompt_ends.append(len(tokens))
            start = len(tokens)
            tokens.extend(_random_tokens(rng, spec.answer_tokens))
            segments.append((start, len(tokens), Segment.ANSWER))
            answer_ends.append(len(tokens))
        keys = chain_keys(tokens, block_size=spec.block_size, seed=SIM_KEY_SEED,
                          hash_name="sha256")
        sessions.append(Session(which, tokens, keys, prompt_ends, answer_ends, segments))
    order = [i for i, s in enumerate(sessions) for _ in s.prompt_ends]
    rng.shuffle(order)
    seen = [0] * len(sessions)
    arrivals: list[Turn] = []
    for i in order:
        arrivals.append(Turn(i, seen[i]))
        seen[i] += 1
    return Workload(spec, sessions, arrivals)
