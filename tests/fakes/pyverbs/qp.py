"""``pyverbs.qp``: RC queue pairs with the kernel's state machine and the HCA's send queue."""

from __future__ import annotations

import errno
import threading
from collections import deque
from typing import Any

from tests.fakes.pyverbs import enums as e
from tests.fakes.pyverbs._hca import STATE, PostedWr, SendEngine, rdma_error
from tests.fakes.pyverbs.addr import AHAttr

_U24 = (1 << 24) - 1
_PKEYS = 128

#: Attributes each RC transition must carry (the kernel's qp_state_table).
_REQUIRED = {
    (e.IBV_QPS_RESET, e.IBV_QPS_INIT): e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT
    | e.IBV_QP_ACCESS_FLAGS,
    (e.IBV_QPS_INIT, e.IBV_QPS_INIT): 0,
    (e.IBV_QPS_INIT, e.IBV_QPS_RTR): e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
    | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER,
    (e.IBV_QPS_RTR, e.IBV_QPS_RTS): e.IBV_QP_SQ_PSN | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
    | e.IBV_QP_RNR_RETRY | e.IBV_QP_MAX_QP_RD_ATOMIC,
    (e.IBV_QPS_RTS, e.IBV_QPS_RTS): 0,
}
_MASKS = {
    "INIT": e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS,
    "RTR": e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
    | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER,
    "RTS": e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN
    | e.IBV_QP_MAX_QP_RD_ATOMIC,
}


class QPCap:
    """``struct ibv_qp_cap`` with pyverbs' defaults."""

    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1,
                 max_recv_sge: int = 1, max_inline_data: int = 0) -> None:
        self.max_send_wr = max_send_wr
        self.max_recv_wr = max_recv_wr
        self.max_send_sge = max_send_sge
        self.max_recv_sge = max_recv_sge
        self.max_inline_data = max_inline_data


class QPInitAttr:
    """``struct ibv_qp_init_attr`` (``sq_sig_all`` defaults to 1 in pyverbs)."""

    def __init__(self, qp_type: int = e.IBV_QPT_UD, qp_context: Any = None, scq: Any = None,
                 rcq: Any = None, srq: Any = None, cap: QPCap | None = None,
                 sq_sig_all: int = 1) -> None:
        self.qp_type = qp_type
        self.qp_context = qp_context
        self.send_cq = scq
        self.recv_cq = rcq
        self.srq = srq
        self.cap = cap if cap is not None else QPCap()
        self.sq_sig_all = sq_sig_all


class QPAttr:
    """``struct ibv_qp_attr``: zero but for the state, port and a 1024-byte path MTU."""

    def __init__(self, qp_state: int = e.IBV_QPS_INIT, cur_qp_state: int = e.IBV_QPS_RESET,
                 port_num: int = 1, path_mtu: int = e.IBV_MTU_1024) -> None:
        self.qp_state = qp_state
        self.cur_qp_state = cur_qp_state
        self.port_num = port_num
        self.path_mtu = path_mtu
        self.qp_access_flags = 0
        self.pkey_index = 0
        self.qkey = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.dest_qp_num = 0
        self.max_rd_atomic = 0
        self.max_dest_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ah_attr = AHAttr()
        self.cap = QPCap()


