"""The fake verbs provider enforces the semantics kvctl relies on, and kvctl's use of the
pyverbs API builds the same objects with the real pyverbs (everything short of a device)."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.transfer.batch import OpCode
from kvctl.transfer.transports.rdma.datapath import post_wr
from kvctl.transfer.transports.rdma.devices import NicContext, NicPort, RdmaOptions
from kvctl.transfer.transports.rdma.exchange import QpInfo, connect_qp
from kvctl.transfer.transports.rdma.provider import Verbs, load_verbs
from tests.fakes import pyverbs as fv
from tests.fakes.fabric import Fabric, fabric_fixture  # noqa: F401
from tests.fakes.pyverbs import enums as e
from tests.fakes.pyverbs.addr import AHAttr, GlobalRoute
from tests.fakes.pyverbs.cq import CQ
from tests.fakes.pyverbs.device import Context, get_device_list
from tests.fakes.pyverbs.mr import MR
from tests.fakes.pyverbs.pd import PD
from tests.fakes.pyverbs.pyverbs_error import PyverbsRDMAError
from tests.fakes.pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from tests.fakes.pyverbs.wr import SGE, SendWR

ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE


class End:
    """One side of a raw RC connection on the fake: context, PD, CQ, a 64 KiB MR, a QP."""

    def __init__(self, device: str, *, send_wr: int = 4, cqe: int = 64) -> None:
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cqe)
        self.buf = ctypes.create_string_buffer(65536)
        self.addr = ctypes.addressof(self.buf)
        self.mr = MR(self.pd, 65536, ACCESS, address=self.addr)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                         cap=QPCap(max_send_wr=send_wr)))

    def attr(self, peer: End, *, gid_index: int = 3, hop_limit: int = 255,
             mtu: int = e.IBV_MTU_4096) -> QPAttr:
        attr = QPAttr(port_num=1)
        attr.qp_access_flags = ACCESS
        attr.path_mtu = mtu
        attr.dest_qp_num = peer.qp.qp_num
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 16
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gid = peer.ctx.query_gid(1, gid_index)
        attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=GlobalRoute(
            dgid=gid, sgid_index=gid_index, hop_limit=hop_limit))
        return attr

    def write(self, wr_id: int, peer: End, *, length: int = 8, rkey: int | None = None,
              offset: int = 0) -> None:
        sge = SGE(self.addr, length, self.mr.lkey)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge])
        wr.set_wr_rdma(peer.mr.rkey if rkey is None else rkey, peer.addr + offset)
        try:
            self.qp.post_send(wr)
        finally:
            sge.close()
            wr.close()

    def completions(self, count: int, timeout_s: float = 5.0) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            n, wcs = self.cq.poll(count - len(out))
            out += [(wc.wr_id, wc.status) for wc in wcs[:n]]
            if not n:
                time.sleep(0.001)
        return out


@pytest.fixture
def pair(fabric: Fabric) -> Iterator[tuple[End, End]]:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"),
                retry_s=0.01)
    a, b = End("mlx5_0"), End("mlx5_1")
    try:
        yield a, b
    finally:
        a.ctx.close()
        b.ctx.close()


def connect(a: End, b: End, **kw: Any) -> None:
    a.qp.to_rts(a.attr(b, **kw))
    b.qp.to_rts(b.attr(a, **kw))


def test_bytes_cross_and_completions_carry_wr_id(pair: tuple[End, End]) -> None:
    a, b = pair
    connect(a, b)
    a.buf[:8] = b"fabric!!"
    a.write(77, b, offset=100)
    assert a.completions(1) == [(77, e.IBV_WC_SUCCESS)]
    assert b.buf[100:108] == b"fabric!!"


def test_posting_before_rts_is_einval(pair: tuple[End, End]) -> None:
    a, b = pair
    with pytest.raises(PyverbsRDMAError) as info:
        a.write(1, b)
    assert info.value.error_code == errno.EINVAL


def test_roce_needs_a_grh_and_a_populated_source_gid(pair: tuple[End, End]) -> None:
    a, b = pair
    attr = a.attr(b)
    attr.ah_attr = AHAttr(port_num=1, is_global=0)
    with pytest.raises(PyverbsRDMAError, match="RTR"):
        a.qp.to_rts(attr)
    attr = a.attr(b, gid_index=9)
    with pytest.raises(PyverbsRDMAError) as info:
        a.qp.to_rtr(attr)
    assert info.value.error_code == errno.EINVAL


def test_rd_atomic_above_the_device_is_einval(fabric: Fabric) -> None:
    dev = fabric.device("mlx5_0", "10.0.0.1")
    dev.max_qp_init_rd_atom = 4
    fabric.host(dev, fabric.device("mlx5_1", "10.0.0.2"))
    a, b = End("mlx5_0"), End("mlx5_1")
    try:
        with pytest.raises(PyverbsRDMAError, match="RTS"):
            a.qp.to_rts(a.attr(b))  # max_rd_atomic 16 > 4
    finally:
        a.ctx.close()
        b.ctx.close()


def test_send_queue_depth_is_enforced_until_completions_are_polled(pair: tuple[End, End]
                                                                   ) -> None:
    a, b = pair
    connect(a, b)
    for k in range(4):
        a.write(k, b)
    with pytest.raises(PyverbsRDMAError) as info:
        a.write(4, b)
    assert info.value.error_code == errno.ENOMEM
    assert a.completions(4) == [(k, 0) for k in range(4)]
    a.write(5, b)  # polled: the slots are free again
    assert a.completions(1) == [(5, 0)]


def test_a_bad_rkey_fails_the_qp_and_flushes_what_follows(pair: tuple[End, End]) -> None:
    a, b = pair
    connect(a, b)
    a.write(1, b, rkey=b.mr.rkey ^ 0x5A5A)
    a.write(2, b)
    assert a.completions(2) == [(1, e.IBV_WC_REM_ACCESS_ERR), (2, e.IBV_WC_WR_FLUSH_ERR)]
    assert a.qp.qp_state == e.IBV_QPS_ERR
    a.write(3, b)  # posting on an ERR QP is accepted and flushed
    assert a.completions(1) == [(3, e.IBV_WC_WR_FLUSH_ERR)]


def test_out_of_bounds_and_oversized_messages(pair: tuple[End, End], fabric: Fabric) -> None:
    a, b = pair
    connect(a, b)
    a.write(1, b, offset=65536 - 4)  # 8 bytes from 4 before the end of the MR
    assert a.completions(1) == [(1, e.IBV_WC_REM_ACCESS_ERR)]


def test_max_msg_sz_is_enforced(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1", max_msg_sz=4096),
                fabric.device("mlx5_1", "10.0.0.2"))
    a, b = End("mlx5_0"), End("mlx5_1")
    try:
        connect(a, b)
        a.write(1, b, length=8192)
        assert a.completions(1) == [(1, e.IBV_WC_LOC_LEN_ERR)]
    finally:
        a.ctx.close()
        b.ctx.close()


def test_hop_limit_one_dies_at_the_first_router(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1", subnet="rack-a"),
                fabric.device("mlx5_1", "10.0.1.1", subnet="rack-b"), retry_s=0.01)
    a, b = End("mlx5_0"), End("mlx5_1")
    try:
        connect(a, b, hop_limit=1)
        a.write(1, b)
        assert a.completions(1) == [(1, e.IBV_WC_RETRY_EXC_ERR)]
    finally:
        a.ctx.close()
        b.ctx.close()


def test_efa_lists_but_refuses_rc(fabric: Fabric) -> None:
    fabric.host(fv.efa_device("rdmap0s6"))
    (dev,) = get_device_list()
    assert (dev.name, dev.node_type, dev.transport_type) == (b"rdmap0s6", 7, 4)
    ctx = Context(name="rdmap0s6")
    try:
        cq = CQ(ctx, 16)
        with pytest.raises(PyverbsRDMAError) as info:
            QP(PD(ctx), QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq))
        assert info.value.error_code == errno.EOPNOTSUPP
    finally:
        ctx.close()


def test_memlock_limit(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), memlock_bytes=64 << 10)
    ctx = Context(name="mlx5_0")
    try:
        pd = PD(ctx)
        MR(pd, 32 << 10, ACCESS)
        with pytest.raises(PyverbsRDMAError) as info:
            MR(pd, 64 << 10, ACCESS)
        assert info.value.error_code == errno.ENOMEM
    finally:
        ctx.close()


# ---------------------------------------------------------------------------- real pyverbs


def _real() -> Verbs:
    return load_verbs("pyverbs")


def _fake() -> Verbs:
    return load_verbs("tests.fakes.pyverbs")


def test_real_and_fake_sge_refuse_4_gib() -> None:
    for verbs in (_real(), _fake()):
        with pytest.raises(OverflowError):
            verbs.SGE(0, 1 << 32, 0)
        verbs.SGE(0, (1 << 32) - 1, 0).close()


class _Recorder:
    """A QP stand-in that keeps what kvctl hands to the real pyverbs calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def to_rtr(self, attr: Any) -> None:
        self.calls.append(("rtr", attr))

    def to_rts(self, attr: Any) -> None:
        self.calls.append(("rts", attr))

    def post_send(self, wr: Any) -> None:
        self.calls.append(("post", (wr.wr_id, wr.opcode, wr.num_sge, wr.send_flags)))


