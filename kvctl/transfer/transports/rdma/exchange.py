"""Queue pair lifecycle and exchange: create, connect (INIT → RTR → RTS), fail, destroy.

The two ends of an RC connection swap :class:`QpInfo` directly, over a small TCP service
the target's rdma transport runs (its address is published with the segment's memory
regions), never through the metadata service: an initiator whose metadata is private (a
store client's ``memory://``) still reaches the node it talks to. The TCP connection lives
as long as the QP pair: the target destroys its QP when the initiator's connection closes,
so no QP outlives its peer. With a token both ends prove they know it
(HMAC challenge-response, :mod:`kvctl.net.auth`).

One request per connection::

    server → client   flags (1 byte: bit 0 = token required) + nonce (32 bytes)
    client → server   HMAC-SHA256(token, "kvctl-rdma-cm/1" || nonce) (32 bytes; zeros if none)
    server → client   verdict (1 byte: 0 ok, 1 refused)
    client → server   frame: {"v": 1, "initiator", "target_nic", "qp": QpInfo}
    server → client   frame: {"qp": QpInfo} or {"error": "..."}

A frame is a 4-byte big-endian length and that many bytes of JSON (at most 64 KiB). Any
failure on the target (a bad request, a pyverbs error creating or connecting its QP) is
answered and logged; the service keeps serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvctl.errors import AuthError, KvctlError, UsageError
from kvctl.net import auth
from kvctl.net.advertise import advertised_addresses
from kvctl.transfer.errors import TransportUnavailableError
from kvctl.transfer.transports.rdma.devices import NicContext, RdmaOptions

_log = logging.getLogger("kvctl.transfer.rdma")

_MAX_U24 = (1 << 24) - 1
_CONTEXT = b"kvctl-rdma-cm/1"
_LEN = struct.Struct(">I")
_MAX_FRAME = 64 << 10
_HANDSHAKE_S = 5.0


@dataclasses.dataclass(frozen=True)
class QpInfo:
    """What a peer needs to connect an RC queue pair to ours.

    Attributes:
        device: RDMA device name (e.g. ``mlx5_0``).
        port: port number (1-based).
        lid: port LID (InfiniBand; 0 on RoCE).
        gid: the port GID in use as 32 hex digits (RoCE), or empty (InfiniBand).
        qpn: queue pair number (24 bits).
        psn: initial packet sequence number (24 bits).
        mtu: the port's active MTU (``enum ibv_mtu``: 1=256 ... 5=4096 bytes).
    """

    device: str
    port: int
    lid: int
    gid: str
    qpn: int
    psn: int
    mtu: int

    def to_json(self) -> bytes:
        """Encode for the exchange."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | dict[str, Any], *, source: str) -> QpInfo:
        """Decode and validate a peer's QP info.

        Raises:
            UsageError: not JSON, missing fields, or values out of range (naming ``source``).
        """
        try:
            body = json.loads(raw) if isinstance(raw, bytes | str) else raw
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
            (bool(info.gid) or info.lid > 0, "lid/gid (neither set)"),
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


def gid_words(gid: str) -> str:
    """32 hex digits → pyverbs' ``xxxx:xxxx:...`` spelling."""
    return ":".join(gid[i : i + 4] for i in range(0, 32, 4))


# ---------------------------------------------------------------------------- QP lifecycle


def access_flags(nic: NicContext) -> int:
    """Local write, remote read and remote write: what a one-sided READ/WRITE QP needs."""
    en = nic.verbs.enums
    return int(en.IBV_ACCESS_LOCAL_WRITE | en.IBV_ACCESS_REMOTE_READ
               | en.IBV_ACCESS_REMOTE_WRITE)


def new_qp(nic: NicContext, max_send_wr: int) -> tuple[Any, QpInfo]:
    """Create an RC QP on ``nic``, move it to INIT and describe it for the peer.

    Raises:
        the provider's PyverbsError on failure (the QP is destroyed first).
    """
    v = nic.verbs
    qp = nic.create_qp(max_send_wr)
    try:
        attr = v.QPAttr(port_num=nic.port.port)
        attr.pkey_index = 0
        attr.qp_access_flags = access_flags(nic)
        qp.to_init(attr)
    except BaseException:
        qp.close()
        raise
    port = nic.port
    info = QpInfo(port.device, port.port, port.lid, port.gid, int(qp.qp_num),
                  random.randrange(_MAX_U24), port.active_mtu)
    return qp, info


