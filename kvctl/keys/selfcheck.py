"""Self-checks of a key scheme on built-in sample prompts, and the store-holding check.

:func:`self_check` runs the chain invariants against any profile:

- determinism: the same prompt twice gives the same keys;
- shared prefix: two prompts with the same first blocks share exactly those keys;
- a change at token ``t``: every key from ``t``'s block on differs and none before it;
- a different seed setting: every key differs (for each setting the profile mixes in);
- partial blocks: only full blocks have keys;
- uniqueness: no key repeats within a prompt (also for a prompt of identical blocks).

:func:`tenant_isolation` checks that two tenants' keys for the same prompt share nothing,
using the mechanism each profile isolates tenants with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvctl.errors import UsageError
from kvctl.keys.profiles import KeyConfig, Keyer, KeyProfile, get_profile
from kvctl.keys.prompts import LoraRef, Prompt


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One self-check: its name, verdict and what was seen."""

    name: str
    passed: bool
    detail: str


def sample_prompts(block_size: int) -> list[Prompt]:
    """Built-in prompts: 4.5 blocks of varied ids, and 3 blocks of one repeated id."""
    n = block_size * 4 + block_size // 2
    tokens = tuple((i * 7919 + 13) % 151_936 for i in range(n))
    return [Prompt("sample", tokens), Prompt("repeated", (42,) * (block_size * 3))]


def _check(name: str, ok: bool, good: str, bad: str) -> CheckResult:
    return CheckResult(name, ok, good if ok else bad)


def _variants(profile: KeyProfile, config: KeyConfig, prompt: Prompt
              ) -> list[tuple[str, KeyConfig, Prompt]]:
    """One changed setting at a time, for each setting the profile mixes into keys."""
    f = config.fields
    out: list[tuple[str, KeyConfig, Prompt]] = []

    def field(name: str, **changes: object) -> None:
        out.append((name, dataclasses.replace(config, fields=f.replace(**changes)), prompt))

    mixed = profile.mixed(config.key_format)
    if "model" in mixed:
        field("model", model=f.model + "-other")
    if "revision" in mixed:
        field("revision", revision=f.revision + "-other")
    if "tenant" in mixed:
        field("tenant", tenant=f.tenant + "-other")
    if "kv_dtype" in mixed:
        field("kv_dtype", kv_dtype=f.kv_dtype + "-other")
    if "kv_layout" in mixed:
        field("kv_layout", kv_layout=f.kv_layout + "-other")
    if "extra" in mixed:
        field("extra", extra=(*f.extra, ("selfcheck", "1")))
    if "lora" in mixed:
        out.append(("lora", config, dataclasses.replace(prompt, lora=LoraRef("other", "/x"))))
    if "cache_salt" in mixed:
        out.append(("cache_salt", config, dataclasses.replace(prompt, cache_salt="other")))
    if "pythonhashseed" in mixed:
        seed = "1" if config.pythonhashseed != "1" else "2"
        out.append(("pythonhashseed", dataclasses.replace(config, pythonhashseed=seed), prompt))
    for name in ("world_size", "worker_id", "tp_rank"):
        if name in mixed:
            value = getattr(config, name) + 1
            out.append((name, dataclasses.replace(config, **{name: value}), prompt))
    return out


def _pinned(profile: KeyProfile, config: KeyConfig) -> tuple[KeyConfig, list[CheckResult]]:
    """``config`` with PYTHONHASHSEED pinned when the profile would otherwise draw a random
    first link (so the other checks compare like with like), and the verdict on that."""
    if profile.keyer(config).seed.reproducible:
        return config, []
    failed = CheckResult(
        "reproducible across processes", False,
        f"PYTHONHASHSEED is unset and {profile.name} draws a random first link per process: "
        "no two instances share keys (set the same PYTHONHASHSEED everywhere); other checks "
        "ran with PYTHONHASHSEED=0")
    return dataclasses.replace(config, pythonhashseed="0"), [failed]