def _nic(verbs: Verbs, port: NicPort) -> NicContext:
    nic = object.__new__(NicContext)
    nic.verbs, nic.port, nic.name = verbs, port, port.name
    nic.max_rd_atomic, nic.max_dest_rd_atomic = 16, 16
    return nic


ROCE = NicPort("mlx5_0", 1, "Ethernet", 0, "00000000000000000000ffff0a000001", 3, "RoCE v2", 5,
               1 << 30)
IB = NicPort("mlx5_2", 1, "InfiniBand", 7, "", None, None, 4, 1 << 31)


@pytest.mark.parametrize("make", [_real, _fake], ids=["real-pyverbs", "fake"])
def test_roce_connect_attributes(make: Any) -> None:
    verbs = make()
    qp = _Recorder()
    mine = QpInfo("mlx5_0", 1, 0, ROCE.gid, 100, 1, 5)
    peer = QpInfo("mlx5_1", 1, 0, "00000000000000000000ffff0a000102", 200, 2, 3)
    connect_qp(_nic(verbs, ROCE), qp, mine, peer, RdmaOptions())
    (_, rtr), (_, rts) = qp.calls
    assert rtr is rts
    ah = rtr.ah_attr
    assert (ah.is_global, ah.sgid_index, ah.hop_limit, ah.port_num) == (1, 3, 255, 1)
    assert str(ah.dgid) == "0000:0000:0000:0000:0000:ffff:0a00:0102"
    assert (rtr.path_mtu, rtr.dest_qp_num, rtr.rq_psn, rtr.sq_psn) == (3, 200, 2, 1)
    assert (rtr.max_rd_atomic, rtr.max_dest_rd_atomic, rtr.timeout, rtr.retry_cnt) == (
        16, 16, 14, 7)


