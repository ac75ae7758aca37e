"""RDMA port facts from libibverbs, through pyverbs (imported lazily).

:class:`VerbsBackend` is the interface topo uses; :class:`PyverbsBackend` implements it on
rdma-core's ``pyverbs``, :class:`RecordedVerbs` replays a stored answer. "No pyverbs", "no
devices" and "cannot open the device list" are :class:`~kvctl.probe.types.Unavailable`
values, never exceptions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from kvctl.probe.types import Unavailable


def import_pyverbs_device() -> ModuleType:
    """``pyverbs.device``, imported without the side effect of pyverbs configuring the
    root logger (it calls ``logging.basicConfig(level=INFO)`` on import, which turns on
    every library's INFO lines in scripts that use kvctl).

    Raises:
        ImportError: pyverbs is not installed.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from pyverbs import device as imported

        device: ModuleType = imported
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return device

_log = logging.getLogger("kvctl.probe.verbs")

_HINT = "install rdma-core (libibverbs1, python3-pyverbs) and load the NIC's RDMA driver"

#: ``enum ibv_mtu`` → bytes.
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
#: ``active_speed`` (SDR .. XDR) → nominal Gb/s per lane, as sysfs ``rate`` rounds them.
_LANE_NOMINAL = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0,
                 256: 200.0}
#: ``active_width`` → lanes.
WIDTH_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
#: ``enum ibv_port_state`` → name.
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
#: ``link_layer`` → name.
LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
#: ``enum ibv_gid_type_sysfs`` (what ``ibv_query_gid_type``, and so pyverbs'
#: ``query_gid_type``, returns: 0 IB/RoCE v1, 1 RoCE v2) → sysfs spelling. Not
#: ``enum ibv_gid_type`` of ``ibv_query_gid_ex`` (IB 0, RoCE v1 1, RoCE v2 2).
GID_TYPES = {0: "IB/RoCE v1", 1: "RoCE v2"}
ROCE_V2 = "RoCE v2"
#: ``IBV_NODE_UNSPECIFIED`` and ``IBV_TRANSPORT_UNSPECIFIED``: what EFA devices report.
NODE_UNSPECIFIED = 7
TRANSPORT_UNSPECIFIED = 4
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def gid_preference(gid: str, index: int) -> tuple[int, int]:
    """Sort key of a GID entry: IPv4-mapped first (routable RoCE v2), then other global
    GIDs, then link-local ones; lower index first. ``kvctl topo --format env`` uses the
    same order for ``MC_GID_INDEX``."""
    if gid.startswith(_IPV4_MAPPED):
        return (0, index)
    if gid.startswith("fe80:"):
        return (2, index)
    return (1, index)


def roce_v2_gid(gids: Sequence[VerbsGid]) -> VerbsGid | None:
    """The GID entry RoCE traffic should use: the best RoCE v2 entry by
    :func:`gid_preference` (the IPv4-mapped one when the netdev has an IPv4 address)."""
    v2 = [g for g in gids if g.type == ROCE_V2]
    return min(v2, key=lambda g: gid_preference(g.gid, g.index)) if v2 else None


@dataclasses.dataclass(frozen=True)
class VerbsGid:
    """One populated GID (``ibv_query_gid``/``ibv_query_gid_type``)."""

    index: int
    gid: str
    type: str | None


@dataclasses.dataclass(frozen=True)
class VerbsPort:
    """One port as ``ibv_devinfo -v`` shows it.

    Attributes:
        state: ``ACTIVE``, ``DOWN``, ...
        active_mtu_bytes: path MTU in use (``active_mtu``), bytes.
        max_mtu_bytes: largest MTU the port supports, bytes.
        lanes: active width in lanes (4 for ``4X``).
        rate_gbps: lanes x nominal lane speed, Gb/s (decimal).
        link_layer: ``InfiniBand`` or ``Ethernet``.
        gids: populated GID entries.
        lid: base LID (InfiniBand; 0 on RoCE), ``None`` when not read.
        max_msg_bytes: largest message one work request may carry (``max_msg_sz``), bytes.
        gid_table_len: entries in the port's GID table (``gid_tbl_len``), ``None`` when
            not read.
    """

    port: int
    state: str
    active_mtu_bytes: int | None
    max_mtu_bytes: int | None
    lanes: int | None
    rate_gbps: float | None
    link_layer: str | None
    gids: tuple[VerbsGid, ...] = ()
    lid: int | None = None
    max_msg_bytes: int | None = None
    gid_table_len: int | None = None


@dataclasses.dataclass(frozen=True)
class VerbsDevice:
    """An RDMA device and its ports.

    Attributes:
        name: device name (``mlx5_0``).
        ports: its ports.
        node_type: ``enum ibv_node_type`` (1 CA, 4 RNIC, 7 unspecified), ``None`` if unknown.
        transport_type: ``enum ibv_transport_type`` (0 IB, 1 iWARP, 4 unspecified).
    """

    name: str
    ports: tuple[VerbsPort, ...]
    node_type: int | None = None
    transport_type: int | None = None

    @property
    def is_efa(self) -> bool:
        """Whether this is an AWS EFA device (node and transport "unspecified"): it offers
        UD and SRD queue pairs only, never RC (rdma-core providers/efa/verbs.c)."""
        return (self.node_type == NODE_UNSPECIFIED
                and self.transport_type == TRANSPORT_UNSPECIFIED)


