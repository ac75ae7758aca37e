"""``pyverbs.wr``: SGE and SendWR, with their C field widths and their leak.

As in rdma-core v44 (``def __dealloc`` is misspelled there), neither class frees its native
memory unless ``close()`` is called, and ``close()`` twice is a double free.
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.fakes.pyverbs import enums as e
from tests.fakes.pyverbs._hca import STATE
from tests.fakes.pyverbs.pyverbs_error import PyverbsUserError

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


def _unsigned(value: int, top: int, what: str) -> int:
    value = int(value)
    if value < 0:
        raise OverflowError(f"can't convert negative value to unsigned {what}")
    if value > top:
        raise OverflowError(f"value too large to convert to unsigned {what}")
    return value


class _Native:
    _kind = ""

    def _alloc(self) -> None:
        self._open = True
        with STATE.lock:
            STATE.native[self._kind] += 1

    def close(self) -> None:
        if not self._open:
            raise RuntimeError(f"double free of a {self._kind} (real pyverbs would crash)")
        self._open = False
        with STATE.lock:
            STATE.native[self._kind] -= 1


class SGE(_Native):
    """``struct ibv_sge``: 64-bit address, 32-bit length, 32-bit lkey."""

    _kind = "SGE"

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = _unsigned(addr, _U64, "long")
        self.length = _unsigned(length, _U32, "int")
        self.lkey = _unsigned(lkey, _U32, "int")
        self._alloc()


class SendWR(_Native):
    """``struct ibv_send_wr``: the SGEs are copied at construction."""

    _kind = "SendWR"

    def __init__(self, wr_id: int = 0, opcode: int = e.IBV_WR_SEND, num_sge: int = 0,
                 imm_data: int = 0, sg: Sequence[SGE] | None = None,
                 send_flags: int = e.IBV_SEND_SIGNALED, next_wr: SendWR | None = None) -> None:
        if num_sge < 1 or sg is None:
            raise PyverbsUserError("A WR needs at least one SGE")
        self.sg_list = [(s.addr, s.length, s.lkey) for s in list(sg)[:num_sge]]
        self.num_sge = num_sge
        self.wr_id = _unsigned(wr_id, _U64, "long")
        self.opcode = opcode
        self.send_flags = send_flags
        self.imm_data = imm_data
        self.next_wr = next_wr
        self.rkey = 0
        self.remote_addr = 0
        self._alloc()

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey = _unsigned(rkey, _U32, "int")
        self.remote_addr = _unsigned(addr, _U64, "long")