@pytest.mark.parametrize("make", [_real, _fake], ids=["real-pyverbs", "fake"])
def test_infiniband_connects_by_lid(make: Any) -> None:
    verbs = make()
    qp = _Recorder()
    mine = QpInfo("mlx5_2", 1, 7, "", 100, 1, 4)
    peer = QpInfo("mlx5_3", 1, 9, "", 200, 2, 5)
    connect_qp(_nic(verbs, IB), qp, mine, peer, dataclasses.replace(RdmaOptions(), hop_limit=9))
    attr = qp.calls[0][1]
    assert (attr.ah_attr.is_global, attr.ah_attr.dlid, attr.path_mtu) == (0, 9, 4)


@pytest.mark.parametrize("make", [_real, _fake], ids=["real-pyverbs", "fake"])
def test_work_requests_carry_their_id_and_are_freed(make: Any) -> None:
    verbs = make()
    qp = _Recorder()
    post_wr(verbs, qp, (1 << 63) + 5, OpCode.READ, 4096, 1 << 20, 7, 9, 8192)
    post_wr(verbs, qp, 6, OpCode.WRITE, 4096, 1 << 20, 7, 9, 8192)
    en = verbs.enums
    assert [c[1] for c in qp.calls] == [
        ((1 << 63) + 5, en.IBV_WR_RDMA_READ, 1, en.IBV_SEND_SIGNALED),
        (6, en.IBV_WR_RDMA_WRITE, 1, en.IBV_SEND_SIGNALED)]
