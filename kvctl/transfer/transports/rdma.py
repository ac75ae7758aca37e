"""``rdma``: one-sided RDMA READ/WRITE over RC queue pairs, through pyverbs (imported lazily).

Setup, all through the metadata service:

- each registered segment's buffers are registered as memory regions; their ``addr`` and
  ``rkey`` are published in the segment descriptor (``SegmentInfo.rdma``);
- an initiator creates an RC QP, publishes its :class:`QpInfo` under
  ``<prefix>rdma/<target engine>/<initiator engine>``; the target engine's acceptor sees it,
  creates and connects its own QP and answers under ``.../<initiator engine>/reply``; both
  QPs go INIT → RTR → RTS.

Requests are posted as signaled ``IBV_WR_RDMA_READ``/``IBV_WR_RDMA_WRITE`` work requests and
completed by polling the CQ; the target's CPU is not involved in data movement.

Without pyverbs or devices, :func:`rdma_unavailable_reason` says why, the engine reports
"RDMA unavailable: <why>" and ``auto`` falls back (logged). The device path needs hardware
(tests marked ``rdma``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvctl.errors import KvctlError, UsageError
from kvctl.probe.verbs import import_pyverbs_device
from kvctl.transfer.batch import SETTLE_FAILED, Batch, OpCode
from kvctl.transfer.errors import TransportUnavailableError
from kvctl.transfer.paths import PathHealth, RetryPolicy
from kvctl.transfer.segments import LocalSegment, MemoryBuffer
from kvctl.transfer.transports.base import Item, RemoteSegment, Transport

if TYPE_CHECKING:
    from kvctl.transfer.engine import TransferEngine

_log = logging.getLogger("kvctl.transfer.rdma")

_INSTALL_HINT = "install python3-pyverbs (apt) or 'pip install kvctl[rdma]'"
_MAX_U24 = (1 << 24) - 1


def rdma_unavailable_reason(devices: Sequence[str] = ()) -> str | None:
    """Why RDMA cannot be used here, or ``None`` when pyverbs sees the wanted devices."""
    try:
        verbs_device = import_pyverbs_device()
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        return f"pyverbs is not importable ({exc}); {_INSTALL_HINT}"
    try:
        found = verbs_device.get_device_list()
    except PyverbsError as exc:
        return f"cannot list RDMA devices ({str(exc).strip()}); is an RDMA NIC or rxe present?"
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in found]
    if not names:
        return "no RDMA devices found (ibv_devices lists none)"
    missing = [d for d in devices if d not in names]
    if missing:
        return f"RDMA device(s) {', '.join(missing)} not found (present: {', '.join(names)})"
    return None


@dataclasses.dataclass(frozen=True)
class QpInfo:
    """What a peer needs to connect an RC queue pair to ours.

    Attributes:
        device: RDMA device name (e.g. ``mlx5_0``).
        port: port number (1-based).
        lid: port LID (InfiniBand; 0 on RoCE).
        gid: port GID as 32 hex digits (RoCE), or empty.
        qpn: queue pair number (24 bits).
        psn: initial packet sequence number (24 bits).
        mtu: path MTU enum (1=256 ... 5=4096 bytes).
    """

    device: str
    port: int
    lid: int
    gid: str
    qpn: int
    psn: int
    mtu: int

    def to_json(self) -> bytes:
        """Encode for the metadata service."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, source: str) -> QpInfo:
        """Decode and validate a peer's QP info.

        Raises:
            UsageError: not JSON, missing fields, or values out of range (naming ``source``).
        """
        try:
            body = json.loads(raw)
            info = cls(device=str(body["device"]), port=int(body["port"]),
                       lid=int(body["lid"]), gid=str(body["gid"]), qpn=int(body["qpn"]),
                       psn=int(body["psn"]), mtu=int(body["mtu"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise UsageError(f"QP info at {source} is malformed ({exc})",
                             "the peer runs an incompatible kvctl; upgrade both ends") from None
        checks = [
            (1 <= info.port <= 255, "port"), (0 <= info.lid <= 0xFFFF, "lid"),
            (0 < info.qpn <= _MAX_U24, "qpn"), (0 <= info.psn <= _MAX_U24, "psn"),
            (1 <= info.mtu <= 5, "mtu"),
            (info.gid == "" or (len(info.gid) == 32 and _is_hex(info.gid)), "gid"),
        ]
        bad = [name for ok, name in checks if not ok]
        if bad:
            raise UsageError(f"QP info at {source} has out-of-range {', '.join(bad)}",
                             "the peer sent a corrupt entry; restart it")
        return info


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


class RdmaTransport(Transport):  # pragma: no cover - needs an RDMA device
    """RC queue pairs on one device, one QP per target engine, one worker thread."""

    name = "rdma"

    def __init__(self, engine: TransferEngine, *, devices: Sequence[str] = (),
                 retry: RetryPolicy | None = None, port: int = 1, gid_index: int = 0,
                 timeout_s: float = 30.0) -> None:
        import_pyverbs_device()  # first pyverbs import: keeps the root logger as it was
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD

        names = list(devices) or [d.name.decode() for d in get_device_list()]
        self._engine = engine
        self._device = names[0]
        self._port = port
        self._gid_index = gid_index
        self._timeout_s = timeout_s
        self._ctx: Any = Context(name=self._device)
        self._pd: Any = PD(self._ctx)
        self._cq: Any = CQ(self._ctx, 4096)
        self._mrs: dict[int, Any] = {}  # id(LocalBuffer) -> MR
        self._qps: dict[str, Any] = {}  # target engine -> QP
        self._served: list[Any] = []  # QPs created for initiators
        self._health = PathHealth([self._device], retry or RetryPolicy())
        self._jobs: queue.SimpleQueue[tuple[Batch, OpCode, RemoteSegment, list[Item]] | None] = (
            queue.SimpleQueue())
        self._closed = False
        self._acceptor: threading.Thread | None = None
        self._worker = threading.Thread(target=self._run, name="kvctl-rdma", daemon=True)
        self._worker.start()

    # -- registration and connection -------------------------------------------------

    def register(self, seg: LocalSegment) -> tuple[dict[str, Any], ...]:
        """Register ``seg``'s buffers as MRs; returns what peers need (addr, rkey, length)."""
        from pyverbs.enums import (
            IBV_ACCESS_LOCAL_WRITE,
            IBV_ACCESS_REMOTE_READ,
            IBV_ACCESS_REMOTE_WRITE,
        )
        from pyverbs.mr import MR

        access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE
        out = []
        for buf in seg.buffers:
            if not isinstance(buf, MemoryBuffer):
                raise TransportUnavailableError(f"segment {seg.name!r} is not host memory",
                                                "register shm or host segments for RDMA")
            addr = buf.address
            mr = MR(self._pd, buf.length, access, address=addr)
            self._mrs[id(buf)] = mr
            out.append({"addr": addr, "rkey": mr.rkey, "length": buf.length})
        if self._acceptor is None:
            self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                              name="kvctl-rdma-accept")
            self._acceptor.start()
        return tuple(out)

    def _new_qp(self) -> tuple[Any, QpInfo]:
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=1024, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=2, scq=self._cq, rcq=self._cq, cap=cap)  # 2 = IBV_QPT_RC
        qp = QP(self._pd, init)
        attr = QPAttr(port_num=self._port)
        attr.qp_access_flags = 0b111  # local write, remote write, remote read
        qp.to_init(attr)
        port = self._ctx.query_port(self._port)
        gid = self._ctx.query_gid(self._port, self._gid_index)
        info = QpInfo(self._device, self._port, int(port.lid), str(gid).replace(":", ""),
                      int(qp.qp_num), random.randrange(_MAX_U24), int(port.active_mtu))
        return qp, info

    def _connect(self, qp: Any, mine: QpInfo, peer: QpInfo) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self._port)
        attr.path_mtu = min(mine.mtu, peer.mtu)
        attr.dest_qp_num = peer.qpn
        attr.rq_psn = peer.psn
        attr.sq_psn = mine.psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = None
        if peer.gid:
            gid = GID(":".join(peer.gid[i : i + 4] for i in range(0, 32, 4)))
            gr = GlobalRoute(dgid=gid, sgid_index=self._gid_index)
        attr.ah_attr = AHAttr(dlid=peer.lid, port_num=self._port, is_global=int(gr is not None),
                              gr=gr)
        qp.to_rts(attr)

    def _key(self, target: str, initiator: str) -> str:
        return f"{self._engine._prefix}rdma/{target}/{initiator}"

    def _qp_for(self, info: Any) -> Any:
        qp = self._qps.get(info.engine)
        if qp is not None:
            return qp
        md = self._engine.metadata
        qp, mine = self._new_qp()
        md.put(self._key(info.engine, self._engine.name), mine.to_json())
        deadline = time.monotonic() + self._timeout_s
        reply_key = self._key(info.engine, self._engine.name) + "/reply"
        while time.monotonic() < deadline:
            raw = md.get(reply_key)
            if raw is not None:
                peer = QpInfo.from_json(raw, source=reply_key)
                self._connect(qp, mine, peer)
                md.delete(reply_key)
                self._qps[info.engine] = qp
                return qp
            time.sleep(0.05)
        md.delete(self._key(info.engine, self._engine.name))
        raise TransportUnavailableError(f"RDMA peer {info.engine} did not answer the QP "
                                        f"exchange within {self._timeout_s:g} s",
                                        "check that the target engine runs with RDMA")

    def _accept_loop(self) -> None:
        md = self._engine.metadata
        prefix = f"{self._engine._prefix}rdma/{self._engine.name}/"
        while not self._closed:
            try:
                for key, raw in md.list(prefix).items():
                    if key.endswith("/reply"):
                        continue
                    peer = QpInfo.from_json(raw, source=key)
                    qp, mine = self._new_qp()
                    self._connect(qp, mine, peer)
                    self._served.append(qp)
                    md.delete(key)
                    md.put(key + "/reply", mine.to_json())
            except KvctlError as exc:
                _log.warning("RDMA QP exchange failed: %s", exc.cause)
            time.sleep(0.1)

    # -- data path --------------------------------------------------------------------

    def execute(self, batch: Batch, op: OpCode, target: RemoteSegment, items: list[Item]) -> None:
        self._jobs.put((batch, op, target, items))

    def _run(self) -> None:
        from pyverbs.enums import IBV_SEND_SIGNALED, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.wr import SGE, SendWR

        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch, op, target, items = job
            try:
                qp = self._qp_for(target.info)
                opcode = IBV_WR_RDMA_READ if op is OpCode.READ else IBV_WR_RDMA_WRITE
                for n, (_slot, lbuf, lrel, bi, trel, _toff, length) in enumerate(items):
                    mr = self._mrs[id(lbuf)]
                    if not isinstance(lbuf, MemoryBuffer):
                        raise TransportUnavailableError("local buffer is not host memory",
                                                        "use shm/host segments with RDMA")
                    sge = SGE(lbuf.address + lrel, length, mr.lkey)
                    wr = SendWR(wr_id=n, opcode=opcode, num_sge=1, sg=[sge],
                                send_flags=IBV_SEND_SIGNALED)
                    remote = target.info.rdma[bi]
                    wr.set_wr_rdma(int(remote["rkey"]), int(remote["addr"]) + trel)
                    qp.post_send(wr)
                self._poll(len(items))
                batch.settle([it[0] for it in items], path=f"rdma:{self._device}")
            except (KvctlError, PyverbsError, KeyError) as exc:
                cause = getattr(exc, "cause", None) or str(exc)
                self._qps.pop(target.info.engine, None)
                batch.settle([it[0] for it in items], path=f"rdma:{self._device}",
                             failure=SETTLE_FAILED, cause=f"RDMA transfer failed: {cause}")

    def _poll(self, expected: int) -> None:
        from pyverbs.enums import IBV_WC_SUCCESS

        deadline = time.monotonic() + self._timeout_s
        done = 0
        while done < expected:
            npolled, wcs = self._cq.poll(min(64, expected - done))
            for wc in wcs[:npolled]:
                if wc.status != IBV_WC_SUCCESS:
                    raise TransportUnavailableError(f"work completion status {wc.status}",
                                                    "check the RDMA fabric (ibv_devinfo)")
            done += npolled
            if not npolled and time.monotonic() > deadline:
                raise TransportUnavailableError(f"no RDMA completion in {self._timeout_s:g} s",
                                                "check the RDMA fabric (ibv_devinfo)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(5.0)
        for obj in [*self._qps.values(), *self._served, *self._mrs.values(), self._cq, self._pd,
                    self._ctx]:
            obj.close()