def connect_qp(nic: NicContext, qp: Any, mine: QpInfo, peer: QpInfo, options: RdmaOptions
               ) -> None:
    """Move ``qp`` to RTR then RTS towards ``peer``.

    InfiniBand peers are reached by LID (no GRH); RoCE peers by GID with a GRH from this
    port's GID index and ``options.hop_limit`` (255 by default, so routed RoCE v2 works).
    The path MTU is the smaller of both ports' active MTUs.

    Raises:
        TransportUnavailableError: the link layers differ.
        the provider's PyverbsError: a transition failed.
    """
    v = nic.verbs
    port = nic.port
    if port.is_ib != (not peer.gid):
        raise TransportUnavailableError(
            f"{port.name} is {port.link_layer} but the peer's {peer.device}:{peer.port} is "
            f"{'RoCE' if peer.gid else 'InfiniBand'}",
            "pin NICs of the same fabric on both ends (nics / --nic)")
    attr = v.QPAttr(port_num=port.port)
    attr.path_mtu = min(mine.mtu, peer.mtu)
    attr.dest_qp_num = peer.qpn
    attr.rq_psn = peer.psn
    attr.sq_psn = mine.psn
    attr.max_dest_rd_atomic = nic.max_dest_rd_atomic
    attr.max_rd_atomic = nic.max_rd_atomic
    attr.min_rnr_timer = 12
    attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    if port.is_ib:
        attr.ah_attr = v.AHAttr(dlid=peer.lid, port_num=port.port, is_global=0)
    else:
        gr = v.GlobalRoute(dgid=v.GID(gid_words(peer.gid)), sgid_index=port.gid_index or 0,
                           hop_limit=options.hop_limit, traffic_class=options.traffic_class)
        attr.ah_attr = v.AHAttr(port_num=port.port, is_global=1, gr=gr)
    qp.to_rtr(attr)
    qp.to_rts(attr)


def to_error(nic: NicContext, qp: Any) -> None:
    """Move ``qp`` to ERR: every WR still queued completes with ``IBV_WC_WR_FLUSH_ERR``."""
    v = nic.verbs
    attr = v.QPAttr(qp_state=v.enums.IBV_QPS_ERR)
    attr.qp_state = v.enums.IBV_QPS_ERR
    try:
        qp.modify(attr, v.enums.IBV_QP_STATE)
    except v.Error as exc:
        _log.warning("%s: cannot move QP %s to ERR: %s", nic.name, qp.qp_num, exc)


class Connection:
    """The initiator's end of one QP pair (local port → remote port of one target engine).

    Attributes:
        key: (target engine, remote port) it serves.
        nic: local port.
        remote: the remote port's name (``mlx5_1:1``).
        window: most WRs outstanding (the QP's ``max_send_wr``).
        outstanding: WRs posted and not completed yet.
        error: why the QP failed (``None`` while healthy); a failed QP takes no new WRs,
            is drained of its flushed completions, then destroyed.
        failed_at / last_progress: ``time.monotonic()`` of the failure and of the last
            completion (or of the first post after an idle spell).
    """

    def __init__(self, key: tuple[str, str], nic: NicContext, remote: str, qp: Any,
                 sock: socket.socket, window: int) -> None:
        self.key = key
        self.nic = nic
        self.remote = remote
        self.qp = qp
        self.sock = sock
        self.window = window
        self.outstanding = 0
        self.error: str | None = None
        self.failed_at = 0.0
        self.last_progress = time.monotonic()
        self.path = f"rdma:{nic.name}->{remote}"

    def fail(self, cause: str) -> None:
        """Mark failed and move the QP to ERR (its queued WRs flush). Idempotent."""
        if self.error is None:
            self.error = cause
            self.failed_at = time.monotonic()
            to_error(self.nic, self.qp)

    def destroy(self) -> None:
        """Destroy the QP and close the exchange connection (the target drops its QP)."""
        try:
            self.qp.close()
        except self.nic.verbs.Error as exc:
            _log.warning("%s: destroying QP: %s", self.path, exc)
        with contextlib.suppress(OSError):
            self.sock.close()


# ---------------------------------------------------------------------------- the exchange


def _send_frame(sock: socket.socket, body: dict[str, Any]) -> None:
    raw = json.dumps(body, sort_keys=True).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the QP exchange")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > _MAX_FRAME:
        raise ValueError(f"QP exchange frame of {size} bytes")
    body = json.loads(_recv_exact(sock, size))
    if not isinstance(body, dict):
        raise TypeError("QP exchange frame is not an object")
    return body


def request_qp(addresses: Sequence[str], *, token: str | None, initiator: str,
               target_nic: str, mine: QpInfo, timeout_s: float) -> tuple[QpInfo, socket.socket]:
    """Ask the target's exchange service at ``addresses`` (first reachable) for a QP on
    ``target_nic`` connected to ``mine``; returns its info and the connection that keeps it.

    Raises:
        TransportUnavailableError: no address answered, or the target refused (its cause).
        AuthError: the token was missing or refused.
    """
    errors: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        except (OSError, ValueError) as exc:
            errors.append(f"{address}: {exc}")
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, 1 + auth.NONCE_BYTES)
            if hello[0] & 1 and not token:
                raise AuthError(f"RDMA exchange at {address} requires a token",
                                "set KVCTL_TOKEN (or common.token) to the cluster's token")
            if token and not hello[0] & 1:
                # As on the TCP path: a service that asks for no token proves nothing (an
                # impostor, or a relay that cleared the flag), and its QP info would be
                # taken as the target's.
                raise AuthError(f"RDMA exchange at {address} asks for no token, but this "
                                "side has one", "set the same KVCTL_TOKEN (or common.token) "
                                "on both hosts, or unset it here")
            digest = (auth.respond(token, hello[1:], _CONTEXT) if token and hello[0] & 1
                      else bytes(auth.DIGEST_BYTES))
            sock.sendall(digest)
            if _recv_exact(sock, 1) != b"\0":
                raise AuthError(f"RDMA exchange at {address} refused our token",
                                "use the same KVCTL_TOKEN as the target")
            _send_frame(sock, {"v": 1, "initiator": initiator, "target_nic": target_nic,
                               "qp": dataclasses.asdict(mine)})
            reply = _recv_frame(sock)
        except AuthError:
            sock.close()
            raise
        except (OSError, ConnectionError, ValueError, TypeError) as exc:
            sock.close()
            errors.append(f"{address}: {exc}")
            continue
        if "error" in reply:
            sock.close()
            raise TransportUnavailableError(
                f"RDMA target at {address} refused a QP on {target_nic}: {reply['error']}",
                "see the target's log; check that both ends' NICs are on one fabric")
        sock.settimeout(None)
        return QpInfo.from_json(reply.get("qp", {}), source=address), sock
    raise TransportUnavailableError(
        f"no RDMA exchange service answered ({'; '.join(errors) or 'no address published'})",
        "check that the target engine runs with RDMA and that its port is reachable")


