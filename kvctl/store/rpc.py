"""Client side of the master protocol: one connection, and a small pool of them.

A client or node may be given several masters (``A:PORT,B:PORT``: the leader and the
standbys of an elected master on etcd, :mod:`kvctl.store.master.election`). A new
connection tries them in turn, the one that answered last first; a standby refuses
connections and a deposed leader answers ``not_leader`` and closes, so the first one that
greets is the leader. While none does (a takeover), the set is tried again for up to
:data:`FAILOVER_S`.
"""

from __future__ import annotations

import contextlib
import hmac
import select
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterator, Sequence

import msgspec

from kvctl.errors import KvctlError
from kvctl.net import auth
from kvctl.net.bind import parse_listen
from kvctl.net.framing import ConnectionClosedError, FrameError, FrameReader, set_io_timeouts
from kvctl.store import protocol as p
from kvctl.store.errors import (
    BadRequestError,
    ObjectNotFoundError,
    ProtocolError,
    StoreAuthError,
    StoreBusyError,
    StoreError,
    StoreForbiddenError,
    StoreFullError,
    StoreUnavailableError,
)


def error_from(info: p.ErrorInfo, *, key: str | None = None) -> KvctlError:
    """The typed exception for an error the master replied with."""
    if info.code in ("not_found", "evicted"):
        if key is not None:
            return ObjectNotFoundError(key, evicted=info.code == "evicted",
                                       why=info.cause if info.code == "evicted" else "")
        return ObjectNotFoundError(info.cause)
    hint = info.hint or None
    if info.code == "full":
        return StoreFullError(info.cause, hint)
    if info.code == "unauthorized":
        return StoreAuthError(info.cause, hint)
    if info.code == "forbidden":
        return StoreForbiddenError(info.cause, hint)
    if info.code == "busy":
        return StoreBusyError(info.cause, hint)
    if info.code in ("unavailable", "not_leader"):
        return StoreUnavailableError(info.cause, hint)
    if info.code == "bad_request":
        return BadRequestError(info.cause, hint)
    if info.code in ("too_large", "version"):
        return ProtocolError(info.cause, hint)
    return StoreError(info.cause, hint or "see the master's log")


#: How long a kvctl store master may take to greet before the peer is probed as a foreign
#: server, seconds (a master greets as it accepts; mooncake_master never speaks first).
GREETING_WAIT_S = 1.0
#: How long a foreign server may take to answer the probe, seconds.
PROBE_WAIT_S = 1.0
#: How long, in all, a silent server is waited for before it is called stalled, seconds.
STALLED_WAIT_S = 8.0
#: How long a client or node given several masters keeps trying them while none answers
#: (a takeover: the old leader's lease, 5 s by default, then the new one's load), seconds.
FAILOVER_S = 20.0
#: How long one of several masters may take to connect and greet before the next one is
#: tried, seconds (a SIGSTOPped leader accepts connections and says nothing).
MULTI_GREETING_S = 2.0


def master_addresses(spec: str) -> list[str]:
    """The masters of ``A:PORT[,B:PORT...]``, in order.

    Raises:
        BadRequestError: no address at all.
    """
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise BadRequestError(f"store master address {spec!r} is empty",
                              "write HOST:PORT, or several as A:PORT,B:PORT")
    return addresses


def _connect(address: str, host: str, port: int, timeout_s: float) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=min(timeout_s, 5.0))
    except OSError as exc:
        raise StoreUnavailableError(
            f"cannot reach the store master at {address}: {exc.strerror or exc}",
            "start one with 'kvctl store serve' or pass --master HOST:PORT (a standby "
            "master refuses connections until it leads: give every master, A:PORT,B:PORT)"
            ) from exc


