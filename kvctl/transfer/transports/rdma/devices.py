"""Device contexts and NIC choice: which ports the transport may use, and a context per port.

A port is usable when it is ACTIVE, its device offers RC queue pairs (EFA does not), and it
has an address: a LID on InfiniBand, a GID on RoCE (by default the port's RoCE v2
IPv4-mapped entry, the same choice ``kvctl topo --format env`` prints as
``MC_GID_INDEX``; ``gid_index`` overrides it and is checked). Everything else is listed
with the reason it was left out, and "no usable port" is the transport's "unavailable: why".

Each usable port gets a :class:`NicContext` (device context, protection domain, completion
queue). Which ports move a buffer's bytes comes from a *ranking*: location (``cuda:N``,
``cpu:N``) → NIC names best first, by default ``kvctl topo``'s ranking of this host
(PIX/PXB NICs for a GPU, NUMA-local ones for host memory), or the NICs pinned with ``nics``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import resource
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import (
    ROCE_V2,
    PyverbsBackend,
    RecordedVerbs,
    VerbsDevice,
    VerbsPort,
    VerbsReport,
    roce_v2_gid,
)
from kvctl.transfer.errors import TransportUnavailableError
from kvctl.transfer.paths import RetryPolicy
from kvctl.transfer.transports.rdma.provider import INSTALL_HINT, Verbs, error_code, load_verbs

_log = logging.getLogger("kvctl.transfer.rdma")

#: ``enum ibv_mtu`` for each MTU in bytes.
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MEMLOCK_HINT = ("raise the locked-memory limit: 'ulimit -l unlimited' (docker run "
                "--ulimit memlock=-1, systemd LimitMEMLOCK=infinity, Kubernetes: an "
                "IPC_LOCK capability or a pod memlock limit)")
_IB, _ETH = "InfiniBand", "Ethernet"

Ranking = Callable[[str], Sequence[str]]


@dataclasses.dataclass(frozen=True)
class RdmaOptions:
    """Settings of the rdma transport (all optional).

    Attributes:
        nics: NICs to use and nothing else: ``mlx5_0`` (its usable ports) or ``mlx5_0:1``;
            the order is the preference (``--nic``). Empty: every usable port, chosen per
            buffer by ``ranking``.
        gid_index: RoCE GID index to use on every port (``--gid-index``); default: each
            port's RoCE v2 IPv4-mapped entry.
        hop_limit: GRH hop limit, 1-255: RoCE v2 packets cross at most this many routers.
        traffic_class: GRH traffic class (DSCP << 2), 0-255.
        slice_bytes: requests above this are cut into slices spread over the buffer's NICs
            (clamped to the ports' ``max_msg_sz``).
        max_send_wr: work requests in flight per queue pair (clamped to the device's).
        cq_entries: completion queue entries per port (clamped to the device's).
        timeout_s: a queue pair whose requests make no progress this long is failed and
            its slices retried on another NIC.
        retry: retries per slice and pausing of failing NIC pairs.
        ranking: location → NIC names, best first; ``None``: ``kvctl topo``'s ranking of
            this host (read once, when there is more than one usable port).
        bounce_bytes: registered host memory per port for staging buffers that have no
            memory region (files, GPU memory without dma-buf or peermem).
        gpu_memory: how GPU buffers are exposed: ``auto`` (dma-buf MR, else a plain MR
            through nvidia_peermem, else staged through host memory), ``dmabuf``,
            ``peermem`` or ``staged``.
        cuda: the CUDA driver gateway for dma-buf exports (``None``: libcuda through
            ctypes); a :class:`~kvctl.transfer.transports.rdma.memory.CudaGateway`.
        peermem: whether plain MRs reach GPU memory (``None``: whether ``nvidia_peermem``
            is loaded).
    """

    nics: tuple[str, ...] = ()
    gid_index: int | None = None
    hop_limit: int = 255
    traffic_class: int = 0
    slice_bytes: int = 1 << 20
    max_send_wr: int = 256
    cq_entries: int = 4096
    timeout_s: float = 30.0
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    ranking: Ranking | None = None
    bounce_bytes: int = 8 << 20
    gpu_memory: str = "auto"
    cuda: Any = None
    peermem: bool | None = None

    def check(self) -> None:
        """Validate every setting up front.

        Raises:
            UsageError: a setting is out of range (naming it).
        """
        from kvctl.errors import UsageError

        problems = []
        if self.gid_index is not None and not 0 <= self.gid_index <= 255:
            problems.append(f"gid_index {self.gid_index} (0-255)")
        if not 1 <= self.hop_limit <= 255:
            problems.append(f"hop_limit {self.hop_limit} (1-255)")
        if not 0 <= self.traffic_class <= 255:
            problems.append(f"traffic_class {self.traffic_class} (0-255)")
        if self.slice_bytes < 4096:
            problems.append(f"slice_bytes {self.slice_bytes} (at least 4096)")
        if self.max_send_wr < 1 or self.cq_entries < 1:
            problems.append("max_send_wr and cq_entries must be positive")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s {self.timeout_s} (positive)")
        if self.bounce_bytes < self.slice_bytes:
            problems.append(f"bounce_bytes {self.bounce_bytes} (at least slice_bytes)")
        if self.gpu_memory not in ("auto", "dmabuf", "peermem", "staged"):
            problems.append(f"gpu_memory {self.gpu_memory!r} (auto, dmabuf, peermem, staged)")
        for nic in self.nics:
            dev, sep, port = nic.partition(":")
            if not dev or (sep and not (port.isascii() and port.isdigit())):
                problems.append(f"NIC {nic!r} (write mlx5_0 or mlx5_0:1)")
        if problems:
            raise UsageError(f"bad rdma settings: {'; '.join(problems)}",
                             "fix the values (see docs/transfer.md, 'RDMA settings')")


@dataclasses.dataclass(frozen=True)
class NicPort:
    """A usable port and the facts the QP exchange needs.

    Attributes:
        device / port: ``mlx5_0`` and 1.
        link_layer: ``InfiniBand`` or ``Ethernet`` (RoCE).
        lid: base LID (InfiniBand), 0 on RoCE.
        gid: the GID used as 32 hex digits (RoCE; empty on InfiniBand).
        gid_index: its index (``sgid_index``), ``None`` on InfiniBand.
        gid_type: ``RoCE v2``, ``IB/RoCE v1`` or ``None``.
        active_mtu: ``enum ibv_mtu`` of the port's active MTU (path MTU is the smaller of
            both ends').
        max_msg_bytes: ``max_msg_sz``.
        rate_gbps: link rate, Gb/s, ``None`` when unknown.
    """

    device: str
    port: int
    link_layer: str
    lid: int
    gid: str
    gid_index: int | None
    gid_type: str | None
    active_mtu: int
    max_msg_bytes: int
    rate_gbps: float | None = None

    @property
    def name(self) -> str:
        """``device:port``."""
        return f"{self.device}:{self.port}"

    @property
    def is_ib(self) -> bool:
        """InfiniBand (addressed by LID) rather than RoCE (by GID)."""
        return self.link_layer == _IB


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the transport may use here.

    Attributes:
        ports: usable ports, in preference order (pins first, else by name).
        rejected: ``mlx5_1:1: port state DOWN``-style lines for everything left out.
        reason: why RDMA is unavailable (``None`` when some port is usable).
        hint: how to fix it.
    """

    ports: tuple[NicPort, ...]
    rejected: tuple[str, ...]
    reason: str | None
    hint: str | None


def _pins(nics: Sequence[str]) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for nic in nics:
        dev, _, port = nic.partition(":")
        out.append((dev, int(port) if port else None))
    return out


def _port_usable(dev: VerbsDevice, port: VerbsPort, gid_index: int | None
                 ) -> tuple[NicPort | None, str | None]:
    """The usable port, or why not."""
    where = f"{dev.name}:{port.port}"
    if dev.is_efa:
        return None, (f"{dev.name}: an EFA device (node type unspecified): it offers SRD/UD "
                      "queue pairs, not the RC ones one-sided RDMA needs")
    if port.state != "ACTIVE":
        return None, f"{where}: port state {port.state}"
    mtu = MTU_ENUM.get(port.active_mtu_bytes or 0)
    if mtu is None:
        return None, f"{where}: active MTU unknown"
    max_msg = port.max_msg_bytes or (1 << 30)
    rate = port.rate_gbps
    if port.link_layer == _IB:
        if not port.lid:
            return None, f"{where}: InfiniBand port without a LID (is a subnet manager running?)"
        return NicPort(dev.name, port.port, _IB, port.lid, "", None, None, mtu, max_msg,
                       rate), None
    if port.link_layer != _ETH:
        return None, f"{where}: link layer {port.link_layer or 'unknown'}, not InfiniBand or RoCE"
    if gid_index is not None:
        entry = next((g for g in port.gids if g.index == gid_index), None)
        if entry is None:
            filled = ", ".join(str(g.index) for g in port.gids) or "none"
            return None, f"{where}: GID index {gid_index} is empty (populated: {filled})"
        if entry.type != ROCE_V2:
            _log.warning("%s: GID index %d is %s, not RoCE v2: it does not cross routers",
                         where, gid_index, entry.type or "of unknown type")
    else:
        entry = roce_v2_gid(port.gids)
        if entry is None:
            return None, (f"{where}: no RoCE v2 GID (the netdev has no IP address, or only "
                          "RoCE v1 entries)")
    gid = entry.gid.replace(":", "").lower()
    return NicPort(dev.name, port.port, _ETH, 0, gid, entry.index, entry.type, mtu, max_msg,
                   rate), None


def select_ports(report: VerbsReport, options: RdmaOptions
                 ) -> tuple[list[NicPort], list[str]]:
    """The usable ports of ``report`` under ``options`` (pins, GID index), and the reasons
    for everything left out."""
    usable: list[NicPort] = []
    rejected: list[str] = []
    names = {d.name for d in report.devices}
    for dev in report.devices:
        for port in dev.ports:
            found, why = _port_usable(dev, port, options.gid_index)
            if found is not None:
                usable.append(found)
            elif why is not None:
                rejected.append(why)
    pins = _pins(options.nics)
    if not pins:
        return usable, rejected
    chosen: list[NicPort] = []
    for dev_name, port_num in pins:
        if dev_name not in names:
            rejected.append(f"{dev_name}: not found (present: {', '.join(sorted(names))})")
            continue
        matched = [p for p in usable if p.device == dev_name
                   and (port_num is None or p.port == port_num)]
        if not matched:
            rejected.append(f"{dev_name}{f':{port_num}' if port_num else ''}: pinned but not "
                            "usable")
        chosen.extend(p for p in matched if p not in chosen)
    return chosen, rejected


def check_pins(report: VerbsReport, options: RdmaOptions) -> None:
    """Check the NICs pinned by ``options.nics`` and its ``gid_index`` against the devices
    ``report`` lists: a pin naming no device or port here, or a GID index past a RoCE
    port's GID table, is a misconfiguration (fatal, also under transport ``auto``).

    Raises:
        UsageError: naming the devices (and ports) present, or the GID table's size.
    """
    from kvctl.errors import UsageError

    by_name = {d.name: d for d in report.devices}
    present = ", ".join(sorted(by_name)) or "none"
    ports: list[tuple[VerbsDevice, VerbsPort]] = []
    for dev_name, port_num in _pins(options.nics) or [(d, None) for d in sorted(by_name)]:
        dev = by_name.get(dev_name)
        if dev is None:
            raise UsageError(f"RDMA device {dev_name!r} is not on this host (present: "
                             f"{present})", "pin one of them (ibv_devices lists them), "
                             "e.g. --nic " + (min(by_name) if by_name else "mlx5_0"))
        matched = [p for p in dev.ports if port_num is None or p.port == port_num]
        if not matched:
            have = ", ".join(f"{dev_name}:{p.port}" for p in dev.ports) or "none"
            raise UsageError(f"RDMA device {dev_name} has no port {port_num} (ports: {have})",
                             f"pin {dev_name} (all its ports) or one of {have}")
        ports.extend((dev, p) for p in matched)
    if options.gid_index is None:
        return
    for dev, port in ports:
        size = port.gid_table_len
        if port.link_layer == _ETH and size is not None and options.gid_index >= size:
            raise UsageError(
                f"GID index {options.gid_index} is past the GID table of {dev.name}:"
                f"{port.port} ({size} entries: 0-{size - 1})",
                "pick a populated index (show_gids or ibv_devinfo -v lists them), or drop "
                "--gid-index to use the port's RoCE v2 IPv4-mapped entry")


def _hint_for(rejected: Sequence[str]) -> str:
    text = " ".join(rejected)
    if "EFA" in text and "state" not in text:
        return ("EFA has no RC queue pairs: use transport tcp here, or move bytes with "
                "Mooncake or NIXL over libfabric (bench transfer --engine)")
    if "port state" in text:
        return ("bring a link up (ibv_devinfo should show PORT_ACTIVE): check the cable, the "
                "switch port and, on InfiniBand, the subnet manager")
    if "RoCE v2 GID" in text or "GID index" in text:
        return ("give the RoCE netdev an IPv4 address so its port gets a RoCE v2 GID "
                "(show_gids lists them), or pass gid_index / --gid-index")
    if "not found" in text or "pinned" in text:
        return "pin a listed device (ibv_devices) or drop the pin"
    return "check the ports with ibv_devinfo -v"


def probe(options: RdmaOptions, verbs: Verbs | None = None,
          report: VerbsReport | Unavailable | None = None) -> Probe:
    """Which ports the transport may use here, or why none (never raises for absent
    hardware; ``report`` replays a recorded answer).

    Raises:
        UsageError: pinned NICs or the GID index do not fit this host (:func:`check_pins`).
    """
    if report is None:
        if verbs is None:
            try:
                verbs = load_verbs()
            except ImportError as exc:
                return Probe((), (), f"pyverbs is not importable ({exc})", INSTALL_HINT)
        report = PyverbsBackend(verbs.device).query()
    if isinstance(report, Unavailable):
        reason = (f"no RDMA devices found ({report.reason})" if "lists no" in report.reason
                  else f"cannot list RDMA devices ({report.reason})")
        return Probe((), (), reason,
                     "load the NIC's RDMA driver (mlx5_ib, irdma, rdma_rxe for soft-RoCE) "
                     "and check ibv_devices")
    check_pins(report, options)
    usable, rejected = select_ports(report, options)
    if usable:
        for line in rejected:
            _log.info("RDMA: not using %s", line)
        return Probe(tuple(usable), tuple(rejected), None, None)
    return Probe((), tuple(rejected), "no usable RDMA port: " + "; ".join(rejected),
                 _hint_for(rejected))


def memlock_text() -> str:
    """The locked-memory limit as ``ulimit -l`` would put it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{soft // 1024} KiB"


def registration_error(what: str, length: int, exc: BaseException) -> TransportUnavailableError:
    """A typed error for a failed ``ibv_reg_mr``, with the memlock fix when it applies."""
    code = error_code(exc)
    cause = f"cannot register {what} ({length} bytes) for RDMA: {str(exc).strip()}"
    if code in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
        return TransportUnavailableError(
            f"{cause}; the locked-memory limit is {memlock_text()} (ulimit -l)", MEMLOCK_HINT)
    if code == errno.EFAULT:
        return TransportUnavailableError(
            f"{cause}; the memory is not pinnable (GPU memory without nvidia_peermem?)",
            "load nvidia_peermem, or use dma-buf (kernel 5.12+, a recent NVIDIA driver)")
    return TransportUnavailableError(cause, "check the device with ibv_devinfo and dmesg")


class NicContext:
    """One usable port opened: device context, protection domain and completion queue.

    Attributes:
        port: the port's facts.
        window: work requests in flight per QP on it.
        cq_capacity: completion queue entries (never more WRs outstanding on the port).
        max_rd_atomic / max_dest_rd_atomic: RDMA READs in flight as initiator / responder.

    Raises (constructor):
        TransportUnavailableError: the device cannot be opened or refuses RC queue pairs.
    """

    def __init__(self, verbs: Verbs, port: NicPort, options: RdmaOptions) -> None:
        self.verbs = verbs
        self.port = port
        self.name = port.name
        self.lock = threading.Lock()
        self._objects: list[Any] = []
        try:
            self.ctx: Any = verbs.device.Context(name=port.device)
            self._objects.append(self.ctx)
            attr = self.ctx.query_device()
            self.pd: Any = verbs.PD(self.ctx)
            self._objects.append(self.pd)
            self.cq_capacity = max(1, min(options.cq_entries, int(attr.max_cqe)))
            self.cq: Any = verbs.CQ(self.ctx, self.cq_capacity)
            self._objects.append(self.cq)
            self.window = max(1, min(options.max_send_wr, int(attr.max_qp_wr),
                                     self.cq_capacity))
            self.max_rd_atomic = max(1, min(16, int(attr.max_qp_init_rd_atom)))
            self.max_dest_rd_atomic = max(1, min(16, int(attr.max_qp_rd_atom)))
            probe_qp = self.create_qp(1)
            probe_qp.close()
        except verbs.Error as exc:
            self.close()
            if error_code(exc) == errno.EOPNOTSUPP:
                raise TransportUnavailableError(
                    f"{port.name} refuses RC queue pairs ({str(exc).strip()})",
                    "use a NIC with RC support (not EFA), or transport tcp") from None
            raise TransportUnavailableError(f"cannot open {port.name}: {str(exc).strip()}",
                                            "check the device with ibv_devinfo") from None

    def create_qp(self, max_send_wr: int) -> Any:
        """A new RC QP on this port's PD and CQ (state RESET)."""
        v = self.verbs
        cap = v.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.QPInitAttr(qp_type=v.enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                            sq_sig_all=1)
        return v.QP(self.pd, init)

    def register(self, address: int, length: int, access: int) -> Any:
        """``ibv_reg_mr`` of host (or peer-mapped device) memory; pyverbs errors raise."""
        with self.lock:
            return self.verbs.MR(self.pd, length, access, address=address)

    def register_dmabuf(self, fd: int, offset: int, length: int, access: int) -> Any:
        """``ibv_reg_dmabuf_mr`` (I/O addresses start at ``offset``); pyverbs errors raise."""
        if self.verbs.DmaBufMR is None:
            raise TransportUnavailableError(f"{self.verbs.package} has no DmaBufMR",
                                            "use rdma-core 34 or later")
        with self.lock:
            return self.verbs.DmaBufMR(self.pd, length, access, dmabuf=fd, offset=offset)

    def close(self) -> None:
        """Close CQ, PD and context in reverse order (QPs and MRs go with the PD); keeps
        the first error. Safe to call twice."""
        first: BaseException | None = None
        while self._objects:
            obj = self._objects.pop()
            try:
                obj.close()
            except self.verbs.Error as exc:
                first = first or exc
        if first is not None:
            _log.warning("closing %s: %s", self.name, first)


def live_topology() -> Any:
    """This host's topology (sysfs, NVML, verbs) as ``kvctl topo`` reads it, or ``None``
    when it cannot be read (logged)."""
    from kvctl.errors import KvctlError
    from kvctl.probe.nvml import PynvmlBackend
    from kvctl.probe.sysfs import SysfsReader
    from kvctl.topo.build import discover

    nvml = PynvmlBackend()
    try:
        return discover(SysfsReader("/"), nvml, RecordedVerbs(PyverbsBackend().query()),
                        cuda_env=os.environ)
    except (KvctlError, OSError) as exc:
        _log.info("RDMA NIC ranking: topology unreadable (%s); NICs used in name order", exc)
        return None
    finally:
        nvml.close()


def topo_ranking(topology: Any = None) -> Ranking | None:
    """``kvctl topo``'s choice of RDMA NICs for each location (``topology``, or this host's):
    the ACTIVE NICs tied for first place, else every NIC best first. ``None`` when the
    topology cannot be read."""
    from kvctl.errors import KvctlError
    from kvctl.topo.model import NicKind
    from kvctl.topo.rank import preferred_nics

    topo = topology if topology is not None else live_topology()
    if topo is None:
        return None

    def rank(location: str) -> Sequence[str]:
        try:
            return (best_rdma_ports(topo, location)
                    or preferred_nics(topo, location, kind=NicKind.RDMA))
        except KvctlError:
            return ()

    return rank


def best_rdma_ports(topology: Any, location: str) -> list[str]:
    """``device:port`` of the ACTIVE RDMA NICs ``kvctl topo`` ranks first for ``location``
    (what its env export puts in ``UCX_NET_DEVICES``); empty when there is none.

    Raises:
        UsageError, NotFoundError: ``location`` is malformed or not on this host.
    """
    from kvctl.topo.model import NicKind
    from kvctl.topo.rank import best_nics, nic_ports

    names = best_nics(topology, location, kind=NicKind.RDMA)
    by_name = {n.name: n for n in topology.nics}
    return [f"{name}:{port}" for name in names for port in nic_ports(by_name[name])]


def ranked_rdma_ports(location: str = "cpu:0") -> list[str]:
    """:func:`best_rdma_ports` for ``location`` on this host; empty when the topology cannot
    be read or names nothing there (the engines' drivers then let the engine choose)."""
    from kvctl.errors import KvctlError

    topology = live_topology()
    if topology is None:
        return []
    try:
        return best_rdma_ports(topology, location)
    except KvctlError:
        return []


def order_for(location: str, ports: Sequence[NicPort], ranking: Ranking | None) -> list[NicPort]:
    """The ports that move a buffer at ``location``: those of the NICs ``ranking`` names for
    it (``mlx5_0`` or ``mlx5_0:1``), in its order; every port when it names none of them."""
    if ranking is None or len(ports) < 2:
        return list(ports)
    try:
        names = list(ranking(location))
    except Exception as exc:  # noqa: BLE001 - a caller's ranking must not break the data path
        _log.warning("RDMA NIC ranking for %s failed (%s); using every NIC", location, exc)
        return list(ports)
    out: list[NicPort] = []
    for name in names:
        out.extend(p for p in ports if name in (p.device, p.name) and p not in out)
    return out or list(ports)