@dataclasses.dataclass(frozen=True)
class VerbsReport:
    """Every RDMA device libibverbs lists."""

    devices: tuple[VerbsDevice, ...]


class VerbsBackend(Protocol):
    """Source of RDMA port facts. Implementations never raise for "verbs is not here"."""

    def query(self) -> VerbsReport | Unavailable:
        """Every RDMA device and port, or why verbs cannot answer."""
        ...


class PyverbsBackend:
    """:class:`VerbsBackend` on pyverbs.

    Args:
        device_module: ``pyverbs.device`` or a stand-in with ``get_device_list`` and
            ``Context``; ``None`` imports pyverbs on first use.
        max_gids: most GID indexes read per port.
    """

    def __init__(self, device_module: ModuleType | Any | None = None, *, max_gids: int = 256
                 ) -> None:
        self._device = device_module
        self._max_gids = max_gids

    def __repr__(self) -> str:
        return "PyverbsBackend()"

    def query(self) -> VerbsReport | Unavailable:
        """See :meth:`VerbsBackend.query`."""
        if self._device is None:
            try:
                pyverbs_device = import_pyverbs_device()
            except ImportError as exc:
                return Unavailable("verbs", f"pyverbs is not importable ({exc})", _HINT)
            self._device = pyverbs_device
        device: Any = self._device
        error_type = getattr(device, "PyverbsError", Exception)
        try:
            listed = device.get_device_list()
        except error_type as err:
            return Unavailable("verbs", f"libibverbs: {err}", _HINT)
        if not listed:
            return Unavailable("verbs", "libibverbs lists no RDMA devices", _HINT)
        devices: list[VerbsDevice] = []
        for entry in listed:
            name = _text(entry.name)
            try:
                info = self._device_info(device, name)
            except error_type as err:
                _log.warning("verbs: cannot query %s: %s", name, err)
                continue
            devices.append(dataclasses.replace(
                info, node_type=_int_or_none(getattr(entry, "node_type", None)),
                transport_type=_int_or_none(getattr(entry, "transport_type", None))))
        return VerbsReport(devices=tuple(sorted(devices, key=lambda d: d.name)))

    def _device_info(self, device: Any, name: str) -> VerbsDevice:
        error_type = getattr(device, "PyverbsError", Exception)
        ctx = device.Context(name=name)
        try:
            attr = ctx.query_device()
            ports: list[VerbsPort] = []
            for port in range(1, int(attr.phys_port_cnt) + 1):
                pattr = ctx.query_port(port)
                lanes = WIDTH_LANES.get(int(pattr.active_width))
                lane = _LANE_NOMINAL.get(int(pattr.active_speed))
                gids: list[VerbsGid] = []
                table = min(int(getattr(pattr, "gid_tbl_len", 0)), self._max_gids)
                for index in range(table):
                    try:
                        gid = str(ctx.query_gid(port, index))
                    except error_type:
                        continue
                    if not gid or set(gid) <= {"0", ":"}:
                        continue
                    try:
                        gid_type: str | None = GID_TYPES.get(int(ctx.query_gid_type(port, index)))
                    except error_type:
                        gid_type = None
                    gids.append(VerbsGid(index, gid, gid_type))
                ports.append(
                    VerbsPort(
                        port=port,
                        state=PORT_STATES.get(int(pattr.state), str(pattr.state)),
                        active_mtu_bytes=MTU_BYTES.get(int(pattr.active_mtu)),
                        max_mtu_bytes=MTU_BYTES.get(int(pattr.max_mtu)),
                        lanes=lanes,
                        rate_gbps=lanes * lane if lanes and lane else None,
                        link_layer=LINK_LAYERS.get(int(pattr.link_layer)),
                        gids=tuple(gids),
                        lid=_int_or_none(getattr(pattr, "lid", None)),
                        max_msg_bytes=_int_or_none(getattr(pattr, "max_msg_sz", None)),
                        gid_table_len=_int_or_none(getattr(pattr, "gid_tbl_len", None)),
                    )
                )
        finally:
            ctx.close()
        return VerbsDevice(name=name, ports=tuple(ports))


class RecordedVerbs:
    """:class:`VerbsBackend` that replays an answer (from a snapshot or a test)."""

    def __init__(self, answer: VerbsReport | Unavailable) -> None:
        self._answer = answer

    def query(self) -> VerbsReport | Unavailable:
        """The recorded answer."""
        return self._answer


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def verbs_to_dict(answer: VerbsReport | Unavailable) -> dict[str, Any]:
    """A JSON-ready form of a verbs answer (snapshots store this)."""
    if isinstance(answer, Unavailable):
        return {"unavailable": dataclasses.asdict(answer)}
    return {"report": dataclasses.asdict(answer)}


def verbs_from_dict(data: Any) -> VerbsReport | Unavailable:
    """Inverse of :func:`verbs_to_dict`.

    Raises:
        ValueError, TypeError, KeyError: ``data`` is not what :func:`verbs_to_dict` writes.
    """
    if "unavailable" in data:
        return Unavailable(**data["unavailable"])
    devices = []
    for raw in data["report"]["devices"]:
        ports = []
        for p in raw["ports"]:
            fields = dict(p)
            fields["gids"] = tuple(VerbsGid(**g) for g in fields.get("gids", ()))
            ports.append(VerbsPort(**fields))
        devices.append(VerbsDevice(name=raw["name"], ports=tuple(ports),
                                   node_type=raw.get("node_type"),
                                   transport_type=raw.get("transport_type")))
    return VerbsReport(devices=tuple(devices))