def _await_greeting(sock: socket.socket, address: str, timeout_s: float) -> bool:
    """Wait up to :data:`GREETING_WAIT_S` (at most ``timeout_s``) for the master's first
    bytes; ``True`` when they came (or the peer closed: the caller reports that), ``False``
    when a kvctl greeting came only after the probe below was sent (reconnect).

    A server that stays silent is probed with a coro_rpc request for an unregistered
    function: ``mooncake_master``, which shares kvctl's default port 50051, answers it at
    once, so the mismatch is named in about a second instead of a 30 s read timeout.

    Raises:
        ProtocolError: the peer speaks mooncake_master's RPC, or nothing kvctl knows.
    """
    from kvctl.store.mooncake import CORO_RPC_PROBE, looks_like_coro_rpc

    greeting_s, probe_s = min(GREETING_WAIT_S, timeout_s), min(PROBE_WAIT_S, timeout_s)
    if _readable(sock, greeting_s):
        return True
    stalled_s = max(0.0, min(STALLED_WAIT_S, timeout_s) - greeting_s - probe_s)
    try:
        sock.sendall(CORO_RPC_PROBE)
        answer = (sock.recv(64, socket.MSG_PEEK)
                  if _readable(sock, probe_s) or _readable(sock, stalled_s) else None)
    except OSError:
        answer = b""
    if answer and answer[:4] == p.MAGIC[:len(answer[:4])]:
        return False  # a greeting (its first bytes at least): a slow kvctl master
    if answer is not None and looks_like_coro_rpc(answer):
        raise ProtocolError(
            f"{address} speaks another protocol (looks like mooncake_master's RPC); "
            "for Mooncake use --backend mooncake",
            "or pass --master HOST:PORT of a kvctl store master (kvctl store serve/master)")
    if answer is None:  # accepted, then silence: a stopped or swamped process
        waited = greeting_s + probe_s + stalled_s
        raise StoreUnavailableError(
            f"store master at {address} accepted the connection but said nothing for "
            f"{waited:g} s: it is stalled (stopped, overloaded) or not a kvctl store master",
            "check the process listening there (a SIGSTOPped master answers once resumed); "
            "for Mooncake use --backend mooncake")
    what = "closed the connection" if not answer else f"answered {answer[:8]!r}"
    raise ProtocolError(f"{address} is not a kvctl store master (it {what})",
                        "pass --master HOST:PORT of a kvctl store master "
                        "(kvctl store serve/master)")


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    readable, _, _ = select.select([sock], [], [], timeout_s)
    return bool(readable)


