"""The simulated host channel adapters behind the fake pyverbs.

One process is one host. Its devices, ports and GID tables come from a :class:`HostSpec`,
set with :func:`configure` (in-process tests) or read from the JSON file named by
``FAKE_PYVERBS_CONFIG`` (child processes). Hosts meet on a *fabric*: a directory where each
open port listens on a Unix socket and publishes its addresses (one record per GID for
RoCE, one per LID for InfiniBand). Bytes really move: an RDMA WRITE sends the local bytes
to the responder's process, which checks the rkey and bounds against its registered MRs
and copies them to the target address; an RDMA READ comes back the same way.

What is enforced, as the hardware and rdma-core v44 do:

- QP state machine (RESET → INIT → RTR → RTS, any → ERR/RESET) with the attributes each
  transition needs checked against the device and port (``EINVAL``); RoCE needs a GRH
  with a populated source GID; RC QPs on a device that refuses them (EFA) fail with
  ``EOPNOTSUPP``;
- send queue depth: more than ``max_send_wr`` WRs whose completions were not polled yet →
  ``ENOMEM`` from ``post_send``; posting before RTS → ``EINVAL``;
- completions with ``wr_id``, ``qp_num`` and status, in order per QP; the first error moves
  the QP to ERR and every later or queued WR completes with ``IBV_WC_WR_FLUSH_ERR``;
- lkey/rkey, bounds and access checks against registered MRs of the right PD
  (``IBV_WC_LOC_PROT_ERR``, ``IBV_WC_REM_ACCESS_ERR``); messages over the port's
  ``max_msg_sz`` (``IBV_WC_LOC_LEN_ERR``);
- delivery: the destination is looked up by GID (RoCE) or LID (IB); across subnets only
  RoCE v2 GIDs route and the hop limit must exceed the routers crossed; a path MTU above
  the link's drops large messages; a dropped message completes with
  ``IBV_WC_RETRY_EXC_ERR`` after the retry time;
- CQ capacity (overrun puts its QPs in ERR), the locked-memory limit for MRs (``ENOMEM``),
  and the native allocations of ``SGE``/``SendWR`` that pyverbs never frees by itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import itertools
import json
import mmap
import os
import queue
import random
import socket
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tests.fakes.pyverbs import enums as e

CONFIG_ENV = "FAKE_PYVERBS_CONFIG"

MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


@dataclasses.dataclass
class GidSpec:
    """One populated GID entry: the GID in pyverbs spelling and its sysfs type (0/1)."""

    gid: str
    type: int = e.IBV_GID_TYPE_SYSFS_ROCE_V2


@dataclasses.dataclass
class PortSpec:
    """One port. ``subnet`` names its L3 network (ports of another subnet are routed)."""

    state: int = e.IBV_PORT_ACTIVE
    link_layer: int = e.IBV_LINK_LAYER_ETHERNET
    active_mtu: int = e.IBV_MTU_4096
    max_mtu: int = e.IBV_MTU_4096
    lid: int = 0
    max_msg_sz: int = 1 << 30
    gids: list[GidSpec] = dataclasses.field(default_factory=list)
    gid_tbl_len: int = 16
    subnet: str = "lab"
    active_width: int = 2  # 4X
    active_speed: int = 64  # HDR lane: 50 Gb/s
    phys_state: int = 5  # LinkUp


@dataclasses.dataclass
class DeviceSpec:
    """One RDMA device. ``refuse_rc`` makes it behave like EFA (no RC QPs)."""

    name: str
    ports: list[PortSpec]
    node_type: int = e.IBV_NODE_CA
    transport_type: int = e.IBV_TRANSPORT_IB
    refuse_rc: bool = False
    max_qp_wr: int = 32768
    max_cqe: int = 4194303
    max_qp_rd_atom: int = 16
    max_qp_init_rd_atom: int = 16
    max_sge: int = 30
    max_mr_size: int = (1 << 64) - 1
    vendor_id: int = 0x02C9
    vendor_part_id: int = 4129


@dataclasses.dataclass
class HostSpec:
    """A host: its devices and the fabric directory shared with other hosts.

    Attributes:
        fabric: directory of endpoints and address records (keep the path short: Unix
            socket paths are limited to 108 bytes).
        devices: RDMA devices of this host.
        memlock_bytes: locked-memory limit for MRs (``None``: unlimited).
        retry_s: how long a dropped message takes to fail with RETRY_EXC_ERR.
        routers: routers between two subnets (a RoCE v2 hop limit must exceed it).
        list_error: ``get_device_list`` fails as on a host without the verbs driver.
        delay_s: the responder waits this long before serving each request.
        peermem: plain MRs over (fake) GPU memory work, as with nvidia_peermem loaded;
            without it they fail with EFAULT and only dma-buf MRs reach GPU memory.
        instant: every WR completes successfully the moment it is posted and no byte
            moves (to measure the caller's own cost per WR and per completion); real
            pyverbs SendWR objects may then be posted.
    """

    fabric: str
    devices: list[DeviceSpec]
    memlock_bytes: int | None = None
    retry_s: float = 0.05
    routers: int = 1
    list_error: bool = False
    delay_s: float = 0.0
    peermem: bool = False
    instant: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HostSpec:
        body = json.loads(text)
        devices = []
        for dev in body.pop("devices"):
            ports = [PortSpec(**{**p, "gids": [GidSpec(**g) for g in p.get("gids", [])]})
                     for p in dev.pop("ports")]
            devices.append(DeviceSpec(ports=ports, **dev))
        return cls(devices=devices, **body)


def roce_port(ipv4: str, *, subnet: str = "lab", state: int = e.IBV_PORT_ACTIVE,
              mac_suffix: int = 1, v2: bool = True, **fields: Any) -> PortSpec:
    """A RoCE port with the GID table a real one has: link-local v1 and v2 entries, then the
    IPv4-mapped v1 and v2 entries (so the routable RoCE v2 entry is index 3)."""
    a, b, c, d = (int(x) for x in ipv4.split("."))
    mapped = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
    local = f"fe80:0000:0000:0000:0000:00ff:fe00:{mac_suffix:04x}"
    gids = [GidSpec(local, 0), GidSpec(local, 1 if v2 else 0), GidSpec(mapped, 0)]
    if v2:
        gids.append(GidSpec(mapped, 1))
    return PortSpec(state=state, link_layer=e.IBV_LINK_LAYER_ETHERNET, gids=gids,
                    subnet=subnet, **fields)


def ib_port(lid: int, *, state: int = e.IBV_PORT_ACTIVE, **fields: Any) -> PortSpec:
    """An InfiniBand port: addressed by LID; GID 0 is the link-local port GID."""
    gid = f"fe80:0000:0000:0000:0002:c903:00{lid >> 8:02x}:{lid & 0xFF:02x}00"
    return PortSpec(state=state, link_layer=e.IBV_LINK_LAYER_INFINIBAND, lid=lid,
                    gids=[GidSpec(gid, 0)], **fields)


def efa_device(name: str = "rdmap16s27") -> DeviceSpec:
    """An AWS EFA device: listed by libibverbs, port ACTIVE, no RC QPs."""
    port = PortSpec(link_layer=e.IBV_LINK_LAYER_UNSPECIFIED, max_msg_sz=8928,
                    gids=[GidSpec("fe80:0000:0000:0000:0493:25ff:fe7d:1a01", 0)])
    return DeviceSpec(name, [port], node_type=e.IBV_NODE_UNSPECIFIED,
                      transport_type=e.IBV_TRANSPORT_UNSPECIFIED, refuse_rc=True,
                      vendor_id=0x1D0F, vendor_part_id=0xEFA1)


def gid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


# ---------------------------------------------------------------------------- errors


def rdma_error(msg: str, code: int) -> Exception:
    from tests.fakes.pyverbs.pyverbs_error import PyverbsRDMAError

    return PyverbsRDMAError(msg, code)


# ---------------------------------------------------------------------------- process state


class _State:
    """Everything this fake host holds: spec, open endpoints, QPs and MRs by number/key."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.spec: HostSpec | None = None
        self.qps: dict[int, Any] = {}
        self.next_qpn = itertools.count(random.randrange(0x100, 0x8000))
        self.keys: set[int] = set()
        self.pinned_bytes = 0
        self.endpoints: dict[tuple[str, int], Endpoint] = {}
        self.endpoint_users: dict[tuple[str, int], int] = {}
        self.link_down: set[tuple[str, int]] = set()
        self.native = {"SGE": 0, "SendWR": 0}
        #: address ranges of fake device memory (see tests.fakes.cuda)
        self.gpu_ranges: list[tuple[int, int]] = []

    def host(self) -> HostSpec:
        with self.lock:
            if self.spec is None:
                path = os.environ.get(CONFIG_ENV)
                if not path:
                    raise RuntimeError(f"fake pyverbs is not configured: call configure() or "
                                       f"set {CONFIG_ENV}")
                self.spec = HostSpec.from_json(Path(path).read_text(encoding="utf-8"))
            return self.spec

    def device(self, name: str) -> DeviceSpec | None:
        return next((d for d in self.host().devices if d.name == name), None)

    def new_key(self) -> int:
        with self.lock:
            while True:
                key = random.randrange(1, 1 << 32)
                if key not in self.keys:
                    self.keys.add(key)
                    return key


STATE = _State()


def configure(spec: HostSpec | None) -> None:
    """Make ``spec`` this process's host (``None`` forgets it). Refused while ports are open."""
    with STATE.lock:
        if STATE.endpoints:
            raise RuntimeError(f"fake pyverbs: {len(STATE.endpoints)} port(s) still open "
                               "(close every Context first)")
        STATE.spec = spec
        STATE.link_down.clear()


def reset() -> None:
    """Forget everything (after a failed test): destroy QPs, close ports, drop the spec."""
    for qp in list(STATE.qps.values()):
        qp.close()
    with STATE.lock:
        endpoints = list(STATE.endpoints.values())
        STATE.endpoints.clear()
        STATE.endpoint_users.clear()
        STATE.spec = None
        STATE.link_down.clear()
        STATE.pinned_bytes = 0
        STATE.gpu_ranges.clear()
    for endpoint in endpoints:
        endpoint.close()


def set_link(device: str, port: int, *, up: bool) -> None:
    """Cut (or restore) a port's link: messages through it are dropped."""
    with STATE.lock:
        if up:
            STATE.link_down.discard((device, port))
        else:
            STATE.link_down.add((device, port))


def native_allocations() -> dict[str, int]:
    """``SGE``/``SendWR`` objects created and not closed (real pyverbs leaks their memory)."""
    return dict(STATE.native)


def open_qps() -> int:
    """QPs created and not destroyed in this process."""
    return len(STATE.qps)


# ---------------------------------------------------------------------------- endpoints


_REQ = struct.Struct("<BIIIQQ16sHB")  # op, dst qpn, src qpn, rkey, addr, length, sgid, slid, pad
_RESP = struct.Struct("<B")
OP_WRITE, OP_READ = 1, 2
R_OK, R_DROP, R_ACCESS, R_INVALID = 0, 1, 2, 3


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("fabric connection closed")
        got += n


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    _recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def _discard(sock: socket.socket, size: int) -> None:
    chunk = bytearray(min(size, 1 << 20) or 1)
    while size:
        n = sock.recv_into(chunk, min(size, len(chunk)))
        if n == 0:
            raise ConnectionError("fabric connection closed")
        size -= n


def memview(address: int, length: int) -> memoryview:
    """A writable view of ``length`` bytes of this process's memory at ``address``."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class Endpoint:
    """One open port on the fabric: a Unix socket serving RDMA requests to this host's QPs."""

    _names = itertools.count()

    def __init__(self, device: DeviceSpec, port_num: int) -> None:
        host = STATE.host()
        self.device = device
        self.port_num = port_num
        self.port = device.ports[port_num - 1]
        self.fabric = Path(host.fabric)
        self.fabric.mkdir(parents=True, exist_ok=True)
        self.path = self.fabric / f"{os.getpid()}-{next(self._names)}.s"
        self.records: list[Path] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(64)
        self.closed = False
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        record = {"sock": str(self.path), "subnet": self.port.subnet,
                  "mtu": self.port.active_mtu, "link_layer": self.port.link_layer,
                  "lid": self.port.lid, "device": device.name, "port": port_num,
                  "max_msg_sz": self.port.max_msg_sz,
                  "gids": [[g.gid, g.type] for g in self.port.gids]}
        names = ([f"lid-{self.port.lid}"] if self.port.link_layer == e.IBV_LINK_LAYER_INFINIBAND
                 else [])
        names += [f"gid-{g.gid.replace(':', '')}" for g in self.port.gids]
        for name in dict.fromkeys(names):
            path = self.fabric / f"{name}.json"
            if path.exists():
                owner = json.loads(path.read_text(encoding="utf-8"))
                if Path(owner["sock"]).exists():
                    self.close()
                    raise RuntimeError(f"fake fabric: address {name} is already used by "
                                       f"{owner['device']} of another host")
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(record), encoding="utf-8")
            tmp.replace(path)
            self.records.append(path)
        self.accepter = threading.Thread(target=self._accept, daemon=True,
                                         name=f"fake-hca-{device.name}:{port_num}")
        self.accepter.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with STATE.lock:
                if self.closed:
                    conn.close()
                    return
                self.conns.append(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name="fake-hca-responder")
                self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                head = _recv_exact(conn, _REQ.size)
                op, dst_qpn, src_qpn, rkey, addr, length, sgid, slid, _ = _REQ.unpack(head)
                delay = STATE.host().delay_s
                if delay:
                    time.sleep(delay)
                verdict, target = self._check(op, dst_qpn, src_qpn, rkey, addr, length,
                                              sgid, slid)
                if op == OP_WRITE:
                    if target is None:
                        _discard(conn, length)
                    else:
                        mr, host_addr = target
                        with mr.access_lock:
                            if mr.closed:
                                _discard(conn, length)
                                verdict = R_ACCESS
                            else:
                                _recv_exact_into(conn, memview(host_addr, length))
                    conn.sendall(_RESP.pack(verdict))
                elif target is None:
                    conn.sendall(_RESP.pack(verdict))
                else:
                    mr, host_addr = target
                    with mr.access_lock:
                        if mr.closed:
                            conn.sendall(_RESP.pack(R_ACCESS))
                        else:
                            conn.sendall(_RESP.pack(R_OK))
                            conn.sendall(memview(host_addr, length))
        with contextlib.suppress(OSError):
            conn.close()

    def _check(self, op: int, dst_qpn: int, src_qpn: int, rkey: int, addr: int, length: int,
               sgid: bytes, slid: int) -> tuple[int, tuple[Any, int] | None]:
        if (self.device.name, self.port_num) in STATE.link_down:
            return R_DROP, None
        qp = STATE.qps.get(dst_qpn)
        if (qp is None or qp.context.name != self.device.name or qp.port_num != self.port_num
                or qp.state not in (e.IBV_QPS_RTR, e.IBV_QPS_RTS)):
            return R_DROP, None  # no such connected QP here: the packet is dropped
        if qp.remote_qpn != src_qpn:
            return R_DROP, None
        if self.port.link_layer == e.IBV_LINK_LAYER_INFINIBAND and not qp.remote_gid:
            if qp.remote_lid != slid:
                return R_DROP, None
        elif qp.remote_gid != sgid:
            return R_DROP, None
        if length > self.port.max_msg_sz:
            return R_INVALID, None
        need = e.IBV_ACCESS_REMOTE_WRITE if op == OP_WRITE else e.IBV_ACCESS_REMOTE_READ
        if not qp.access_flags & need:
            return R_ACCESS, None
        mr = qp.pd.by_rkey(rkey)
        if mr is None or not mr.access & need:
            return R_ACCESS, None
        host_addr = mr.translate(addr, length)
        if host_addr is None:
            return R_ACCESS, None
        return R_OK, (mr, host_addr)

    def close(self) -> None:
        self.closed = True
        for path in self.records:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with STATE.lock:
            conns, self.conns = self.conns, []
            threads, self.threads = self.threads, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self.accepter:
            self.accepter.join(5)
        for thread in threads:
            thread.join(5)
        for conn in conns:
            conn.close()