class ExchangeServer:
    """The target side: creates and connects a QP for each initiator's request.

    Args:
        nics: the target's open ports by name.
        options: transport options (hop limit, traffic class).
        token: shared secret (``None``: open).
        host: address to bind (the engine's listen host); port 0.
        advertise: addresses to publish (see :func:`kvctl.net.advertise.advertised_addresses`).
        window: ``max_send_wr`` of the target's QPs (they post nothing; 1 is enough).
    """

    def __init__(self, nics: dict[str, NicContext], options: RdmaOptions, *,
                 token: str | None, host: str, advertise: Sequence[str] = (),
                 error: type[Exception] = Exception) -> None:
        self._nics = nics
        self._options = options
        self._token = token
        self._error = error
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self.addresses = tuple(advertised_addresses(host, self.port, advertise))
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._bound: dict[socket.socket, tuple[Any, NicContext]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.served = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="kvctl-rdma-exchange",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(0.2)
            except (OSError, ValueError):
                return
            for key, _ in events:
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif isinstance(sock, socket.socket):
                    self._drop(sock)  # a bound connection became readable: EOF or junk

    def _accept(self) -> None:
        try:
            conn, peer = self._listener.accept()
        except OSError:
            return
        try:
            self._handle(conn, f"{peer[0]}:{peer[1]}")
        except (KvctlError, OSError, ConnectionError, ValueError, TypeError, self._error) as exc:
            # Nothing a peer sends or a device answers stops this service (issue: a
            # PyverbsRDMAError from to_rtr/to_rts used to kill the accept thread).
            self.refused += 1
            cause = getattr(exc, "cause", None) or str(exc).strip()
            _log.warning("RDMA exchange with %s failed: %s", peer[0], cause)
            with contextlib.suppress(OSError):
                _send_frame(conn, {"error": cause})
            conn.close()

    def _handle(self, conn: socket.socket, peer: str) -> None:
        conn.setblocking(True)
        conn.settimeout(_HANDSHAKE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = auth.new_nonce()
        conn.sendall(bytes([1 if self._token else 0]) + nonce)
        answer = _recv_exact(conn, auth.DIGEST_BYTES)
        if self._token and not auth.check_response(self._token, nonce, _CONTEXT, answer):
            conn.sendall(b"\1")
            conn.close()
            self.refused += 1
            _log.warning("RDMA exchange from %s refused: bad or missing token", peer)
            return
        conn.sendall(b"\0")
        body = _recv_frame(conn)
        nic_name = str(body.get("target_nic", ""))
        nic = self._nics.get(nic_name)
        if nic is None:
            raise TransportUnavailableError(
                f"no usable port {nic_name!r} here (have {', '.join(self._nics) or 'none'})",
                "refresh the segment descriptor")
        peer_info = QpInfo.from_json(body.get("qp", {}), source=f"exchange from {peer}")
        qp, mine = new_qp(nic, 1)
        try:
            connect_qp(nic, qp, mine, peer_info, self._options)
            _send_frame(conn, {"qp": dataclasses.asdict(mine)})
        except BaseException:
            qp.close()
            raise
        conn.settimeout(None)
        with self._lock:
            if self._closed:
                qp.close()
                conn.close()
                return
            self._bound[conn] = (qp, nic)
            self._selector.register(conn, selectors.EVENT_READ, None)
        self.served += 1
        _log.info("RDMA QP %s on %s connected for %s (%s)", mine.qpn, nic.name,
                  body.get("initiator", "?"), peer)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            entry = self._bound.pop(conn, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn)
        conn.close()
        if entry is not None:
            qp, nic = entry
            try:
                qp.close()
            except self._error as exc:
                _log.warning("%s: destroying a served QP: %s", nic.name, exc)

    @property
    def connections(self) -> int:
        """QPs currently served (one per initiator connection)."""
        return len(self._bound)

    def close(self) -> None:
        """Stop serving and destroy every served QP. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._thread.join(5.0)
        for conn in list(self._bound):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