class MasterConnection:
    """One authenticated connection to the master (not thread-safe; see :class:`MasterPool`).

    Attributes:
        namespace: key prefix the master confines this connection to (a tenant's
            ``"<name>/"``), or ``""`` for the shared token / no token.

    Args:
        greeting_s: how long connecting and the greeting may take (default: up to
            ``timeout_s``, see :func:`_await_greeting`); short when other masters can be
            tried instead.

    Raises:
        StoreUnavailableError: the master cannot be reached.
        StoreAuthError: the master refused the token.
    """

    def __init__(self, address: str, *, token: str | None = None, timeout_s: float = 30.0,
                 spin_s: float = 0.0, greeting_s: float | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        host, port = parse_listen(address)
        if port == 0:
            raise BadRequestError(f"store master address {address!r} has no port",
                                  "write HOST:PORT, e.g. 127.0.0.1:50051")
        hello_s = timeout_s if greeting_s is None else min(greeting_s, timeout_s)
        self._sock = _connect(address, host, port, hello_s)
        try:
            if not _await_greeting(self._sock, address, hello_s):
                # A kvctl master greeted only after the probe was sent (it will take the
                # probe for a bad frame): once more, waiting for the greeting as long as
                # for any reply.
                self._sock.close()
                self._sock = _connect(address, host, port, hello_s)
        except BaseException:
            self._sock.close()
            raise
        set_io_timeouts(self._sock, timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._codec = p.Codec()
        self._reader = FrameReader(self._sock, self._codec.frames, spin_s=spin_s)
        self.namespace = ""
        #: the master run this connection talks to (see :attr:`protocol.Hello.instance`).
        self.instance = ""
        #: the largest message the master takes (from its greeting).
        self.max_frame_bytes = p.DEFAULT_MAX_FRAME_BYTES
        #: the most object bytes the master sends behind a get reply (0: never).
        self.attached_bytes = 0
        #: the master takes reports of bad shared-tier files (:class:`protocol.SharedBad`).
        self.shared_reports = False
        try:
            hello_payload, hello = self._recv_raw()
            if not isinstance(hello, p.Hello):
                raise ProtocolError(f"store master at {address} did not greet",
                                    "check that the address is a kvctl store master")
            self.instance = hello.instance
            self.max_frame_bytes = hello.max_frame_bytes
            self.attached_bytes = max(0, hello.attached_bytes)
            self.shared_reports = hello.shared_reports
            if hello.version != p.PROTOCOL_VERSION:
                raise ProtocolError(
                    f"store master at {address} speaks protocol {hello.version}, "
                    f"this client {p.PROTOCOL_VERSION}", "use the same kvctl version")
            if hello.auth:
                if not token:
                    raise StoreAuthError(f"store master at {address} requires a token",
                                         "set KVCTL_TOKEN (or --token) to the master's token")
                if hello.login_binding != p.LOGIN_BINDING:
                    # Refused, never downgraded: a master whose login reply is not
                    # authenticated lets a relay choose this connection's namespace.
                    raise StoreAuthError(
                        f"store master at {address} does not authenticate its login reply "
                        f"(login binding {hello.login_binding}, this client needs "
                        f"{p.LOGIN_BINDING})", "upgrade the master to this kvctl version "
                        "(or something between the hosts rewrote its greeting)")
                challenge = auth.new_nonce()
                login = msgspec.msgpack.encode(p.Login(
                    answer=auth.respond(token, hello.nonce, p.AUTH_CONTEXT),
                    client_nonce=challenge))
                self._codec.frames.send(self._sock, p.PROTOCOL_VERSION, login)
                reply = self._recv()
                if isinstance(reply, p.Fail):
                    raise error_from(reply.error)
                bound = (p.login_transcript(hello_payload, login, reply)
                         if isinstance(reply, p.Ok) else b"")
                expected = auth.server_proof(token, hello.nonce, challenge, p.AUTH_CONTEXT,
                                             bound)
                if not isinstance(reply, p.Ok) or not hmac.compare_digest(reply.proof,
                                                                          expected):
                    raise StoreAuthError(
                        f"store master at {address} did not prove that it knows the token "
                        "for this greeting, login and reply",
                        "this is not the master you meant (check --master and the discovery "
                        "file), something between the hosts rewrote the login (a relay), or "
                        "the master runs another kvctl version")
                self.namespace = reply.namespace
                self._codec.mac = auth.FrameMac(auth.session_key(
                    token, hello.nonce, challenge, p.AUTH_CONTEXT, bound), client=True)
            elif token:
                # This side has a token, the master asks for none: either a misconfigured
                # cluster or not the master we mean; never hand it our data.
                raise StoreAuthError(
                    f"store master at {address} asks for no token, but this side has one",
                    "set the same KVCTL_TOKEN on the master (and nodes), or unset it here")
        except BaseException:
            self._sock.close()
            raise

    def _recv_raw(self) -> tuple[bytes, p.Reply]:
        """A reply and its payload as received (the greeting's, for the login transcript)."""
        kept: list[bytes] = []
        reply = self._recv(kept)
        return kept[0], reply

    def _recv(self, kept: list[bytes] | None = None) -> p.Reply:
        try:
            frame = self._reader.recv()
            if kept is not None:
                kept.append(bytes(frame.payload))
            reply = self._codec.decode_reply(frame.payload)
        except ConnectionClosedError as exc:
            raise StoreUnavailableError(f"store master at {self.address} closed the "
                                        "connection", "check the master is running") from exc
        except FrameError as exc:
            raise ProtocolError(f"bad reply from store master at {self.address}: {exc.cause}",
                                exc.hint) from exc
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed reply from store master at {self.address}: {exc}",
                                "use the same kvctl version as the master") from exc
        except OSError as exc:
            raise self._unavailable("did not answer", exc) from exc
        if isinstance(reply, p.Fail) and reply.error.code == "not_leader":
            self.close()  # the master closes it too: the next one is opened elsewhere
            raise error_from(reply.error)
        return reply

    def _unavailable(self, what: str, exc: OSError) -> StoreUnavailableError:
        why = (f"within {self.timeout_s:g} s" if isinstance(exc, BlockingIOError | TimeoutError)
               else f"({exc.strerror or exc})")
        return StoreUnavailableError(f"store master at {self.address} {what} {why}",
                                     "check the master (kvctl store status)")

    def call(self, msg: msgspec.Struct) -> p.Reply:
        """Send a request and return its reply (a :class:`~kvctl.store.protocol.Fail` stays a
        reply: the caller maps it, knowing the key)."""
        self.send(msg)
        return self._recv()

    def recv(self) -> p.Reply:
        """The reply to a request sent with :meth:`send` (split from :meth:`call` so the
        caller can do other work, e.g. a speculative read, while the master answers)."""
        return self._recv()

    def recv_data(self, views: Sequence[memoryview]) -> None:
        """Fill ``views`` with the object bytes the master sent behind a get reply (see
        `kvctl.store.protocol`, attached bytes)."""
        try:
            self._reader.recv_into_views(views)
        except ConnectionClosedError as exc:
            raise StoreUnavailableError(f"store master at {self.address} closed the "
                                        "connection", "check the master is running") from exc
        except OSError as exc:
            raise self._unavailable("did not send the object bytes", exc) from exc

    def send(self, msg: msgspec.Struct) -> None:
        """Send a request that gets no reply (commits), or whose reply :meth:`recv` takes."""
        try:
            frame = self._codec.encode(msg)
        except UnicodeEncodeError as exc:  # a lone surrogate (e.g. from os.fsdecode)
            raise BadRequestError(
                f"{exc.object[max(0, exc.start - 20):exc.end + 20]!r} is not valid UTF-8 "
                f"({exc.reason})", "keys and names are UTF-8 text: check the bytes (or the "
                "shell's locale)") from None
        except FrameError as exc:  # larger than a frame: nothing was sent
            raise BadRequestError(f"request to the store master is too large: {exc.cause}",
                                  "send fewer or shorter keys per call") from None
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            raise self._unavailable("took no request", exc) from exc

    def stale(self) -> bool:
        """Whether the connection is unusable before a request is sent: the master closed
        or reset it (it restarted), or bytes wait that no request asked for. One
        non-blocking peek, no wait."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True  # closed socket
        # Nothing readable: the normal idle state. Readable with no request out: EOF (the
        # master closed it), a reset, or stray bytes; either way not usable.
        return bool(readable) or self._reader.buffered > 0

    def interrupt(self) -> None:
        """Wake a thread blocked on this connection (it then sees it closed)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with contextlib.suppress(OSError):
            self._sock.close()


class MasterSet:
    """The masters a client or node was given (see the module docstring). Thread-safe.

    Args:
        spec: ``A:PORT[,B:PORT...]``, or ``etcd://HOST:2379[,HOST2:2379][?cluster=ID]``:
            the leader that elected masters on that etcd (and cluster id) name in their
            leader key, read again whenever a connection is opened.
        failover_s: how long the masters are tried again while none answers.
    """

    def __init__(self, spec: str, *, failover_s: float = FAILOVER_S) -> None:
        self.spec = spec
        self.failover_s = failover_s
        self._last = 0
        #: (etcd URL, cluster id) to read the leader from, or None: fixed addresses
        self._etcd: tuple[str, str] | None = None
        if spec.startswith("etcd://"):
            url, _, query = spec.partition("?")
            self._etcd = (url, urllib.parse.parse_qs(query).get("cluster", [""])[0])
            self.addresses: list[str] = []
        else:
            self.addresses = master_addresses(spec)

    @property
    def first(self) -> str:
        """The first master given (where a node's data path is chosen to reach); with
        etcd, the leader now (waiting up to :attr:`failover_s` for one)."""
        if self._etcd is not None and not self.addresses:
            deadline = time.monotonic() + self.failover_s
            while self._discover() and time.monotonic() < deadline:
                time.sleep(0.25)
            if not self.addresses:
                raise StoreUnavailableError(
                    f"no store master leads on {self.spec} (waited {self.failover_s:g} s)",
                    "start 'kvctl store master --state etcd://...' with the same etcd and "
                    "cluster id (?cluster=ID)")
        return self.addresses[0]

    @property
    def answering(self) -> str:
        """The master that answered last (the first one before any did)."""
        return self.addresses[self._last] if self.addresses else self.spec

    def failed(self, address: str) -> None:
        """A call to ``address`` failed (it died, stalled or no longer leads): the next
        connection tries the other masters first."""
        if self.addresses and self.addresses[self._last % len(self.addresses)] == address:
            self._last = (self._last + 1) % len(self.addresses)

    def _discover(self) -> str | None:
        """Read the leader from etcd into :attr:`addresses`; why there is none, or
        ``None``."""
        from kvctl.metadata import MetadataError
        from kvctl.store.leader import read_leader

        assert self._etcd is not None
        url, cluster = self._etcd
        try:
            leader = read_leader(url, cluster_id=cluster, timeout_s=MULTI_GREETING_S)
        except MetadataError as exc:
            return exc.cause
        if leader is None:
            return f"no leader in {url} (cluster {cluster!r})" if cluster else \
                f"no leader in {url}"
        self.addresses, self._last = [leader.address], 0
        return None

    def connect(self, *, token: str | None = None, timeout_s: float = 30.0,
                spin_s: float = 0.0) -> MasterConnection:
        """A connection to the first master that greets.

        Raises:
            StoreUnavailableError: none did within :attr:`failover_s` (at once with one
                master).
            StoreAuthError: a master refused the token (or did not prove it).
        """
        if self._etcd is None and len(self.addresses) == 1:
            return MasterConnection(self.addresses[0], token=token, timeout_s=timeout_s,
                                    spin_s=spin_s)
        deadline = time.monotonic() + self.failover_s
        pause = 0.05
        wrong: KvctlError | None = None
        while True:
            failures: list[str] = []
            if self._etcd is not None:
                why = self._discover()
                if why is not None:
                    failures.append(why)
                    self.addresses = []
            start = self._last
            for step in range(len(self.addresses)):
                index = (start + step) % len(self.addresses)
                address = self.addresses[index]
                try:
                    conn = MasterConnection(address, token=token, timeout_s=timeout_s,
                                            spin_s=spin_s, greeting_s=MULTI_GREETING_S)
                except (StoreAuthError, ProtocolError) as exc:
                    wrong = wrong or exc  # not our master: the others may still be
                    failures.append(exc.cause)
                    continue
                except StoreUnavailableError as exc:
                    failures.append(exc.cause)
                    continue
                self._last = index
                return conn
            if wrong is not None:  # none answered, one is not ours: waiting would not help
                raise wrong
            if time.monotonic() + pause >= deadline:
                raise StoreUnavailableError(
                    f"none of the store masters {self.spec} answers (tried for "
                    f"{self.failover_s:g} s): {'; '.join(failures)}",
                    "check that one of them leads (its log says 'leading'); a standby "
                    "refuses connections until it takes over")
            time.sleep(pause)
            pause = min(0.25, pause * 2)


class MasterPool:
    """Connections to the master for a client shared by threads.

    Each thread sends on a connection of its own, so the master takes one thread's
    requests, commits and put reports in the order the thread sent them, including the
    messages that get no reply (a thread reads its own writes, and its puts of one key land
    in order). A nested exchange in the same thread borrows a spare connection. A
    connection that fails is dropped (the next call opens a new one), and an idle
    connection the master has closed meanwhile (a master restart) is noticed before it is
    used and replaced, so a client outlives a master restart on the same address without
    a failed call. Connections of threads that ended are closed when the next one opens.

    Attributes:
        namespace: the namespace the master confined this client's token to (see
            :attr:`MasterConnection.namespace`).
        max_frame_bytes: the largest message the master takes.
    """

    def __init__(self, address: str, *, token: str | None = None, timeout_s: float = 30.0,
                 spin_s: float = 0.0) -> None:
        self.address = address
        self._token = token
        self._timeout_s = timeout_s
        self._spin_s = spin_s
        self._spares: list[MasterConnection] = []
        self._owned: list[tuple[weakref.ref[threading.Thread], MasterConnection]] = []
        self._mine = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        self._masters = MasterSet(address)
        first = self._masters.connect(token=token, timeout_s=timeout_s, spin_s=spin_s)
        self.namespace = first.namespace
        self.max_frame_bytes = first.max_frame_bytes
        self._spares.append(first)

    def _open(self) -> MasterConnection:
        """A spare connection the master has not closed, else a new one."""
        while True:
            with self._lock:
                conn = self._spares.pop() if self._spares else None
            if conn is None:
                return self._masters.connect(token=self._token, timeout_s=self._timeout_s,
                                             spin_s=self._spin_s)
            if not conn.stale():
                return conn
            conn.close()

    def _own(self) -> MasterConnection:
        """This thread's connection (opened now if it has none, or its old one went
        stale)."""
        conn: MasterConnection | None = getattr(self._mine, "conn", None)
        if conn is not None and not conn.stale():
            return conn
        if conn is not None:
            conn.close()
        conn = self._open()
        self._mine.conn = conn
        me = threading.current_thread()
        with self._lock:
            keep: list[tuple[weakref.ref[threading.Thread], MasterConnection]] = []
            ended: list[tuple[weakref.ref[threading.Thread], MasterConnection]] = []
            for ref, c in self._owned:
                thread = ref()
                if c is conn or thread is me:
                    continue  # replaced (its old connection was closed above)
                (keep if thread is not None and thread.is_alive() else ended).append((ref, c))
            self._owned = [*keep, (weakref.ref(me), conn)]
        for _, old in ended:
            old.close()
        return conn

    @contextlib.contextmanager
    def connection(self) -> Iterator[MasterConnection]:
        """Borrow a connection for one exchange: this thread's own, or a spare one when
        the thread's own is in use (a nested exchange)."""
        if getattr(self._mine, "busy", False):
            conn = self._open()
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._spares.append(conn)
            return
        conn = self._own()
        self._mine.busy = True
        try:
            yield conn
        except BaseException as exc:
            conn.close()  # maybe out of sync: the thread opens a new one next time
            self._mine.conn = None
            if isinstance(exc, StoreUnavailableError):
                self._masters.failed(conn.address)
            raise
        finally:
            self._mine.busy = False
        if self._closed:
            conn.close()

    @property
    def answering(self) -> str:
        """The master that answered last (see :attr:`MasterSet.answering`)."""
        return self._masters.answering

    def call(self, msg: msgspec.Struct) -> p.Reply:
        """One request/reply on a borrowed connection."""
        with self.connection() as conn:
            return conn.call(msg)

    def close(self) -> None:
        """Close every connection (idempotent)."""
        with self._lock:
            self._closed = True
            conns = self._spares + [c for _, c in self._owned]
            self._spares, self._owned = [], []
        for conn in conns:
            conn.close()
