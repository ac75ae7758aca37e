"""``pyverbs.cq``: completion queues and work completions."""

from __future__ import annotations

import errno
import weakref
from typing import Any

from tests.fakes.pyverbs._hca import CompletionQueue, rdma_error


class WC:
    """``struct ibv_wc`` (the fields kvctl reads, plus their neighbours)."""

    def __init__(self, wr_id: int = 0, status: int = 0, opcode: int = 0, vendor_err: int = 0,
                 byte_len: int = 0, qp_num: int = 0, src_qp: int = 0, imm_data: int = 0,
                 wc_flags: int = 0, pkey_index: int = 0, slid: int = 0, sl: int = 0,
                 dlid_path_bits: int = 0) -> None:
        self.wr_id = wr_id
        self.status = status
        self.opcode = opcode
        self.vendor_err = vendor_err
        self.byte_len = byte_len
        self.qp_num = qp_num
        self.src_qp = src_qp
        self.imm_data = imm_data
        self.wc_flags = wc_flags
        self.pkey_index = pkey_index
        self.slid = slid
        self.sl = sl
        self.dlid_path_bits = dlid_path_bits


class CQ:
    """``ibv_create_cq(context, cqe)``; ``poll(n)`` returns ``(npolled, [WC])``."""

    def __init__(self, context: Any, cqe: int, cq_context: Any = None, channel: Any = None,
                 comp_vector: int = 0) -> None:
        if getattr(context, "_closed", True):
            raise rdma_error("Failed to create a CQ", errno.EINVAL)
        if cqe < 1 or cqe > context.spec.max_cqe:
            raise rdma_error("Failed to create a CQ", errno.EINVAL)
        self.context = context
        self.ring = CompletionQueue(cqe)
        self.qps: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closed = False
        context.cqs.add(self)

    @property
    def cqe(self) -> int:
        return self.ring.cqe

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        if self._closed:
            raise rdma_error("Failed to poll CQ", errno.EINVAL)
        ring = self.ring
        out: list[WC] = []
        seqs: list[tuple[int, int]] = []
        with ring.lock:
            if ring.overrun:
                raise rdma_error("Failed to poll CQ", errno.EIO)
            while len(out) < num_entries and ring.entries:
                wr_id, status, opcode, qp_num, byte_len, seq = ring.entries.popleft()
                out.append(WC(wr_id=wr_id, status=status, opcode=opcode, qp_num=qp_num,
                              byte_len=byte_len))
                seqs.append((qp_num, seq))
        if seqs:
            qps = {q.qp_num: q for q in list(self.qps)}
            for qp_num, seq in seqs:
                qp = qps.get(qp_num)
                if qp is not None:
                    qp.reclaim(seq)  # the SQ slots up to this WR are free again
        return len(out), out

    def close(self) -> None:
        if self._closed:
            return
        for qp in list(self.qps):
            qp.close()
        self._closed = True