def open_endpoint(device: DeviceSpec, port_num: int) -> None:
    key = (device.name, port_num)
    with STATE.lock:
        if key not in STATE.endpoints:
            STATE.endpoints[key] = Endpoint(device, port_num)
        STATE.endpoint_users[key] = STATE.endpoint_users.get(key, 0) + 1


def close_endpoint(device: DeviceSpec, port_num: int) -> None:
    key = (device.name, port_num)
    with STATE.lock:
        users = STATE.endpoint_users.get(key, 0) - 1
        endpoint = None
        if users <= 0:
            STATE.endpoint_users.pop(key, None)
            endpoint = STATE.endpoints.pop(key, None)
        else:
            STATE.endpoint_users[key] = users
    if endpoint is not None:
        endpoint.close()


def lookup_address(fabric: Path, name: str) -> dict[str, Any] | None:
    """The record published for ``gid-<hex>`` or ``lid-<n>``, if its port is open."""
    try:
        record: dict[str, Any] = json.loads((fabric / f"{name}.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return record if Path(record["sock"]).exists() else None


# ---------------------------------------------------------------------------- send queue


@dataclasses.dataclass
class PostedWr:
    """A WR as the HCA copied it at post time."""

    seq: int
    wr_id: int
    opcode: int
    signaled: bool
    sges: list[tuple[int, int, int]]
    rkey: int
    remote_addr: int
    epoch: int = 0


class SendEngine:
    """Processes one QP's send queue in order on its own thread, as the HCA would."""

    def __init__(self, qp: Any) -> None:
        self.qp = qp
        self.jobs: queue.SimpleQueue[PostedWr | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.route: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="fake-hca-sq")
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(10)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()

    def _run(self) -> None:
        while True:
            wr = self.jobs.get()
            if wr is None:
                return
            qp = self.qp
            if qp.destroyed:
                continue
            if qp.state == e.IBV_QPS_ERR:
                qp.complete(wr, e.IBV_WC_WR_FLUSH_ERR, error=False)
                continue
            status = self._execute(wr)
            if qp.destroyed:
                continue
            if qp.state == e.IBV_QPS_ERR and status == e.IBV_WC_SUCCESS:
                status = e.IBV_WC_WR_FLUSH_ERR  # moved to ERR while it was on the wire
            qp.complete(wr, status, error=status not in (e.IBV_WC_SUCCESS,
                                                          e.IBV_WC_WR_FLUSH_ERR))

    def _execute(self, wr: PostedWr) -> int:
        qp = self.qp
        ((addr, length, lkey),) = wr.sges
        port = qp.port_spec
        if length > port.max_msg_sz:
            return e.IBV_WC_LOC_LEN_ERR
        local = qp.pd.by_lkey(lkey)
        need = e.IBV_ACCESS_LOCAL_WRITE if wr.opcode == e.IBV_WR_RDMA_READ else 0
        host_addr = None if local is None else local.translate(addr, length)
        if local is None or host_addr is None or (need and not local.access & need):
            return e.IBV_WC_LOC_PROT_ERR
        route = self._route()
        if route is None or (qp.context.name, qp.port_num) in STATE.link_down:
            return self._dropped()
        link_mtu = MTU_BYTES[min(port.active_mtu, int(route["mtu"]))]
        if length > link_mtu and MTU_BYTES[qp.path_mtu] > link_mtu:
            return self._dropped()  # frames above the link MTU never arrive
        op = OP_READ if wr.opcode == e.IBV_WR_RDMA_READ else OP_WRITE
        sgid = gid_bytes(port.gids[qp.sgid_index].gid) if qp.is_global else bytes(16)
        head = _REQ.pack(op, qp.remote_qpn, qp.qp_num, wr.rkey, wr.remote_addr, length,
                         sgid, port.lid, 0)
        try:
            sock = self._connect(route)
            with local.access_lock:
                if local.closed:
                    return e.IBV_WC_LOC_PROT_ERR
                if op == OP_WRITE:
                    sock.sendall(head)
                    sock.sendall(memview(host_addr, length))
                    (verdict,) = _RESP.unpack(_recv_exact(sock, _RESP.size))
                else:
                    sock.sendall(head)
                    (verdict,) = _RESP.unpack(_recv_exact(sock, _RESP.size))
                    if verdict == R_OK:
                        _recv_exact_into(sock, memview(host_addr, length))
        except (OSError, ConnectionError):
            self._drop_connection()
            return self._dropped()
        if verdict == R_OK:
            return e.IBV_WC_SUCCESS
        if verdict == R_ACCESS:
            return e.IBV_WC_REM_ACCESS_ERR
        if verdict == R_INVALID:
            return e.IBV_WC_REM_INV_REQ_ERR
        return self._dropped()

    def _dropped(self) -> int:
        time.sleep(STATE.host().retry_s)
        return e.IBV_WC_RETRY_EXC_ERR

    def _route(self) -> dict[str, Any] | None:
        if self.route is not None:
            return self.route
        qp = self.qp
        port = qp.port_spec
        fabric = Path(STATE.host().fabric)
        if port.link_layer == e.IBV_LINK_LAYER_INFINIBAND and not qp.is_global:
            record = lookup_address(fabric, f"lid-{qp.remote_lid}")
        else:
            record = lookup_address(fabric, f"gid-{qp.remote_gid.hex()}")
        if record is None or int(record["link_layer"]) != port.link_layer:
            return None
        if record["subnet"] != port.subnet:
            # Routed: only RoCE v2 (UDP/IP) crosses a router, and each router takes a hop.
            sgid = port.gids[qp.sgid_index]
            v2 = e.IBV_GID_TYPE_SYSFS_ROCE_V2
            dest_has_v2 = any(gid_bytes(g) == qp.remote_gid and t == v2
                              for g, t in record["gids"])
            routable = (qp.is_global and sgid.type == v2 and dest_has_v2
                        and not sgid.gid.startswith("fe80"))
            if not routable or qp.hop_limit <= STATE.host().routers:
                return None
        self.route = record
        return record

    def _connect(self, route: dict[str, Any]) -> socket.socket:
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(route["sock"])
            except OSError:
                sock.close()
                raise
            self.sock = sock
        return self.sock

    def _drop_connection(self) -> None:
        sock, self.sock = self.sock, None
        self.route = None
        if sock is not None:
            sock.close()


class CompletionQueue:
    """The CQ ring: bounded, overrun puts every attached QP in ERR."""

    def __init__(self, cqe: int) -> None:
        self.cqe = cqe
        self.entries: deque[tuple[int, int, int, int, int, int]] = deque()
        self.lock = threading.Lock()
        self.overrun = False

    def push(self, entry: tuple[int, int, int, int, int, int]) -> bool:
        with self.lock:
            if len(self.entries) >= self.cqe:
                self.overrun = True
                return False
            self.entries.append(entry)
            return True


def mmap_dmabuf(fd: int, offset: int, length: int) -> tuple[mmap.mmap, int]:
    """Map the pages of a (fake) dma-buf: a memfd whose pages the "GPU" tensor also maps."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    mapping = mmap.mmap(fd, length + offset - start, mmap.MAP_SHARED,
                        mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return mapping, base + offset - start


def errno_of(exc: OSError) -> int:
    return exc.errno or errno.EIO
