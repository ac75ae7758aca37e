"""The KV-event wire format of vLLM (0.33) and SGLang (0.5.23), decoded defensively.

A message is a ZeroMQ multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
counter per publisher from 0, ``payload`` msgpack of ``[ts, [event, ...], rank]`` (vLLM's
``data_parallel_rank``, SGLang's ``attn_dp_rank``). Events are msgpack maps tagged by
``"type"``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, defaults omitted. Block
hashes are ints (vLLM: the low 8 bytes of the digest, unsigned; SGLang: the first 8 bytes,
signed) or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, the digest bytes.

Replies of the replay endpoint (a ROUTER; ask from a DEALER with ``["", seq as 8 bytes]``)
arrive as ``("", topic, seq, payload)`` and end with ``("", "", -1 as 8 bytes, "")``.

Nothing here raises on bad input: :func:`decode_payload` returns a :class:`Batch` or a
:class:`BadFrame` saying why, and an event with an unknown tag becomes an
:class:`UnknownEvent` beside the good ones.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import msgspec

#: The end-of-replay marker's sequence number.
END_SEQ = -1
#: Bytes of the sequence frame.
SEQ_BYTES = 8

BlockHash = int | bytes
#: Longest digest published as bytes that an event may carry: the engines' are 32 bytes
#: (SHA-256, xxh3-128 is 16). A longer one makes the event malformed: the watch keeps every
#: hash it remembers (``--max-blocks`` of them), so their length must be bounded too.
MAX_HASH_BYTES = 64
_WireHash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """New full blocks of one request chunk (vLLM ``cache_full_blocks``, SGLang pages).

    Attributes:
        block_hashes: one per block, as published.
        parent_block_hash: the hash of the block before the first one (``None``: a root).
        token_ids: every block's tokens, concatenated.
        block_size: tokens per block.
        lora_name: the adapter's name (vLLM hashes its path too, which the event lacks).
        extra_keys: vLLM: per block, the untagged extra keys (LoRA name, ``(mm id,
            offset)``, cache_salt, prompt-embeds digest), or ``None``.
        cache_salt: SGLang: the request's salt.
        medium: ``GPU``, ``CPU``...
    """

    block_hashes: list[_WireHash]
    parent_block_hash: _WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """Blocks evicted from the prefix cache."""

    block_hashes: list[_WireHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    """The prefix cache was reset: the instance holds nothing."""


@dataclasses.dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event whose tag this kvctl does not know (a newer engine), or a malformed one.

    Attributes:
        tag: its ``type`` ('' when it has none).
        problem: what is wrong with it, for people.
    """

    tag: str
    problem: str


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    rank: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """One decoded payload.

    Attributes:
        ts: the publisher's timestamp (seconds since the epoch).
        events: known events in order (unknown ones are in ``unknown``).
        rank: the data-parallel rank the publisher stamped, if any.
        unknown: events that could not be decoded, in order.
    """

    ts: float
    events: list[Event]
    rank: int | None
    unknown: tuple[UnknownEvent, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class BadFrame:
    """A message that is not a KV-event batch: why, for people."""

    problem: str


_batch = msgspec.msgpack.Decoder(_Batch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_event = msgspec.msgpack.Decoder(Event)
_any = msgspec.msgpack.Decoder()


#: What decoding a hostile payload may raise: msgspec's errors, and RecursionError for one
#: nested deeper than the interpreter's recursion limit (``[[[[...]]]]`` in an event).
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def decode_payload(payload: bytes) -> Batch | BadFrame:
    """A payload as a :class:`Batch`, or :class:`BadFrame` when it is not one."""
    try:
        b = _batch.decode(payload)
    except _DECODE_ERRORS:
        pass
    else:
        return Batch(b.ts, b.events, b.rank)
    try:
        raw = _raw_batch.decode(payload)
    except _DECODE_ERRORS as exc:
        return BadFrame(f"payload is not a KV-event batch ([ts, events, rank]): {exc}")
    events: list[Event] = []
    unknown: list[UnknownEvent] = []
    for item in raw.events:
        try:
            events.append(_event.decode(item))
        except _DECODE_ERRORS as exc:
            unknown.append(_unknown(item, str(exc)))
    return Batch(raw.ts, events, raw.rank, tuple(unknown))


def _unknown(item: msgspec.Raw, problem: str) -> UnknownEvent:
    try:
        value = _any.decode(item)
    except _DECODE_ERRORS:
        value = None
    tag = value.get("type") if isinstance(value, dict) else None
    if isinstance(tag, str):
        tag = tag[:MAX_TAG]  # the publisher's text, in every warning about it
    if isinstance(tag, str) and tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        return UnknownEvent(tag, f"unknown event type {tag!r}")
    return UnknownEvent(tag if isinstance(tag, str) else "", f"malformed event: {problem}")


#: Characters of an unknown event's tag kept (a newer engine's tags are short words).
MAX_TAG = 64


def decode_seq(frame: bytes) -> int | None:
    """The sequence number of an 8-byte frame (``-1``: end of replay); ``None`` if the frame
    is not 8 bytes."""
    if len(frame) != SEQ_BYTES:
        return None
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """``seq`` as the 8-byte big-endian frame publishers send."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """One multipart message of a publisher: topic, sequence number, payload bytes."""

    topic: bytes
    seq: int
    payload: bytes


def split_message(frames: list[bytes]) -> Message | BadFrame:
    """``(topic, seq, payload)`` from a live message's frames, or why not."""
    if len(frames) != 3:
        return BadFrame(f"message has {len(frames)} frame(s), expected 3 (topic, seq, payload)")
    seq = decode_seq(frames[1])
    if seq is None or seq < 0:
        return BadFrame(f"sequence frame is {len(frames[1])} byte(s), expected an 8-byte "
                        "big-endian counter")
    return Message(frames[0], seq, frames[2])
