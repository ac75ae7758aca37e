"""Which leading blocks of each prompt does a live KV store hold?

``kvctl verify-keys --store ADDR --prompts FILE`` computes every prompt's store key strings
under this instance's settings (the same keys ``verify-keys emit`` writes), asks the store
which of them it holds, and reports per prompt the *held prefix* (the blocks a prefix-cache
lookup would hit), the first missing block (where the chain breaks) and how many blocks are
held *after* that gap. Blocks held after a gap cannot be reached by prefix matching: the
missing block was evicted, or it was stored under a different key (an instance with other
settings, another profile or another block size wrote the rest).

Existence queries are batched: the keys of consecutive prompts are packed into requests of
at most :data:`MAX_KEYS_PER_CALL` keys, so a prompts file costs one round trip per ~4,000
keys, not one per key. The store is reached through an :data:`Exists` function; the kvctl
store (:class:`~kvctl.store.client.StoreClient`) and Mooncake
(:class:`~kvctl.store.mooncake.MooncakeStore`) are opened by :func:`open_store`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from collections.abc import Iterator, Sequence

from kvctl.errors import UsageError
from kvctl.keys.manifest import Manifest
from kvctl.keys.selfcheck import Exists, held_prefix
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.protocol import MAX_BATCH

_log = logging.getLogger("kvctl.keys.store_check")

#: Most keys in one existence query (the kvctl store master refuses larger batches).
MAX_KEYS_PER_CALL = MAX_BATCH

#: Store backends :func:`open_store` can reach.
BACKENDS = ("kvctl", "mooncake")

#: A kvctl store client used only for existence queries needs no big staging buffer.
_CHECK_STAGING_BYTES = 1 << 20


class Verdict(enum.StrEnum):
    """How a prompt's blocks sit in the store."""

    #: Every block is held: a full prefix hit.
    FULL = "full"
    #: Some leading blocks, nothing after the first missing one.
    PARTIAL = "partial"
    #: No block held.
    MISS = "miss"
    #: Blocks held after a missing one: prefix matching stops at the gap.
    BROKEN = "broken"
    #: The prompt is shorter than one block: it has no key.
    EMPTY = "empty"


@dataclasses.dataclass(frozen=True)
class PromptHold:
    """One prompt's blocks in the store.

    Attributes:
        prompt: prompt id.
        blocks: full blocks (keys) of the prompt.
        held_prefix: leading blocks the store holds (the prefix-hit length, in blocks).
        hit_fraction: ``held_prefix / blocks`` (1.0 for a prompt without blocks).
        first_missing_block: index of the first block the store lacks (where the chain
            breaks), ``None`` when every block is held.
        first_missing_key: that block's key string, ``None`` when every block is held.
        held_after_gap: blocks held after the first missing one (unreachable to prefix
            matching).
        verdict: :class:`Verdict`.
        below_expected: ``True`` when ``hit_fraction`` is under the expected hit fraction.
    """

    prompt: str
    blocks: int
    held_prefix: int
    hit_fraction: float
    first_missing_block: int | None
    first_missing_key: str | None
    held_after_gap: int
    verdict: Verdict
    below_expected: bool


@dataclasses.dataclass(frozen=True)
class StoreCheckReport:
    """What ``verify-keys --store`` found.

    Attributes:
        backend: ``kvctl`` or ``mooncake``.
        store: the store address that was asked.
        profile: key profile.
        block_size: tokens per block.
        key_format: ``raw`` or ``mooncake``.
        fingerprint: the settings fingerprint (as in ``verify-keys emit`` manifests).
        seed_source: where the chain's first link came from (``random``: keys cannot match
            another process's).
        expect_hit: the expected hit fraction, ``None`` when not checked.
        exists_calls: existence queries sent (round trips).
        keys_checked: keys asked about.
        prompts: one :class:`PromptHold` per prompt, in file order.
    """

    backend: str
    store: str
    profile: str
    block_size: int
    key_format: str
    fingerprint: str
    seed_source: str
    expect_hit: float | None
    exists_calls: int
    keys_checked: int
    prompts: list[PromptHold]

    @property
    def ok(self) -> bool:
        """No prompt is below the expected hit fraction (always true without one)."""
        return not any(p.below_expected for p in self.prompts)


def _verdict(blocks: int, held: int, after: int) -> Verdict:
    if blocks == 0:
        return Verdict.EMPTY
    if after:
        return Verdict.BROKEN
    if held == blocks:
        return Verdict.FULL
    return Verdict.PARTIAL if held else Verdict.MISS


def _answered(values: list[bool]) -> Exists:
    """An :data:`Exists` that replays answers already fetched in a batch."""

    def exists(_keys: Sequence[str]) -> list[bool]:
        return values

    return exists


