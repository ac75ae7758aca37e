"""The master's listener: one thread per connection over blocking TCP sockets.

A thread per connection keeps a request's path short (one ``recv``, the core call under
its lock, one ``sendmsg``): lower latency than an event loop for the few dozen long-lived
connections a store has (clients pool theirs, nodes hold one each). A connection that sends
a bad frame gets an error reply; an oversized or garbled frame also ends that connection;
every other connection keeps being served.

When a storage node runs in the same process (``kvctl store serve``), a get may be answered
with the object bytes behind the reply (:meth:`MasterServer.serve_local`).

With tenants (:mod:`kvctl.store.tenants`) each connection carries the namespace its login
proved; every key it names is checked against it, and a key outside gets a ``forbidden``
reply (requests without a reply, commits and releases, drop such keys and log it).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvctl.net import auth
from kvctl.net.bind import address_family, announce_bind, is_unspecified
from kvctl.net.framing import (
    ConnectionClosedError,
    FrameError,
    FrameReader,
    send_views,
    set_send_timeout,
)
from kvctl.net.limits import PendingLimit, accept
from kvctl.store import protocol as p
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.master import MasterCore
from kvctl.store.metrics import count_request
from kvctl.store.tenants import Tenant, check_admin_token, identify, outside

if TYPE_CHECKING:
    from kvctl.metrics import ServerMetrics

_log = logging.getLogger("kvctl.store.server")

#: Seconds between housekeeping passes (node liveness, expired puts, deferred frees), and
#: the most one pass spends on background jobs before judging liveness again.
TICK_S = 0.1
#: Seconds a connection may take to log in (or, without a token, to send a request).
LOGIN_TIMEOUT_S = 10.0
#: Seconds a send to a client may make no progress before its connection is closed. Longer
#: than a client's worst early read against a stalled node (two data-path timeouts of
#: 30 s by default), during which it does not read its reply yet.
SEND_TIMEOUT_S = 120.0
#: Default most object bytes behind one get reply when a node is hosted in-process.
DEFAULT_ATTACHED_BYTES = 4 << 20

#: Lends a view of a range of in-process node memory: (segment, offset, size) →
#: (view, release) or ``None``.
HoldLocal = Callable[[str, int, int], "tuple[memoryview, Callable[[], None]] | None"]


class MasterServer:
    """Serve a :class:`MasterCore` on ``host:port`` (port 0 picks a free one).

    Args:
        core: the master state machine.
        host: bind address (loopback unless told otherwise).
        port: TCP port, 0 for any.
        token: shared secret clients and nodes must prove (challenge-response), or ``None``.
        max_frame_bytes: largest request accepted, bytes.
        max_connections: connections served at once; more are refused with an error reply.
        metrics: where to count requests and their latency (``--metrics-port``), or ``None``.
        tenants: tenants whose tokens confine a connection to their namespace (needs
            ``token``, which stays the administrators' and nodes').

    Raises:
        ConfigError: tenants without a shared token, or sharing it.
        StoreUnavailableError: the address cannot be bound.
    """

    def __init__(self, core: MasterCore, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
                 max_connections: int = 512, metrics: ServerMetrics | None = None,
                 tenants: tuple[Tenant, ...] = ()) -> None:
        check_admin_token(tenants, token)
        self._leadership: Callable[[], str | None] | None = None
        self.core = core
        self.tenants = tenants
        self.metrics = metrics
        #: Port of the metrics endpoint once :meth:`ServerMetrics.serve` ran, else ``None``.
        self.metrics_port: int | None = None
        self._token = token
        self._max_frame = max_frame_bytes
        self._max_conns = max_connections
        #: connections not logged in (or, without a token, with no request yet): few, short
        self._pending = PendingLimit(max(1, min(64, max_connections // 4)), "store master",
                                     deadline_s=LOGIN_TIMEOUT_S)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hold: HoldLocal | None = None
        #: seconds a reply's send may stall (the client reads nothing) before the
        #: connection is closed.
        self.send_timeout_s = SEND_TIMEOUT_S
        #: the most object bytes sent behind one get reply (0 until :meth:`serve_local`).
        self.attached_bytes = 0
        try:
            self._sock = socket.create_server((host, port), backlog=128, reuse_port=False,
                                              family=address_family(host),
                                              dualstack_ipv6=is_unspecified(host) and
                                              ":" in host)
        except OSError as exc:
            raise StoreUnavailableError(
                f"store master cannot listen on {host}:{port}: {exc.strerror or exc}",
                "pick another --listen port or stop what holds it") from exc
        self.host, self.port = self._sock.getsockname()[:2]
        announce_bind("store master", self.host, self.port)
        self._threads = [threading.Thread(target=self._accept_loop, name="kvctl-master-accept",
                                          daemon=True),
                         threading.Thread(target=self._tick_loop, name="kvctl-master-tick",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def address(self) -> str:
        """``host:port`` clients and nodes connect to."""
        return f"{self.host}:{self.port}"

    def lead_while(self, check: Callable[[], str | None]) -> None:
        """Serve requests only while ``check()`` is ``None``; past that (an elected master
        that was deposed, see :meth:`~kvctl.store.master.election.Election.check`) each
        request is refused with ``not_leader`` and its connection closed, so the client
        moves on to the new leader. The shared tier's file deletes stop too."""
        self._leadership = check
        self.core.fence_files(check)

    def serve_local(self, hold: HoldLocal, attached_bytes: int = DEFAULT_ATTACHED_BYTES) -> None:
        """Answer gets with the bytes of objects in memory of this process (a storage node
        hosted here, as in ``kvctl store serve``), right behind the reply: such a get costs
        the client one round trip instead of a master round trip plus a node read.

        The core still never reads object bytes: ``hold`` (the node's) lends a view of its
        registered memory, bounds-checked, and the segment stays registered until the
        bytes are sent. The client verifies them against the checksum in the reply.
        Connections opened from now on are told (:attr:`protocol.Hello.attached_bytes`).

        Args:
            hold: (segment, offset, size) → (view, release), or ``None`` when that range is
                not in memory here.
            attached_bytes: the most object bytes behind one reply.
        """
        self._hold = hold
        self.attached_bytes = max(0, attached_bytes)

    def _tick_loop(self) -> None:
        more = False
        while not self._stop.is_set():
            if not more:  # background work (a node drop, an eviction) wakes it early
                self.core.wait_for_work(TICK_S)
            if self._stop.is_set():
                return
            try:
                more = self.core.tick(budget_s=TICK_S)
            except Exception:  # noqa: BLE001 - housekeeping must outlive a bug; logged
                _log.exception("master housekeeping failed")
                more = False

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            accepted = accept(self._sock, "store master", closed=self._stop)
            if accepted is None:
                return
            conn, peer = accepted
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A client that stops reading must not hold this thread (and, while attached
            # bytes are being sent, its node's memory) forever: the send fails and the
            # connection closes.
            set_send_timeout(conn, self.send_timeout_s)
            with self._lock:
                full = len(self._conns) >= self._max_conns
                if not full:
                    self._conns.add(conn)
                    self._pending.admit(conn, str(peer[0]))
            if full:
                codec = p.Codec(max_frame_bytes=self._max_frame)
                with contextlib.suppress(OSError):
                    codec.send(conn, p.Fail(error=p.ErrorInfo(
                        code="unavailable", cause="master has too many connections",
                        hint="close idle clients or raise the limit")))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvctl-master-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        codec = p.Codec(max_frame_bytes=self._max_frame)
        reader = FrameReader(conn, codec.frames)
        try:
            namespace = self._handshake(conn, codec, reader)
            if namespace is not None and self._token is not None:
                self._pending.trusted(conn)  # logged in; without a token: its first request
            if namespace is not None:
                self._loop(conn, codec, reader, namespace)
        except (OSError, ConnectionClosedError):
            pass
        except FrameError as exc:  # a garbled or oversized login frame: drop this client
            _log.warning("store master: closing a connection: %s", exc.cause)
        finally:
            self._pending.trusted(conn)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, codec: p.Codec, reader: FrameReader
                   ) -> str | None:
        """Greet and authenticate; the connection's namespace (``""``: everything), or
        ``None`` when the login failed."""
        nonce = auth.new_nonce() if self._token else b""
        hello = msgspec.msgpack.encode(p.Hello(
            version=p.PROTOCOL_VERSION, auth=self._token is not None, nonce=nonce,
            max_frame_bytes=self._max_frame, instance=self.core.instance,
            attached_bytes=self.attached_bytes if self._hold else 0, shared_reports=True,
            login_binding=p.LOGIN_BINDING))
        codec.frames.send(conn, p.PROTOCOL_VERSION, hello)  # as sent: the transcript's
        if self._token is None:
            return ""
        frame = reader.recv()
        try:
            msg = codec.decode_request(frame.payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            msg = None
        found = None
        if isinstance(msg, p.Login):
            found = identify(self._token, self.tenants, nonce, p.AUTH_CONTEXT, msg.answer)
        if found is not None and isinstance(msg, p.Login) and \
                len(msg.client_nonce) == auth.NONCE_BYTES:
            # A login without the client's challenge is refused: the session's MACs are
            # keyed by both nonces, and a relay that stripped it would get a session
            # without them.
            # The proof and the session key cover the greeting, the login and the reply
            # as this side sent and got them (issue 27.5: a relay rewrote the reply's
            # namespace, "" to a tenant's, and an admin's puts landed in that tenant).
            namespace, proved = found
            reply = p.Ok(namespace=namespace)
            bound = p.login_transcript(hello, frame.payload, reply)
            proof = auth.server_proof(proved, nonce, msg.client_nonce, p.AUTH_CONTEXT, bound)
            codec.send(conn, msgspec.structs.replace(reply, proof=proof))
            codec.mac = auth.FrameMac(auth.session_key(proved, nonce, msg.client_nonce,
                                                       p.AUTH_CONTEXT, bound), client=False)
            return namespace
        codec.send(conn, p.Fail(error=p.ErrorInfo(
            code="unauthorized", cause="store master refused the token",
            hint="set the same token (KVCTL_TOKEN or --token) on clients, nodes and master")))
        return None

    def _loop(self, conn: socket.socket, codec: p.Codec, reader: FrameReader, namespace: str
              ) -> None:
        while True:
            try:
                frame = reader.recv()
            except ConnectionClosedError:
                return
            except FrameError as exc:
                codec.send(conn, p.Fail(error=p.ErrorInfo(
                    code="too_large" if "limit" in exc.cause else "bad_request",
                    cause=exc.cause, hint=exc.hint or "")))
                return
            if frame.kind != p.PROTOCOL_VERSION:
                codec.send(conn, p.Fail(error=p.ErrorInfo(
                    code="version", cause=f"protocol version {frame.kind} is not supported "
                    f"(this master speaks {p.PROTOCOL_VERSION})",
                    hint="use a kvctl of the same version as the master")))
                continue
            try:
                msg = codec.decode_request(frame.payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                codec.send(conn, p.Fail(error=p.ErrorInfo(
                    code="bad_request", cause=f"malformed request: {exc}",
                    hint="the client and master disagree on the protocol")))
                continue
            self._pending.trusted(conn)
            if self._leadership is not None and self._refused(conn, codec, msg):
                return
            started = time.perf_counter()
            try:
                reply = self._durable(msg, self._scoped(msg, namespace))
            except Exception:  # noqa: BLE001 - a bug in one request must not stop the master
                _log.exception("master failed on %s", type(msg).__name__)
                reply = p.Fail(error=p.ErrorInfo(code="internal", cause=f"master failed on "
                                                 f"{type(msg).__name__}",
                                                 hint="see the master's log"))
                if isinstance(msg, p.Release | p.SharedBad) or (
                        isinstance(msg, p.Commit | p.PutAt) and not msg.ack):
                    reply = None  # these never get a reply: one now would shift every later one
            if self.metrics is not None:
                count_request(self.metrics, msg, reply, time.perf_counter() - started)
            # Tenants get no attached bytes: their tokens do not open the nodes' data path
            # either, and the lease protecting a range while it is sent is theirs to end.
            if isinstance(reply, p.GetReply) and isinstance(msg, p.Get) and \
                    msg.attached_bytes and not namespace:
                self._send_attached(conn, codec, reply, msg.attached_bytes)
            elif reply is not None:
                codec.send(conn, reply)

    def _refused(self, conn: socket.socket, codec: p.Codec, msg: p.Request) -> bool:
        """Whether this master was deposed (the caller then closes the connection, so
        the client goes to the new leader); a request that expects a reply is told
        ``not_leader`` first."""
        assert self._leadership is not None
        why = self._leadership()
        if why is None:
            return False
        if not (isinstance(msg, p.Release | p.SharedBad) or (
                isinstance(msg, p.Commit | p.PutAt) and not msg.ack)):
            codec.send(conn, p.Fail(error=p.ErrorInfo(
                code="not_leader", cause=f"this store master no longer leads: {why}",
                hint="the client moves to the new leader when given every master "
                "(--master A:PORT,B:PORT)")))
        return True

    def _durable(self, msg: p.Request, reply: p.Reply | None) -> p.Reply | None:
        """``reply`` once the changes ``msg`` made are durable (waiting without the core's
        lock), or a failure saying why they are not. Commits and reports that asked for it
        (``ack``) get :class:`~kvctl.store.protocol.Ok` then."""
        if not isinstance(msg, _WRITES):
            return reply
        problem = self.core.state.ack()
        wants_ack = isinstance(msg, p.Commit | p.PutAt) and msg.ack
        if problem is None:
            return (reply or p.Ok()) if wants_ack else reply
        if wants_ack or reply is not None:
            return p.Fail(error=p.ErrorInfo(
                code="unavailable", cause=problem,
                hint="the master keeps the change and writes it when its state can take "
                "it; put again to be sure (a put of the same bytes waits for that write)"))
        _log.warning("%s not acknowledged durably: %s", type(msg).__name__, problem)
        return None

    def _send_attached(self, conn: socket.socket, codec: p.Codec, reply: p.GetReply,
                     wanted: int) -> None:
        """Send ``reply`` with the bytes of the objects that have a replica in memory here
        behind it (smallest limit of the client's and ours; see :meth:`serve_local`)."""
        hold = self._hold
        budget = min(wanted, self.attached_bytes)
        held: list[tuple[memoryview, Callable[[], None]]] = []
        attached: list[int] = []
        sources: list[int] = []
        try:
            if hold is not None:
                for i, slot in enumerate(reply.slots):
                    if not isinstance(slot, p.GetSlot) or slot.pending or \
                            not 0 < slot.size <= budget:
                        continue
                    for j, loc in enumerate(slot.locations):
                        got = hold(loc.segment, loc.offset, slot.size)
                        if got is not None:
                            held.append(got)
                            attached.append(i)
                            sources.append(j)
                            budget -= slot.size
                            break
            if attached:
                reply = msgspec.structs.replace(reply, attached=attached,
                                                attached_from=sources)
            send_views(conn, [codec.encode(reply), *(view for view, _ in held)])
        finally:
            for _, release in held:
                release()

    def _scoped(self, msg: p.Request, namespace: str) -> p.Reply | None:
        """Dispatch ``msg`` if every key it names is inside ``namespace``."""
        if not namespace:
            return self._dispatch(msg)
        if isinstance(msg, p.RegisterNode | p.Heartbeat | p.DropNode):
            return _forbidden(f"tenant {namespace[:-1]!r} cannot act as a storage node "
                              "or remove one")
        if isinstance(msg, p.SharedBad):  # no reply: keys outside are left out
            pairs = [(k, v) for k, v in zip(msg.keys, msg.versions, strict=False)
                     if k.startswith(namespace)]
            return self._dispatch(p.SharedBad([k for k, _ in pairs], [v for _, v in pairs]))
        if isinstance(msg, p.Commit | p.Release | p.PutAt):
            inside = [i for i, k in enumerate(msg.keys) if k.startswith(namespace)]
            if len(inside) == len(msg.keys):
                return self._dispatch(msg, namespace)
            _log.warning("tenant %r sent %s for keys outside its namespace; ignored",
                         namespace[:-1], type(msg).__name__.lower())
            fields = ("versions",) if not isinstance(msg, p.PutAt) else (
                "sizes", "checksums", "offsets")
            reply = self._dispatch(msgspec.structs.replace(msg, keys=[
                msg.keys[i] for i in inside], **{
                f: [getattr(msg, f)[i] for i in inside if i < len(getattr(msg, f))]
                for f in fields}), namespace)
            if isinstance(msg, p.Release) or not msg.ack or isinstance(reply, p.Fail):
                return reply
            # The answer names keys by their index in the request the client sent.
            outside_keys = _forbidden(f"key outside tenant {namespace[:-1]!r}'s namespace "
                                      f"{namespace!r}").error
            refused = [(inside[i], e) for i, e in zip(reply.refused, reply.errors,
                                                      strict=False)] \
                if isinstance(reply, p.Acked) else []
            inside_set = set(inside)
            refused += [(i, outside_keys) for i in range(len(msg.keys)) if i not in inside_set]
            return _acked(sorted(refused, key=lambda r: r[0]))
        keys: list[str] = []
        if isinstance(msg, p.Get):
            keys = [*msg.keys, *msg.release_keys]
        elif isinstance(msg, p.Put):
            keys = [item.key for item in msg.items]
        elif isinstance(msg, p.Exists | p.Remove):
            keys = msg.keys
        elif isinstance(msg, p.ListKeys):
            keys = [msg.prefix]
        elif isinstance(msg, p.Stat | p.Pin):
            keys = [msg.key]
        bad = outside(namespace, keys)
        if bad is not None:
            return _forbidden(f"key {bad!r} is outside tenant {namespace[:-1]!r}'s namespace "
                              f"{namespace!r}")
        return self._dispatch(msg, namespace)

    def _dispatch(self, msg: p.Request, namespace: str = "") -> p.Reply | None:
        core = self.core
        if isinstance(msg, p.Get):
            if len(msg.keys) > p.MAX_BATCH:
                return _too_many(len(msg.keys))
            answer = core.get(msg)
            # Long keys (or many replicas, long shared-tier paths) can make the answer to
            # a batch within MAX_BATCH larger than a frame: what does not fit is left out
            # (reply_full) for the client to ask again, and its leases end here.
            reply, left = p.fit_get_reply(answer,
                                          min(self._max_frame, p.DEFAULT_MAX_FRAME_BYTES))
            taken = [s for s in (answer.slots[i] for i in left)
                     if isinstance(s, p.GetSlot) and not s.pending] if msg.lease else []
            if taken:
                core.release(p.Release(keys=[s.key for s in taken],
                                       versions=[s.version for s in taken]))
            return reply
        if isinstance(msg, p.Put):
            if len(msg.items) > p.MAX_BATCH:
                return _too_many(len(msg.items))
            return p.PutReply(slots=core.put(msg))
        if isinstance(msg, p.Commit):
            refused = core.commit(msg)
            if not msg.ack:
                _ignored(refused)
                return None
            return _acked(refused)
        if isinstance(msg, p.Release):
            core.release(msg)
            return None
        if isinstance(msg, p.SharedBad):
            core.report_shared(msg.keys, msg.versions)
            return None
        if isinstance(msg, p.PutAt):
            if len(msg.keys) > p.MAX_BATCH:
                _log.warning("put_at of %d keys (limit %d) dropped", len(msg.keys), p.MAX_BATCH)
                return _too_many(len(msg.keys)) if msg.ack else None
            refused = core.put_at(msg, namespace)
            return _acked(refused) if msg.ack else None
        if isinstance(msg, p.Reserve):
            slot = core.reserve(msg, namespace)
            return p.Fail(error=slot) if isinstance(slot, p.ErrorInfo) else slot
        if isinstance(msg, p.Exists):
            return p.Bools(values=core.exists(msg.keys))
        if isinstance(msg, p.Remove):
            return p.Bools(values=core.remove(msg.keys))
        if isinstance(msg, p.ListKeys):
            objects, truncated = core.list_objects(msg.prefix, max(0, msg.limit))
            return p.fit_key_list(objects, truncated,
                                  min(self._max_frame, p.DEFAULT_MAX_FRAME_BYTES))
        if isinstance(msg, p.Stat):
            info = core.stat(msg.key)
            return p.Fail(error=info) if isinstance(info, p.ErrorInfo) else p.StatReply(info=info)
        if isinstance(msg, p.Pin):
            err = core.pin(msg.key, msg.pinned)
            return p.Ok() if err is None else p.Fail(error=err)
        if isinstance(msg, p.Status):
            return p.StatusReply(status=core.status())
        if isinstance(msg, p.Nodes):
            return p.NodesReply(nodes=core.nodes())
        if isinstance(msg, p.RegisterNode):
            err = core.register_node(msg)
            return p.Ok() if err is None else p.Fail(error=err)
        if isinstance(msg, p.Heartbeat):
            tasks = core.heartbeat(msg)
            return p.Fail(error=tasks) if isinstance(tasks, p.ErrorInfo) else p.Tasks(tasks=tasks)
        if isinstance(msg, p.DropNode):
            err = core.drop_node(msg.node_id)
            return p.Ok() if err is None else p.Fail(error=err)
        return p.Fail(error=p.ErrorInfo(code="bad_request",
                                        cause=f"unexpected {type(msg).__name__} request"))

    def close(self) -> None:
        """Stop accepting, drop every connection, close the state. Safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.core.wake()  # the housekeeping thread waits for work: let it see the stop
        self._pending.close()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=2)
        if self.metrics is not None:
            self.metrics.close()
        self.core.close()

    def __enter__(self) -> MasterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Requests whose reply (or, for commits and reports, the next request on the connection)
#: waits until their changes are durable.
_WRITES = (p.Put, p.Commit, p.PutAt, p.Remove, p.Pin, p.RegisterNode, p.DropNode)


def _forbidden(cause: str) -> p.Fail:
    return p.Fail(error=p.ErrorInfo(code="forbidden", cause=cause,
                                    hint="a tenant's token reaches only keys under its own "
                                    "'<tenant>/' prefix; use the shared token to administer"))


def _too_many(n: int) -> p.Fail:
    return p.Fail(error=p.ErrorInfo(code="too_large", cause=f"batch of {n} keys is too large",
                                    hint=f"send at most {p.MAX_BATCH} keys per request"))


def _acked(refused: list[tuple[int, p.ErrorInfo]]) -> p.Acked | None:
    """The answer naming the keys of a commit or report the master did not take (``None``
    when it took them all: the answer is :class:`~kvctl.store.protocol.Ok` once durable)."""
    if not refused:
        return None
    return p.Acked(refused=[i for i, _ in refused], errors=[e for _, e in refused])


def _ignored(refused: list[tuple[int, p.ErrorInfo]]) -> None:
    """A commit without ``ack`` gets no answer: log what it did not commit."""
    if refused:
        _log.warning("commit of %d put(s) not taken (first: %s); the client asked for no "
                     "answer", len(refused), refused[0][1].cause)
