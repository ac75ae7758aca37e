"""``pyverbs.device``: the device list, contexts and their queries (``ibv_devinfo -v``)."""

from __future__ import annotations

import errno
import weakref
from types import SimpleNamespace
from typing import Any

from tests.fakes.pyverbs import enums as e
from tests.fakes.pyverbs._hca import STATE, close_endpoint, open_endpoint, rdma_error
from tests.fakes.pyverbs.addr import GID
from tests.fakes.pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError, PyverbsUserError

__all__ = ["Context", "Device", "PyverbsError", "PyverbsRDMAError", "get_device_list"]


class Device:
    """One entry of ``ibv_get_device_list`` (``name`` is bytes, as in pyverbs)."""

    def __init__(self, name: bytes, guid: int, node_type: int, transport_type: int,
                 index: int) -> None:
        self.name = name
        self.guid = guid
        self.node_type = node_type
        self.transport_type = transport_type
        self.index = index


def get_device_list() -> list[Device]:
    host = STATE.host()
    if host.list_error:
        raise PyverbsRDMAError("Failed to get devices list")
    return [Device(d.name.encode(), 0x0002C90300001000 + i, d.node_type, d.transport_type, i)
            for i, d in enumerate(host.devices)]


class Context:
    """``ibv_open_device``: opening a device puts its ports on the fabric."""

    def __init__(self, **kwargs: Any) -> None:
        self._closed = True
        name = kwargs.get("name")
        if name is None:
            raise PyverbsUserError("Device name must be provided")
        host = STATE.host()
        if host.list_error:
            raise PyverbsRDMAError("Failed to get devices list")
        spec = STATE.device(name)
        if spec is None:
            raise PyverbsRDMAError(f"Failed to find device {name}")
        self.name = name
        self.spec = spec
        self.instant = host.instant
        self.pds: weakref.WeakSet[Any] = weakref.WeakSet()
        self.cqs: weakref.WeakSet[Any] = weakref.WeakSet()
        self.qps: weakref.WeakSet[Any] = weakref.WeakSet()
        self._ports: list[int] = []
        for port_num in range(1, len(spec.ports) + 1):
            open_endpoint(spec, port_num)
            self._ports.append(port_num)
        self._closed = False

    def query_device(self) -> Any:
        s = self.spec
        return SimpleNamespace(
            phys_port_cnt=len(s.ports), max_qp_wr=s.max_qp_wr, max_cqe=s.max_cqe,
            max_qp_rd_atom=s.max_qp_rd_atom, max_qp_init_rd_atom=s.max_qp_init_rd_atom,
            max_sge=s.max_sge, max_mr_size=s.max_mr_size, vendor_id=s.vendor_id,
            vendor_part_id=s.vendor_part_id, fw_version="28.39.1002", max_qp=131072,
            max_cq=16777216, max_mr=16777216, max_pd=16777216)

    def _port(self, port_num: int) -> Any:
        if self._closed or not 1 <= port_num <= len(self.spec.ports):
            raise rdma_error(f"Failed to query port {port_num}", errno.EINVAL)
        return self.spec.ports[port_num - 1]

    def query_port(self, port_num: int) -> Any:
        p = self._port(port_num)
        down = (self.name, port_num) in STATE.link_down
        return SimpleNamespace(
            state=e.IBV_PORT_DOWN if down else p.state, max_mtu=p.max_mtu,
            active_mtu=p.active_mtu, gid_tbl_len=p.gid_tbl_len, port_cap_flags=0,
            max_msg_sz=p.max_msg_sz, lid=p.lid, sm_lid=1 if p.lid else 0, lmc=0,
            active_width=p.active_width, active_speed=p.active_speed,
            phys_state=3 if down else p.phys_state, link_layer=p.link_layer,
            pkey_tbl_len=128, flags=0)

    def query_gid(self, port_num: int, index: int) -> GID:
        p = self._port(port_num)
        if not 0 <= index < p.gid_tbl_len:
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {port_num}")
        if index < len(p.gids):
            return GID(p.gids[index].gid)
        return GID()

    def query_gid_type(self, port_num: int, index: int) -> int:
        p = self._port(port_num)
        if not 0 <= index < len(p.gids):
            raise rdma_error(f"Failed to query gid type of port {port_num} and gid index "
                             f"{index}", errno.EINVAL)
        return p.gids[index].type

    def close(self) -> None:
        if self._closed:
            return
        for qp in list(self.qps):
            qp.close()
        for cq in list(self.cqs):
            cq.close()
        for pd in list(self.pds):
            pd.close()
        self._closed = True
        for port_num in self._ports:
            close_endpoint(self.spec, port_num)
        self._ports = []