def self_check(config: KeyConfig) -> list[CheckResult]:
    """Run every invariant on the sample prompts under ``config``."""
    profile = get_profile(config.profile)
    config, results = _pinned(profile, config)
    keyer = profile.keyer(config)
    size = config.block_size
    sample, repeated = sample_prompts(size)
    base = keyer.keys(sample)
    blocks = profile.keyed_blocks(len(sample.tokens), config)
    partial = blocks > len(sample.tokens) // size  # LMCache save_unfull_chunk
    results += [
        _check("deterministic", keyer.keys(sample) == base
               and profile.keyer(config).keys(sample) == base,
               f"{len(base)} keys identical on recomputation", "keys changed on recomputation"),
        _check("a partial last block has one key" if partial else "partial blocks have no key",
               len(base) == blocks,
               f"{len(sample.tokens)} tokens -> {len(base)} keys (block size {size})",
               f"{len(sample.tokens)} tokens -> {len(base)} keys, expected {blocks}"),
    ]
    short = dataclasses.replace(sample, tokens=sample.tokens[: size - 1])
    below = profile.keyed_blocks(size - 1, config)
    results.append(_check("no key below one block" if not below else
                          "one key below one block", len(keyer.keys(short)) == below,
                          f"{size - 1} tokens -> {below or 'no'} key",
                          f"{size - 1} tokens got {len(keyer.keys(short))} keys"))
    shared = 2
    fork = dataclasses.replace(sample, id="fork",
                               tokens=sample.tokens[: shared * size] + (7,) * (2 * size))
    fk = keyer.keys(fork)
    results.append(_check(
        "same prefix, same keys",
        fk[:shared] == base[:shared] and all(x != y for x, y in zip(fk[shared:], base[shared:],
                                                                    strict=False)),
        f"{shared} shared blocks share keys, later blocks differ",
        "keys of a shared prefix differ, or keys after the fork are shared"))
    bad_positions = []
    keyed = min(len(base) * size, len(sample.tokens))  # tokens under a key
    for t in sorted({0, size - 1, size, keyed // 2, keyed - 1}):
        tokens = list(sample.tokens)
        tokens[t] = (tokens[t] + 1) % 151_936
        changed = keyer.keys(dataclasses.replace(sample, tokens=tuple(tokens)))
        b = t // size
        if changed[:b] != base[:b] or any(x == y for x, y in zip(changed[b:], base[b:],
                                                                 strict=True)):
            bad_positions.append(t)
    results.append(_check(
        "a change at token t changes every key from t's block on, none before",
        not bad_positions, "checked tokens at block edges and middle",
        f"violated for token position(s) {bad_positions}"))
    rk = keyer.keys(repeated)
    results.append(_check("keys unique within a prompt", len(set(rk)) == len(rk) and
                          len(set(base)) == len(base),
                          "a prompt of identical blocks still gets distinct keys",
                          "a key repeats within one prompt"))
    for name, variant_config, variant_prompt in _variants(profile, config, sample):
        other = profile.keyer(variant_config).keys(variant_prompt)
        shared_keys = sum(x == y for x, y in zip(other, base, strict=False))
        results.append(_check(f"different {name}, every key differs", shared_keys == 0,
                              f"0 of {len(base)} keys shared",
                              f"{shared_keys} of {len(base)} keys shared"))
    return results


def _tenant_keyer(profile: KeyProfile, config: KeyConfig, tenant: str,
                  prompt: Prompt) -> tuple[Keyer, Prompt]:
    mixed = profile.mixed(config.key_format)
    if "tenant" in mixed:
        fields = config.fields.replace(tenant=tenant)
        return profile.keyer(dataclasses.replace(config, fields=fields)), prompt
    if "cache_salt" in mixed:  # vLLM, SGLang: tenants are isolated by cache_salt
        return profile.keyer(config), dataclasses.replace(prompt, cache_salt=tenant)
    return profile.keyer(config), prompt


def tenant_isolation(config: KeyConfig, tenants: Sequence[str]) -> list[CheckResult]:
    """For each pair of ``tenants``: the same prompt's keys share nothing.

    kvctl profiles use the ``tenant`` seed field; vLLM and SGLang use the request's
    ``cache_salt`` (their isolation mechanism); a profile with neither fails.
    """
    if len(tenants) < 2 or len(set(tenants)) != len(tenants):
        raise UsageError(f"tenant isolation needs two or more distinct tenants, got {tenants}",
                         "pass e.g. --tenants tenant-a,tenant-b")
    profile = get_profile(config.profile)
    config, results = _pinned(profile, config)
    mixed = profile.mixed(config.key_format)
    how = ("tenant seed field" if "tenant" in mixed else
           "cache_salt" if "cache_salt" in mixed else None)
    for prompt in sample_prompts(config.block_size):
        keys = {}
        for tenant in tenants:
            keyer, p = _tenant_keyer(profile, config, tenant, prompt)
            keys[tenant] = set(keyer.keys(p))
        for i, a in enumerate(tenants):
            for b in tenants[i + 1 :]:
                shared = len(keys[a] & keys[b])
                name = f"tenants {a} / {b} share no key ({prompt.id})"
                if how is None:
                    results.append(CheckResult(name, shared == 0,
                                               f"{profile.name} mixes no tenant into keys: "
                                               f"{shared} of {len(keys[a])} keys shared"))
                else:
                    results.append(_check(name, shared == 0, f"isolated by {how}",
                                          f"{shared} of {len(keys[a])} keys shared"))
    return results


@dataclasses.dataclass(frozen=True)
class HeldPrefix:
    """How much of a prompt's prefix a store holds.

    Attributes:
        prompt: prompt id.
        blocks: number of full blocks (keys) of the prompt.
        leading_held: number of leading blocks the store holds (a prefix hit length).
        held_after_gap: blocks held after the first missing one (unreachable for prefix
            matching: a sign of eviction or of keys computed differently).
    """

    prompt: str
    blocks: int
    leading_held: int
    held_after_gap: int


Exists = Callable[[Sequence[str]], list[bool]]


def held_prefix(prompt_id: str, keys: Sequence[str], exists: Exists) -> HeldPrefix:
    """Ask ``exists`` (a store's batch existence query) which of ``keys`` it holds.

    Raises:
        UsageError: ``exists`` answered with the wrong number of results.
    """
    answer = exists(list(keys)) if keys else []
    if len(answer) != len(keys):
        raise UsageError(f"store answered {len(answer)} results for {len(keys)} keys",
                         "the store's exists() must return one bool per key, in order")
    leading = next((i for i, held in enumerate(answer) if not held), len(answer))
    after = sum(answer[leading:])
    return HeldPrefix(prompt_id, len(keys), leading, after)


__all__ = ["CheckResult", "HeldPrefix", "held_prefix", "sample_prompts", "self_check",
           "tenant_isolation"]
