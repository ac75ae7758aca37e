"""Trace format ``kv-events``: a ``kvctl verify-keys watch --record`` file as a trace.

One :class:`~kvctl.sim.traceformat.TraceRequest` per ``BlockStored`` event, in file order:

- ``hash_ids``: the whole chain from its root — the ancestors this instance published
  earlier in the file (followed through ``parent_block_hash``), then the event's new
  blocks; the ids are the published block hashes (digest bytes as big-endian ints), so equal
  ids mean an equal prefix, across instances too when they hash alike. A chain whose root
  the file never saw (the watch joined late) starts at the first parent it knows;
- ``input_length``: chain length x the event's ``block_size`` (its ``block_tokens`` too);
- ``output_length``: 0 (KV events do not say);
- ``instance``: the instance name the watch gave the publisher;
- ``timestamp_ms``: the batch's own timestamp, in ms, held non-decreasing in file order (the
  publishers' clocks are not kvctl's: a batch stamped before the one read before it takes
  that one's time).

``BlockRemoved`` and ``AllBlocksCleared`` are no requests: a replay keeps its own cache.
Messages that were malformed when recorded are skipped and counted in a log warning.
Memory grows with the distinct blocks of the file (one parent link each), not its length.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from kvctl.keys.watch.record import read_record
from kvctl.keys.watch.wire import BadFrame, BlockHash, BlockStored, decode_payload
from kvctl.sim.traceformat import TraceRequest, register_trace_format

_log = logging.getLogger("kvctl.sim.trace")

#: Deepest chain followed (a loop in a corrupt file must end): 2**20 blocks.
MAX_DEPTH = 1 << 20


def _id(h: BlockHash) -> int:
    return int.from_bytes(h, "big") if isinstance(h, bytes) else h


@register_trace_format("kv-events", block_tokens=None,
                       description="a 'kvctl verify-keys watch ENDPOINT --record FILE' "
                                   "file: one request per BlockStored, its chain from the "
                                   "root")
def read_kv_events(path: Path) -> Iterator[TraceRequest]:
    """The requests of record file ``path`` (see the module docstring)."""
    parents: dict[tuple[str, int], int | None] = {}
    last_ms = 0.0
    skipped = 0
    for msg in read_record(path):
        if msg.seq is None:
            skipped += 1
            continue
        batch = decode_payload(msg.payload)
        if isinstance(batch, BadFrame):
            skipped += 1
            continue
        last_ms = max(last_ms, batch.ts * 1000.0)
        for event in batch.events:
            if not isinstance(event, BlockStored) or not event.block_hashes:
                continue
            size = event.block_size or len(event.token_ids) // len(event.block_hashes)
            ids = _chain(parents, msg.instance, event.parent_block_hash)
            prev = None if event.parent_block_hash is None else _id(event.parent_block_hash)
            for h in event.block_hashes:
                hid = _id(h)
                parents.setdefault((msg.instance, hid), prev)
                ids.append(hid)
                prev = hid
            yield TraceRequest(line=msg.line, timestamp_ms=last_ms,
                               input_length=len(ids) * size, output_length=0,
                               hash_ids=ids, instance=msg.instance, block_tokens=size)
    if skipped:
        _log.warning("%s: %d malformed message(s) skipped", path, skipped)


def _chain(parents: dict[tuple[str, int], int | None], instance: str,
           parent: BlockHash | None) -> list[int]:
    """The ids from the root to ``parent`` (inclusive), as far as the file knows them.

    A parent link that loops back (a publisher that named a block's descendant as its parent)
    ends the chain where it would repeat: each id once.
    """
    out: list[int] = []
    seen: set[int] = set()
    node = None if parent is None else _id(parent)
    while node is not None and len(out) < MAX_DEPTH and node not in seen:
        out.append(node)
        seen.add(node)
        node = parents.get((instance, node))
    out.reverse()
    return out
