"""The live check: every instance's chains, blocks held and sequence numbers, and findings.

Feed it each instance's messages in order (:meth:`Checker.feed`); it never raises on what
a publisher sends. Per ``BlockStored`` block it:

1. **verifies** the hash: the parent's digest must be known — the chain's root (parent
   ``None``), a parent this instance published earlier and kvctl recomputed, or a parent
   published as full digest bytes. Int hashes are truncated digests, so a chain can be
   checked only from its root: blocks whose parent kvctl never saw (it joined late, or a
   gap was not filled) are counted unverifiable with that reason, never as mismatches.
   The first mismatch of an instance is diagnosed by trying the other hash algorithms and
   the default seed, and by what the event carries (LoRA, salt, block size);
2. keys it by **content** (its tokens, extra keys and its parent's content, whatever the
   hashes): the same content published under two different hashes by two instances is a
   **divergence**, reported with its first block;
3. counts what a **pool** would have saved: a block an instance stores while not holding it
   is *computed* (prefill it did); if another instance held that content at that moment,
   the tokens were *duplicated* across instances. ``BlockRemoved`` and
   ``AllBlocksCleared`` keep the held sets right; a ``BlockStored`` of a block already held
   (vLLM re-announces prefix hits) is a *reuse*, not a computation.

Memory is bounded: per instance at most ``max_blocks`` chain links and held blocks (the
oldest forgotten first, and counted), the content index likewise, and per-second buckets for
the ``window_s`` window.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import xxhash

from kvctl.keys.compare import Cause
from kvctl.keys.profiles import KeyConfig
from kvctl.keys.watch.hashing import EventHasher, Unverifiable, alternatives, event_hasher
from kvctl.keys.watch.wire import (
    AllBlocksCleared,
    BadFrame,
    Batch,
    BlockHash,
    BlockRemoved,
    BlockStored,
    decode_payload,
)

#: Findings kept for the report (counters keep counting past it).
MAX_FINDINGS = 200
#: Distinct reasons counted per instance for blocks not verifiable (a reason can name a
#: LoRA adapter or an extra key, which a publisher chooses); the rest are counted together.
MAX_REASONS = 32
OTHER_REASONS = "other reasons (more distinct reasons than kvctl counts apart)"
ROOT = b"kvctl/kv-events/root"

_ck = xxhash.xxh3_128_digest
_pack = msgspec.msgpack.encode


@dataclasses.dataclass(frozen=True)
class Finding:
    """Something an operator should know, as it happened.

    Attributes:
        kind: ``mismatch``, ``divergence``, ``gap``, ``gap-filled``, ``restart``,
            ``reordered``, ``bad-frame``, ``unknown-event``, ``dead-endpoint``.
        severity: ``error`` (keys disagree), ``warning`` (data lost or unreadable),
            ``info``.
        instance: the instance it concerns.
        message: one sentence for people.
        seq: the message's sequence number, where there is one.
        causes: a mismatch's likely causes, most likely first.
        details: facts for scripts (hashes as hex, tokens, block index).
        ts: when kvctl saw it (seconds since the epoch).
    """

    kind: str
    severity: str
    instance: str
    message: str
    seq: int | None = None
    causes: tuple[Cause, ...] = ()
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    ts: float = 0.0


@dataclasses.dataclass
class InstanceStats:
    """Counters of one instance (totals since the watch started)."""

    batches: int = 0
    events: int = 0
    blocks_seen: int = 0
    verified: int = 0
    mismatched: int = 0
    divergent: int = 0
    unverifiable: dict[str, int] = dataclasses.field(default_factory=dict)
    computed_blocks: int = 0
    computed_tokens: int = 0
    duplicate_blocks: int = 0
    duplicate_tokens: int = 0
    reused_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    forgotten_blocks: int = 0
    gaps: int = 0
    gap_batches_lost: int = 0
    gaps_filled: int = 0
    restarts: int = 0
    reordered: int = 0
    bad_frames: int = 0
    unknown_events: int = 0


class _Instance:
    def __init__(self, name: str, endpoint: str) -> None:
        self.name = name
        self.endpoint = endpoint
        self.next_seq: int | None = None
        self.last_ts: float | None = None
        #: published hash -> (recomputed digest, or why it has none; content key)
        self.chain: dict[BlockHash, tuple[bytes | str, bytes]] = {}
        #: held-block key (:func:`_held_key`) -> content key, of the blocks held now
        self.held: dict[Any, bytes] = {}
        #: content key -> blocks held with it (two groups may hold one content)
        self.held_ck: dict[bytes, int] = {}
        self.stats = InstanceStats()
        self.window: collections.deque[list[int]] = collections.deque()
        self.mismatch_reported = False
        self.state = "waiting"

    def reset_cache(self) -> None:
        self.held.clear()
        self.held_ck.clear()


@dataclasses.dataclass(frozen=True)
class WindowFigures:
    """Pool figures over the last window: tokens computed, duplicated, and the share."""

    window_s: float
    computed_tokens: int
    duplicate_tokens: int

    @property
    def duplicate_share(self) -> float | None:
        """Duplicated tokens over computed tokens (``None`` before any)."""
        return self.duplicate_tokens / self.computed_tokens if self.computed_tokens else None


class Checker:
    """Check the KV events of several instances under one key configuration.

    Args:
        config: the key configuration every instance should follow.
        window_s: the window of the windowed pool figures, seconds.
        max_blocks: per instance, chain links and held blocks remembered (oldest forgotten).
        on_finding: called with each :class:`Finding` as it is made.
        clock: seconds since the epoch (tests pass a fake).
    """

    def __init__(self, config: KeyConfig, *, window_s: float = 60.0,
                 max_blocks: int = 1_000_000,
                 on_finding: Callable[[Finding], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.hasher: EventHasher = event_hasher(config)
        self._alternatives: list[tuple[str, str, EventHasher]] | None = None
        self.window_s = window_s
        self.max_blocks = max_blocks
        self.clock = clock
        self.on_finding = on_finding
        self.instances: dict[str, _Instance] = {}
        #: content key -> (instance, published hash): who published that content first
        self.owners: dict[bytes, tuple[str, BlockHash]] = {}
        #: content key -> its verified digest, whichever instance verified it first (the
        #: same content after the same verified ancestry is not hashed again)
        self.digests: dict[bytes, bytes] = {}
        self.divergent_pairs: dict[tuple[str, str], int] = {}
        self.findings: list[Finding] = []
        self.findings_total: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ instances

    def add_instance(self, name: str, endpoint: str = "") -> None:
        """Watch instance ``name`` (at ``endpoint``, for messages)."""
        self.instances[name] = _Instance(name, endpoint)

    def set_state(self, name: str, state: str) -> None:
        """``waiting``, ``live``, ``dead: why``: what the subscription says."""
        self.instances[name].state = state

    def stats(self, name: str) -> InstanceStats:
        """The counters of instance ``name``."""
        return self.instances[name].stats

    def held(self, name: str) -> int:
        """Blocks instance ``name`` holds now (stored, not removed or cleared since)."""
        return len(self.instances[name].held)

    def report(self, finding: Finding) -> None:
        """Keep ``finding`` (the first :data:`MAX_FINDINGS`) and pass it on."""
        self.findings_total[finding.kind] += 1
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(finding)
        if self.on_finding is not None:
            self.on_finding(finding)

    def _find(self, kind: str, severity: str, inst: _Instance, message: str, **kw: Any) -> None:
        self.report(Finding(kind, severity, inst.name, message, ts=self.clock(), **kw))

    # ------------------------------------------------------------------ sequence

    def expected_seq(self, name: str) -> int | None:
        """The next sequence number instance ``name`` should send (``None``: none seen)."""
        return self.instances[name].next_seq

    def check_seq(self, name: str, seq: int) -> tuple[str, int]:
        """What message ``seq`` of ``name`` is: ``("next", seq)``, ``("gap", first
        missing)``, ``("restart", 0)`` or ``("old", expected)`` (a duplicate or reordered
        message, to drop). Changes nothing."""
        inst = self.instances[name]
        expected = 0 if inst.next_seq is None else inst.next_seq
        if seq == expected:
            return "next", seq
        if seq > expected:
            return "gap", expected
        if seq == 0:
            return "restart", 0
        return "old", expected

    def note_gap(self, name: str, first: int, upto: int, *, filled: int,
                 problem: str | None = None) -> None:
        """Messages ``first..upto-1`` of ``name`` were missed; ``filled`` came by replay
        (``problem``: why the replay did not give them all)."""
        inst = self.instances[name]
        lost = upto - first - filled
        if filled:
            inst.stats.gaps_filled += 1
        if lost <= 0:
            self._find("gap-filled", "info", inst,
                       f"{inst.name}: sequence gap {first}..{upto - 1} filled from the replay "
                       "endpoint", seq=upto)
            return
        inst.stats.gaps += 1
        inst.stats.gap_batches_lost += lost
        why = ("joined after the publisher started" if first == 0
               else "messages were lost (subscriber too slow, or the network)")
        self._find("gap", "warning", inst,
                   f"{inst.name}: {lost} message(s) of {first}..{upto - 1} missing ({why}); "
                   f"{filled} recovered from the replay endpoint"
                   f"{f' ({problem})' if problem else ''}. Blocks chained on what was "
                   "missed cannot be verified", seq=upto,
                   details={"first": first, "last": upto - 1, "lost": lost, "filled": filled})

    # ------------------------------------------------------------------ messages

    def feed(self, name: str, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        """Check message ``seq`` of instance ``name`` (already in order: see
        :meth:`check_seq`). Bad payloads and unknown events become findings."""
        inst = self.instances[name]
        verdict, _ = self.check_seq(name, seq)
        if verdict == "restart":
            inst.stats.restarts += 1
            self._find("restart", "warning", inst,
                       f"{inst.name}: sequence back to 0 after {inst.next_seq}: the publisher "
                       "restarted; its cache starts empty", seq=seq)
            inst.reset_cache()
            inst.chain.clear()
        elif verdict == "old" and self._restarted(inst, payload):
            inst.stats.restarts += 1
            self._find("restart", "warning", inst,
                       f"{inst.name}: sequence back to {seq} after {inst.next_seq} with a later "
                       "timestamp: the publisher restarted (its first messages were missed); "
                       "its cache starts empty", seq=seq)
            inst.reset_cache()
            inst.chain.clear()
        elif verdict == "old":
            inst.stats.reordered += 1
            self._find("reordered", "warning", inst,
                       f"{inst.name}: message {seq} arrived after {inst.next_seq} was expected "
                       "(duplicate or reordered): dropped", seq=seq)
            return
        inst.next_seq = seq + 1
        batch = decode_payload(payload)
        if isinstance(batch, BadFrame):
            inst.stats.bad_frames += 1
            self._find("bad-frame", "warning", inst, f"{inst.name}: message {seq}: "
                       f"{batch.problem}: skipped", seq=seq)
            return
        inst.stats.batches += 1
        inst.last_ts = batch.ts
        for unknown in batch.unknown:
            inst.stats.unknown_events += 1
            self._find("unknown-event", "warning", inst,
                       f"{inst.name}: message {seq}: {unknown.problem}: skipped (a newer "
                       "engine? the other events are checked)", seq=seq,
                       details={"type": unknown.tag})
        for event in batch.events:
            inst.stats.events += 1
            if isinstance(event, BlockStored):
                self._stored(inst, event, seq)
            elif isinstance(event, BlockRemoved):
                self._removed(inst, event)
            elif isinstance(event, AllBlocksCleared):
                inst.stats.cleared += 1
                inst.reset_cache()

    @staticmethod
    def _restarted(inst: _Instance, payload: bytes) -> bool:
        """An old sequence number with a timestamp past the last one: a new publisher."""
        batch = decode_payload(payload)
        return (isinstance(batch, Batch) and inst.last_ts is not None
                and batch.ts > inst.last_ts)

    def bad_message(self, name: str, problem: str) -> None:
        """A message of ``name`` that is not ``(topic, seq, payload)``."""
        inst = self.instances[name]
        inst.stats.bad_frames += 1
        self._find("bad-frame", "warning", inst, f"{inst.name}: {problem}: skipped")

    def _removed(self, inst: _Instance, event: BlockRemoved) -> None:
        tier, group = _tier(event.medium), event.group_idx
        for h in event.block_hashes:
            if self._drop(inst, _held_key(tier, group, h)):
                inst.stats.removed_blocks += 1

    @staticmethod
    def _drop(inst: _Instance, key: Any) -> bool:
        ck = inst.held.pop(key, None)
        if ck is None:
            return False
        held_ck = inst.held_ck
        left = held_ck.get(ck, 0) - 1
        if left > 0:
            held_ck[ck] = left
        else:
            held_ck.pop(ck, None)
        return True

    def _stored(self, inst: _Instance, ev: BlockStored, seq: int) -> None:
        stats = inst.stats
        hashes = ev.block_hashes
        size = ev.block_size or (len(ev.token_ids) // len(hashes) if hashes else 0)
        tokens = ev.token_ids
        if not hashes or size <= 0 or len(tokens) != size * len(hashes):
            stats.bad_frames += 1
            self._find("bad-frame", "warning", inst,
                       f"{inst.name}: message {seq}: BlockStored with {len(hashes)} hash(es), "
                       f"{len(tokens)} token(s) and block size {size} does not add up: skipped",
                       seq=seq)
            return
        hasher = self.hasher
        config_size = self.config.block_size
        extra = ev.extra_keys
        lora, salt = ev.lora_name, ev.cache_salt
        chain = inst.chain
        others = [o.held_ck for o in self.instances.values() if o is not inst]
        parent = ev.parent_block_hash
        reason: str | None = hasher.root_unverifiable
        if parent is None:
            digest: bytes | None = None
            ck = ROOT
        else:
            link = chain.get(parent)
            if link is not None:
                known, ck = link
                if isinstance(known, str):
                    digest = None
                    reason = reason or known
                else:
                    digest = known
            else:
                ck = b"?" + (parent if isinstance(parent, bytes) else parent.to_bytes(
                    9, "big", signed=True))
                if isinstance(parent, bytes):
                    digest = parent
                else:
                    digest = None
                    reason = reason or ("parent block never seen (kvctl joined after it was "
                                        "stored, or a gap was not filled): int hashes are "
                                        "truncated, so chains verify only from their root")
        if size != config_size:
            self._block_size(inst, size, seq)
        checkable = size == config_size
        block_fn, as_int = hasher.block, hasher.published_int
        n_extra = len(extra) if extra is not None else 0
        lora_b = b"" if lora is None else lora.encode()
        owners, held, held_ck = self.owners, inst.held, inst.held_ck
        digests = self.digests
        max_blocks, name = self.max_blocks, inst.name
        owner_cap = max_blocks * max(1, len(self.instances))
        tier, group = _tier(ev.medium), ev.group_idx
        plain = tier is None and not group  # held under the bare hash: the common case
        prefill = tier is None  # a store to a lower tier is an offload, not a computation
        verified = mismatched = computed = duplicated = reused = 0
        unverifiable = stats.unverifiable
        for i, published in enumerate(hashes):
            start = i * size
            block = tokens[start:start + size]
            entry = extra[i] if i < n_extra else None  # type: ignore[index]
            if entry is None:
                ck = _ck(ck + _pack(block) + lora_b)
            else:
                ck = _ck(ck + _pack(block) + _pack(entry) + lora_b)
            # -- fidelity: recompute from the parent's digest
            mine: bytes | None = None
            counted = False
            if not checkable:
                mismatched += 1
                counted = True
            elif reason is None:
                cached = digests.get(ck)
                if cached is not None:
                    mine = cached
                else:
                    try:
                        mine = block_fn(digest, block, entry, lora, salt)
                    except Unverifiable as exc:
                        reason = exc.reason
                    except Exception as exc:  # noqa: BLE001 - a publisher's fields, never fatal
                        reason = _unhashable(exc)
                if mine is not None:
                    if (as_int(mine) if type(published) is int
                            else hasher.published(mine, published)) == published:
                        verified += 1
                        if cached is None:
                            if len(digests) >= owner_cap:
                                del digests[next(iter(digests))]
                            digests[ck] = mine
                    else:
                        mismatched += 1
                        counted = True
                        if not inst.mismatch_reported:
                            inst.mismatch_reported = True
                            self._mismatch(inst, ev, i, digest, block, entry, published, seq)
                        mine = None
                        reason = "an ancestor mismatched"
            if mine is None and not counted:
                why = reason or "not verifiable"
                if why not in unverifiable and len(unverifiable) >= MAX_REASONS:
                    why = OTHER_REASONS
                unverifiable[why] = unverifiable.get(why, 0) + 1
            digest = mine
            # -- the chain, for the blocks below this one
            if len(chain) >= max_blocks:
                del chain[next(iter(chain))]
                stats.forgotten_blocks += 1
            chain[published] = (mine if mine is not None else reason or "block size differs",
                                ck)
            # -- across instances: who published this content first, under which hash
            owner = owners.get(ck)
            if owner is None:
                if len(owners) >= owner_cap:
                    del owners[next(iter(owners))]
                owners[ck] = (name, published)
            elif owner[1] != published:
                if owner[0] != name:
                    stats.divergent += 1
                    self._divergence(inst, owner, published, i, ev, seq)
                else:
                    owners[ck] = (name, published)
            # -- the pool: computed here while held elsewhere?
            key = published if plain else _held_key(tier, group, published)
            if key in held:
                reused += 1
                continue
            if len(held) >= max_blocks:
                self._drop(inst, next(iter(held)))
                stats.forgotten_blocks += 1
            held[key] = ck
            held_ck[ck] = held_ck.get(ck, 0) + 1
            if not prefill:
                continue
            computed += 1
            for other in others:
                if ck in other:
                    duplicated += 1
                    break
        stats.blocks_seen += len(hashes)
        stats.verified += verified
        stats.mismatched += mismatched
        stats.reused_blocks += reused
        stats.computed_blocks += computed
        stats.computed_tokens += computed * size
        stats.duplicate_blocks += duplicated
        stats.duplicate_tokens += duplicated * size
        if computed:
            self._bucket(inst, computed * size, duplicated * size)

    def _bucket(self, inst: _Instance, computed: int, duplicated: int) -> None:
        now = int(self.clock())
        window = inst.window
        if window and window[-1][0] == now:
            window[-1][1] += computed
            window[-1][2] += duplicated
        else:
            window.append([now, computed, duplicated])
            horizon = now - math.ceil(self.window_s)
            while window and window[0][0] < horizon:
                window.popleft()

    def window(self, name: str) -> WindowFigures:
        """Tokens instance ``name`` computed and duplicated over the last window."""
        horizon = self.clock() - self.window_s
        rows = [r for r in self.instances[name].window if r[0] >= horizon]
        return WindowFigures(self.window_s, sum(r[1] for r in rows), sum(r[2] for r in rows))

    # ------------------------------------------------------------------ diagnosis

    def _block_size(self, inst: _Instance, size: int, seq: int) -> None:
        if inst.mismatch_reported:
            return
        inst.mismatch_reported = True
        cause = Cause("block_size", str(self.config.block_size), str(size),
                      "the block size differs, so blocks hold different tokens and every key "
                      "differs")
        self._find("mismatch", "error", inst,
                   f"{inst.name}: blocks of {size} tokens, but the configuration says "
                   f"{self.config.block_size}: {cause.detail}", seq=seq, causes=(cause,),
                   details={"block_size": size})

    def _mismatch(self, inst: _Instance, ev: BlockStored, index: int, parent: bytes | None,
                  block: list[int], entry: Any, published: BlockHash, seq: int) -> None:
        causes: list[Cause] = []
        salt = ev.cache_salt if index == 0 else None
        if self._alternatives is None:
            self._alternatives = alternatives(self.config)
        configured = {"profile": self.config.profile,
                      "pythonhashseed": "unset" if self.config.pythonhashseed is None
                      else repr(self.config.pythonhashseed)}
        for setting, value, other in self._alternatives:
            try:
                d = other.block(parent if parent is not None else None, block, entry,
                                ev.lora_name, salt)
            except Exception:  # noqa: BLE001, S112 - Unverifiable, or fields no engine hashes
                continue
            if parent is None and other.published(d, published) == published:
                detail = ("the hash function differs" if setting == "profile" else
                          "PYTHONHASHSEED differs, so the chain's first link (NONE_HASH) "
                          "differs: the instance runs with it unset")
                causes.append(Cause(setting, configured[setting], value, detail))
        if not causes:
            if parent is None:
                causes.append(Cause(
                    "pythonhashseed", configured["pythonhashseed"], "another value",
                    "the root block's hash differs under every hash algorithm tried: the "
                    "instance's NONE_HASH (PYTHONHASHSEED) differs from the configured one"))
            if ev.lora_name is not None:
                causes.append(Cause("lora", ev.lora_name, "its configured path",
                                    "the LoRA adapter path differs (vLLM hashes name and "
                                    "path; give --lora-paths NAME=PATH as in --lora-modules)"))
            if entry and any(isinstance(x, str) for x in entry[1 if ev.lora_name else 0:]):
                causes.append(Cause("cache_salt", "per request", "per request",
                                    "the block carries a cache_salt: check that the instance "
                                    "hashes it (vLLM 0.31+ tags it)"))
            if not causes:
                causes.append(Cause("unknown", "", "", "tokens, extra keys and the parent "
                                    "agree, yet the hash differs: another engine version?"))
        mine = "none"
        try:
            d = self.hasher.block(parent, block, entry, ev.lora_name, salt)
            mine = _show(self.hasher.published(d, published))
        except Unverifiable as exc:
            mine = exc.reason
        except Exception as exc:  # noqa: BLE001 - a publisher's fields, never fatal
            mine = _unhashable(exc)
        top = causes[0]
        self._find("mismatch", "error", inst,
                   f"{inst.name}: block hash {_show(published)} differs from the "
                   f"{self.config.profile} hash {mine} of its tokens; likely cause: "
                   f"{top.setting} ({top.detail})", seq=seq, causes=tuple(causes),
                   details={"published": _show(published), "expected": mine,
                            "root": parent is None, "block_in_event": index,
                            "tokens": block[:8]})

    def _divergence(self, inst: _Instance, owner: tuple[str, BlockHash], published: BlockHash,
                    index: int, ev: BlockStored, seq: int) -> None:
        pair = (owner[0], inst.name)
        count = self.divergent_pairs.get(pair, 0)
        self.divergent_pairs[pair] = count + 1
        if count:
            return
        size = ev.block_size
        root = ev.parent_block_hash is None and index == 0
        self._find("divergence", "error", inst,
                   f"{owner[0]} and {inst.name} hash the same blocks differently: first "
                   f"block {_show(owner[1])} on {owner[0]} is {_show(published)} on "
                   f"{inst.name} ({'a chain root' if root else 'same parent content'}, tokens "
                   f"{ev.token_ids[index * size:index * size + 4]}...): their keys can never "
                   "meet in a shared cache", seq=seq,
                   details={"instances": list(pair), "hashes": [_show(owner[1]),
                                                                _show(published)],
                            "root": root, "tokens": ev.token_ids[index * size:
                                                                 (index + 1) * size][:16]})


def _tier(medium: str | None) -> str | None:
    """``None`` for the GPU (where prefill happens), else the lower tier's name."""
    return None if medium in (None, "GPU") else medium


def _held_key(tier: str | None, group: int | None, h: BlockHash) -> Any:
    """Held blocks are told apart by tier and KV-cache group besides their hash (a hybrid
    model stores one hash per group; an offload stores it again on the CPU tier)."""
    return h if tier is None and not group else (tier, group or 0, h)


def _unhashable(exc: Exception) -> str:
    """Why a block whose fields the hash function rejects (tokens outside the engine's
    range, extra keys nested past the recursion limit...) is not verifiable: one reason per
    kind of failure, so the per-reason counters stay few."""
    return (f"its fields cannot be hashed as the engine hashes them ({type(exc).__name__}): "
            "not an engine's event")


def _show(h: BlockHash) -> str:
    return h.hex() if isinstance(h, bytes) else str(h)
