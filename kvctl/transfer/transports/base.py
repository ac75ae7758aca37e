"""What every transport implements, and the resolved target it works on."""

from __future__ import annotations

import abc
import threading
from typing import Any, ClassVar

from kvctl.transfer.batch import Batch, OpCode
from kvctl.transfer.segments import LocalBuffer, SegmentInfo

#: One request (or piece of one) handed to a transport:
#: (batch slot, local buffer, offset in it, target buffer index, offset in that buffer,
#:  offset in the target segment's address space, length in bytes).
Item = tuple[int, LocalBuffer, int, int, int, int, int]


class RemoteSegment:
    """A target segment as this engine sees it: its descriptor plus per-transport state.

    Attributes:
        info: the published descriptor.
        transport: name of the transport chosen for it.
        offsets / lengths: buffer layout, for bounds checks before anything is sent.
        cache: transport-private state (e.g. the shm transport's mappings).
    """

    def __init__(self, info: SegmentInfo, transport: str) -> None:
        self.info = info
        self.transport = transport
        self.offsets = [b.offset for b in info.buffers]
        self.lengths = [b.length for b in info.buffers]
        self.cache: dict[str, Any] = {}
        self.lock = threading.Lock()


class Transport(abc.ABC):
    """Moves batches of items between local buffers and one kind of target."""

    name: ClassVar[str]

    def pieces(self, length: int) -> int:
        """How many slices a request of ``length`` bytes becomes (1 if not sliced)."""
        return 1

    @abc.abstractmethod
    def execute(self, batch: Batch, op: OpCode, target: RemoteSegment, items: list[Item]) -> None:
        """Start moving ``items``; settle each slice on ``batch`` when done (may return early)."""

    def execute_waiting(self, batch: Batch, op: OpCode, target: RemoteSegment,
                        items: list[Item]) -> None:
        """Like :meth:`execute` for a caller that waits for ``batch`` right after: a
        transport may move the items in the calling thread (no hand-off to a worker)."""
        self.execute(batch, op, target, items)

    def forget(self, target: RemoteSegment) -> None:  # noqa: B027 - optional hook
        """Drop cached state for ``target`` (its descriptor changed or it went away)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop workers and release connections/mappings; pending slices fail. Idempotent."""