def check_expect_hit(expect_hit: float | None) -> None:
    """Reject an expected hit fraction outside 0..1.

    Raises:
        UsageError: out of range.
    """
    if expect_hit is not None and not 0.0 <= expect_hit <= 1.0:
        raise UsageError(f"--expect-hit {expect_hit} is not a fraction between 0 and 1",
                         "give e.g. --expect-hit 0.9 (90% of each prompt's blocks held)")


def check_store(manifest: Manifest, exists: Exists, *, backend: str, store: str,
                expect_hit: float | None = None,
                max_keys_per_call: int = MAX_KEYS_PER_CALL) -> StoreCheckReport:
    """Ask ``exists`` which of each prompt's keys (from ``manifest``) the store holds.

    Keys of consecutive prompts share requests of up to ``max_keys_per_call`` keys.

    Args:
        manifest: the prompts' keys under this instance's settings
            (:func:`kvctl.keys.manifest.emit`).
        exists: the store's batch existence query, one bool per key, in order.
        backend: backend name, for the report.
        store: store address, for the report.
        expect_hit: fraction of each prompt's blocks that must be held as a prefix.

    Raises:
        UsageError: ``expect_hit`` out of range, or ``exists`` answered the wrong count.
    """
    check_expect_hit(expect_hit)
    if max_keys_per_call < 1:
        raise UsageError(f"max_keys_per_call {max_keys_per_call} is below 1",
                         "use 1 or more")
    all_keys = [key for p in manifest.prompts for key in p.keys]
    answers: list[bool] = []
    calls = 0
    for start in range(0, len(all_keys), max_keys_per_call):
        chunk = all_keys[start:start + max_keys_per_call]
        got = exists(chunk)
        calls += 1
        if len(got) != len(chunk):
            raise UsageError(f"store answered {len(got)} results for {len(chunk)} keys",
                             "the store's exists() must return one bool per key, in order")
        answers.extend(got)
    rows: list[PromptHold] = []
    offset = 0
    for p in manifest.prompts:
        mine = answers[offset:offset + len(p.keys)]
        offset += len(p.keys)
        held = held_prefix(p.id, p.keys, _answered(mine))
        blocks, lead, after = held.blocks, held.leading_held, held.held_after_gap
        fraction = lead / blocks if blocks else 1.0
        missing = lead if lead < blocks else None
        rows.append(PromptHold(
            prompt=p.id, blocks=blocks, held_prefix=lead, hit_fraction=fraction,
            first_missing_block=missing,
            first_missing_key=None if missing is None else p.keys[missing],
            held_after_gap=after, verdict=_verdict(blocks, lead, after),
            below_expected=expect_hit is not None and fraction < expect_hit))
    config = manifest.config
    _log.info("checked %d keys of %d prompts in %d existence queries", len(all_keys),
              len(rows), calls)
    return StoreCheckReport(
        backend=backend, store=store, profile=config.profile, block_size=config.block_size,
        key_format=config.key_format.value, fingerprint=manifest.fingerprint,
        seed_source=manifest.seed.source, expect_hit=expect_hit, exists_calls=calls,
        keys_checked=len(all_keys), prompts=rows)


@contextlib.contextmanager
def open_store(backend: str, address: str, *, token: str | None = None) -> Iterator[Exists]:
    """A batch existence query against a running store, closed on exit.

    Args:
        backend: ``kvctl`` (a kvctl store master) or ``mooncake`` (a Mooncake master over
            TCP; this process contributes no memory to its pool).
        address: master ``HOST:PORT`` (already resolved: see
            :func:`kvctl.store.embedded.resolve_master`).
        token: shared secret of a kvctl store.

    Raises:
        UsageError: unknown backend, or Mooncake without an address.
        StoreUnavailableError: the kvctl store master cannot be reached.
        MooncakeUnavailableError: the Mooncake package is missing or cannot connect.
    """
    if backend == "kvctl":
        from kvctl.store.client import StoreClient

        try:
            client = StoreClient(address, token=token, staging_bytes=_CHECK_STAGING_BYTES)
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(
                exc.cause, "start one with 'kvctl store serve', or pass --store HOST:PORT of "
                "a running master") from exc
        with client:
            yield client.batch_exists
        return
    if backend == "mooncake":
        if not address:
            raise UsageError("--backend mooncake needs --store HOST:PORT of a mooncake_master",
                             "pass the address the Mooncake master listens on")
        from kvctl.store.mooncake import MooncakeStore

        with MooncakeStore(address, global_segment_bytes=0) as store:

            def exists(keys: Sequence[str]) -> list[bool]:
                # MooncakeStore has no batch query: one is_exist per key.
                return [store.exists(k) for k in keys]

            yield exists
        return
    raise UsageError(f"unknown store backend {backend!r}", f"use one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "MAX_KEYS_PER_CALL", "PromptHold", "StoreCheckReport",
           "Verdict", "check_expect_hit", "check_store", "open_store"]