class QP:
    """``ibv_create_qp(pd, init_attr)`` and what the HCA does with its send queue."""

    def __init__(self, creator: Any, init_attr: QPInitAttr, qp_attr: QPAttr | None = None
                 ) -> None:
        pd = creator
        context = pd.context
        spec = context.spec
        self.destroyed = True
        if getattr(pd, "_closed", True):
            raise rdma_error("Failed to create QP", errno.EINVAL)
        if init_attr.qp_type != e.IBV_QPT_RC:
            raise rdma_error("Failed to create QP", errno.EOPNOTSUPP)
        if spec.refuse_rc:
            raise rdma_error("Failed to create QP", errno.EOPNOTSUPP)  # EFA: UD/SRD only
        scq = init_attr.send_cq
        if scq is None or scq.context is not context or scq._closed:
            raise rdma_error("Failed to create QP", errno.EINVAL)
        cap = init_attr.cap
        if not (1 <= cap.max_send_wr <= spec.max_qp_wr and 0 <= cap.max_recv_wr <= spec.max_qp_wr
                and 1 <= cap.max_send_sge <= spec.max_sge and cap.max_recv_sge <= spec.max_sge):
            raise rdma_error("Failed to create QP", errno.EINVAL)
        self.pd = pd
        self.context = context
        self.scq = scq
        self.cap = cap
        self.qp_type = init_attr.qp_type
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        with STATE.lock:
            qpn = next(STATE.next_qpn) & _U24
            self.qp_num = qpn
            STATE.qps[qpn] = self
        self.state = e.IBV_QPS_RESET
        self.lock = threading.Lock()
        self.posted: deque[int] = deque()
        self.seq = 0
        self.epoch = 0
        self.port_num = 1
        self.access_flags = 0
        self.path_mtu = e.IBV_MTU_1024
        self.remote_qpn = 0
        self.remote_gid = b""
        self.remote_lid = 0
        self.is_global = False
        self.sgid_index = 0
        self.hop_limit = 1
        self.destroyed = False
        pd.qps.add(self)
        scq.qps.add(self)
        context.qps.add(self)
        self.engine = SendEngine(self)
        if qp_attr is not None:
            self.to_init(qp_attr)

    # -- state machine -----------------------------------------------------------------

    @property
    def qp_state(self) -> int:
        return self.state

    @property
    def port_spec(self) -> Any:
        return self.context.spec.ports[self.port_num - 1]

    def to_init(self, qp_attr: QPAttr) -> None:
        qp_attr.qp_state = e.IBV_QPS_INIT
        self._modify(qp_attr, _MASKS["INIT"] | e.IBV_QP_STATE, "init")

    def to_rtr(self, qp_attr: QPAttr) -> None:
        if self.state != e.IBV_QPS_INIT:
            self.to_init(qp_attr)
        qp_attr.qp_state = e.IBV_QPS_RTR
        self._modify(qp_attr, _MASKS["RTR"] | e.IBV_QP_STATE, "RTR")

    def to_rts(self, qp_attr: QPAttr) -> None:
        if self.state != e.IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        qp_attr.qp_state = e.IBV_QPS_RTS
        self._modify(qp_attr, _MASKS["RTS"] | e.IBV_QP_STATE, "RTS")

    def modify(self, qp_attr: QPAttr, comp_mask: int) -> None:
        self._modify(qp_attr, comp_mask, None)

    def _modify(self, attr: QPAttr, mask: int, what: str | None) -> None:
        def fail(code: int = errno.EINVAL) -> Exception:
            text = f"Failed to modify QP state to {what}" if what else "Failed to modify QP"
            return rdma_error(text, code)

        if self.destroyed:
            raise fail(errno.EINVAL)
        spec = self.context.spec
        with self.lock:
            cur = self.state
            new = attr.qp_state if mask & e.IBV_QP_STATE else cur
            if new in (e.IBV_QPS_ERR, e.IBV_QPS_RESET):
                self.state = new
                if new == e.IBV_QPS_RESET:
                    self.epoch += 1
                    self.posted.clear()
                return
            required = _REQUIRED.get((cur, new))
            if required is None or mask & required != required:
                raise fail()
            if mask & e.IBV_QP_PORT and not 1 <= attr.port_num <= len(spec.ports):
                raise fail()
            if mask & e.IBV_QP_PKEY_INDEX and not 0 <= attr.pkey_index < _PKEYS:
                raise fail()
            port_num = attr.port_num if mask & e.IBV_QP_PORT else self.port_num
            port = spec.ports[port_num - 1]
            if mask & e.IBV_QP_PATH_MTU and not 1 <= attr.path_mtu <= port.max_mtu:
                raise fail()
            if mask & e.IBV_QP_AV:
                ah = attr.ah_attr
                if ah.port_num != port_num:
                    raise fail()
                if port.link_layer == e.IBV_LINK_LAYER_ETHERNET and not ah.is_global:
                    raise fail()  # RoCE needs a GRH
                if ah.is_global:
                    if not 0 <= ah.sgid_index < min(port.gid_tbl_len, len(port.gids)):
                        raise fail()
                    if not ah.dgid.raw.strip(b"\0"):
                        raise fail()
            if mask & e.IBV_QP_DEST_QPN and not 0 < attr.dest_qp_num <= _U24:
                raise fail()
            if mask & e.IBV_QP_RQ_PSN and not 0 <= attr.rq_psn <= _U24:
                raise fail()
            if mask & e.IBV_QP_SQ_PSN and not 0 <= attr.sq_psn <= _U24:
                raise fail()
            if mask & e.IBV_QP_MAX_DEST_RD_ATOMIC and not (
                    0 <= attr.max_dest_rd_atomic <= spec.max_qp_rd_atom):
                raise fail()
            if mask & e.IBV_QP_MAX_QP_RD_ATOMIC and not (
                    0 <= attr.max_rd_atomic <= spec.max_qp_init_rd_atom):
                raise fail()
            if mask & e.IBV_QP_TIMEOUT and not 0 <= attr.timeout <= 31:
                raise fail()
            if mask & e.IBV_QP_RETRY_CNT and not 0 <= attr.retry_cnt <= 7:
                raise fail()
            if mask & e.IBV_QP_RNR_RETRY and not 0 <= attr.rnr_retry <= 7:
                raise fail()
            if mask & e.IBV_QP_PORT:
                self.port_num = attr.port_num
            if mask & e.IBV_QP_ACCESS_FLAGS:
                self.access_flags = attr.qp_access_flags
            if mask & e.IBV_QP_PATH_MTU:
                self.path_mtu = attr.path_mtu
            if mask & e.IBV_QP_DEST_QPN:
                self.remote_qpn = attr.dest_qp_num
            if mask & e.IBV_QP_AV:
                ah = attr.ah_attr
                self.is_global = bool(ah.is_global)
                self.remote_gid = ah.dgid.raw if ah.is_global else b""
                self.remote_lid = ah.dlid
                self.sgid_index = ah.sgid_index
                self.hop_limit = ah.hop_limit
            self.state = new

    # -- send queue --------------------------------------------------------------------

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        node = wr
        while node is not None:
            self._post_one(node)
            node = node.next_wr

    def _post_one(self, wr: Any) -> None:
        with self.lock:
            if self.destroyed or self.state in (e.IBV_QPS_RESET, e.IBV_QPS_INIT,
                                                 e.IBV_QPS_RTR):
                raise rdma_error("Failed to post send", errno.EINVAL)
            if wr.num_sge > self.cap.max_send_sge or wr.opcode not in (
                    e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_READ):
                raise rdma_error("Failed to post send", errno.EINVAL)
            if len(self.posted) >= self.cap.max_send_wr:
                raise rdma_error("Failed to post send", errno.ENOMEM)
            self.seq += 1
            signaled = self.sq_sig_all or bool(wr.send_flags & e.IBV_SEND_SIGNALED)
            if self.context.instant:  # a real pyverbs SendWR may be posted here
                posted = PostedWr(self.seq, wr.wr_id, wr.opcode, signaled, [], 0, 0, self.epoch)
            else:
                posted = PostedWr(self.seq, wr.wr_id, wr.opcode, signaled, list(wr.sg_list),
                                  wr.rkey, wr.remote_addr, self.epoch)
            self.posted.append(posted.seq)
        if self.context.instant:
            self.complete(posted, e.IBV_WC_SUCCESS, error=False)
            return
        self.engine.jobs.put(posted)

    def complete(self, wr: PostedWr, status: int, *, error: bool) -> None:
        """Called by the send engine when ``wr`` finished (or was flushed)."""
        with self.lock:
            if self.destroyed or wr.epoch != self.epoch:
                return
            if error:
                self.state = e.IBV_QPS_ERR
        if wr.signaled or status != e.IBV_WC_SUCCESS:
            opcode = e.IBV_WC_RDMA_READ if wr.opcode == e.IBV_WR_RDMA_READ else e.IBV_WC_RDMA_WRITE
            length = sum(s[1] for s in wr.sges) if status == e.IBV_WC_SUCCESS else 0
            if not self.scq.ring.push((wr.wr_id, status, opcode, self.qp_num, length, wr.seq)):
                for qp in list(self.scq.qps):  # CQ overrun: an async error for every QP
                    qp.state = e.IBV_QPS_ERR

    def reclaim(self, seq: int) -> None:
        with self.lock:
            posted = self.posted
            while posted and posted[0] <= seq:
                posted.popleft()

    def close(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        self.engine.stop()
        with STATE.lock:
            STATE.qps.pop(self.qp_num, None)
        self.pd.qps.discard(self)
        self.scq.qps.discard(self)
        self.context.qps.discard(self)
