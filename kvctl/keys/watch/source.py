"""The ZeroMQ side: subscribe to publishers, replay gaps, tell a dead endpoint.

An :class:`Endpoint` is written ``[NAME=]URL[,replay=URL][,bind]``. vLLM and SGLang *bind*
their PUB socket when their endpoint is a wildcard (``tcp://*:P``), ``ipc://`` or
``inproc://``, and *connect* otherwise: so kvctl connects to ``tcp://HOST:P`` or
``ipc://PATH``, and binds when told ``bind`` (the engine was given ``tcp://kvctl-host:P``)
or when the URL is a wildcard. The replay endpoint is always the publisher's ROUTER:
kvctl connects a DEALER and asks ``["", first seq as 8 bytes]``.

Connection trouble is read from the socket's monitor: an endpoint refused again and again is
reported dead (and retried by ZeroMQ meanwhile), never a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.keys.watch.wire import END_SEQ, decode_seq, encode_seq

#: Messages queued per subscription before ZeroMQ drops (vLLM's PUB default hwm).
RCV_HWM = 100_000
#: Largest message frame taken in: ZeroMQ drops the connection of a peer that sends a
#: larger one (and the watch connects again). With ``RCV_HWM`` it bounds what a
#: subscription can queue. A vLLM batch is one scheduler step's events, its tokens at most
#: ``max_num_batched_tokens``: well under 1 MiB.
MAX_MESSAGE_BYTES = 16 * 2**20
#: Most messages one replay asks for: vLLM's replay buffer (``buffer_steps``) holds 10,000,
#: so a longer gap asks for its last 10,000 only, and a replay endpoint that sends more than
#: that many past the ones asked for is cut off.
MAX_REPLAY = 10_000


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise UnavailableError("unavailable: watching KV events needs the pyzmq package",
                               "pip install pyzmq (or reinstall kvctl, which depends on it)"
                               ) from exc
    return zmq


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One instance's publisher.

    Attributes:
        name: the instance's name in reports.
        url: its PUB address.
        replay: its ROUTER replay address, if it has one.
        bind: kvctl binds ``url`` (the engine connects to it).
    """

    name: str
    url: str
    replay: str | None = None
    bind: bool = False


def parse_endpoint(text: str) -> Endpoint:
    """``[NAME=]URL[,replay=URL][,bind]`` as an :class:`Endpoint`.

    Raises:
        UsageError: no URL, an unknown transport, or an unknown option.
    """
    head, *opts = [p.strip() for p in text.split(",")]
    name, sep, url = head.partition("=")
    if not sep:
        name, url = "", head
    if "://" not in url:
        raise UsageError(f"endpoint {text!r} has no URL",
                         "write e.g. tcp://10.0.0.5:5557 or a=tcp://10.0.0.5:5557,"
                         "replay=tcp://10.0.0.5:5558")
    replay: str | None = None
    bind = "*" in url
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "replay" and "://" in value:
            replay = value
        elif key == "bind" and not value:
            bind = True
        else:
            raise UsageError(f"endpoint {text!r}: unknown option {opt!r}",
                             "options are replay=URL and bind")
    for u in (url, replay):
        if u is not None and u.split("://")[0] not in ("tcp", "ipc", "inproc"):
            raise UsageError(f"endpoint {u!r}: unknown transport",
                             "use tcp://, ipc:// or inproc:// as the engine does")
    return Endpoint(name or url.split("://", 1)[1], url, replay, bind)


@dataclasses.dataclass(frozen=True)
class Received:
    """One message: the instance and its frames, with the time it came."""

    name: str
    frames: list[bytes]
    recv_ts: float


class Subscriber:
    """SUB sockets on every endpoint (all topics), a monitor on each, DEALERs for replay.

    Args:
        endpoints: the publishers.
        context: a ``zmq.Context`` to use (default: a new one, closed with this).
        replay_timeout_s: how long one replay may take before it is given up.
    """

    def __init__(self, endpoints: list[Endpoint], *, context: Any = None,
                 replay_timeout_s: float = 5.0) -> None:
        zmq = _zmq()
        self._zmq = zmq
        names = [e.name for e in endpoints]
        if len(set(names)) != len(names):
            raise UsageError("two endpoints have the same instance name",
                             "name them: a=tcp://...,b=tcp://...")
        seen: dict[str, str] = {}
        for e in endpoints:
            if e.url in seen:
                # two subscriptions to one publisher: every block would count as held by
                # "another instance", a pool's savings out of nothing
                raise UsageError(f"instances {seen[e.url]} and {e.name} are the same publisher "
                                 f"{e.url}", "give each engine instance's endpoint once")
            seen[e.url] = e.name
        self._own = context is None
        self.ctx = context if context is not None else zmq.Context()
        self.endpoints = {e.name: e for e in endpoints}
        self.replay_timeout_s = replay_timeout_s
        self.poller = zmq.Poller()
        self.subs: dict[Any, str] = {}
        self.by_name: dict[str, Any] = {}
        self.monitors: dict[Any, str] = {}
        self.state: dict[str, str] = {}
        self.ever_connected: dict[str, bool] = {}
        self.refusals: dict[str, int] = {}
        self.changes: list[tuple[str, str]] = []
        try:
            for e in endpoints:
                self._open(e)
        except BaseException:
            self.close()
            raise

    def _open(self, e: Endpoint) -> None:
        zmq = self._zmq
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Bounded like vLLM's own PUB (hwm 100,000): a watch that falls behind loses
        # messages there, sees the gap and fills it from the replay endpoint.
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket()
        self.subs[sock] = e.name
        self.by_name[e.name] = sock
        self.monitors[monitor] = e.name
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self.ever_connected[e.name] = False
        self.refusals[e.name] = 0
        try:
            if e.bind:
                sock.bind(e.url)
                self.state[e.name] = "bound, waiting for the engine"
            else:
                sock.connect(e.url)
                self.state[e.name] = "connecting"
        except zmq.ZMQError as exc:
            raise UsageError(f"instance {e.name}: cannot {'bind' if e.bind else 'connect'} "
                             f"{e.url}: {exc}",
                             "check the address (bind needs a local one; a publisher with "
                             "tcp://*:P is connected to as tcp://HOST:P)") from exc

    def poll(self, timeout_s: float) -> list[Received]:
        """Messages that came within ``timeout_s`` (connection changes go to ``changes``)."""
        zmq = self._zmq
        out: list[Received] = []
        ready = dict(self.poller.poll(max(0, int(timeout_s * 1000))))
        now = time.time()
        for sock, name in self.subs.items():
            if sock not in ready:
                continue
            for _ in range(10_000):  # drain, bounded so monitors and others get a turn
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out.append(Received(name, frames, now))
        for monitor, name in self.monitors.items():
            if monitor in ready:
                self._monitor(monitor, name)
        return out

    def _monitor(self, monitor: Any, name: str) -> None:
        zmq = self._zmq
        from zmq.utils.monitor import recv_monitor_message

        for _ in range(1000):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.ever_connected[name] = True
                self.refusals[name] = 0
                self._set(name, "live")
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self.refusals[name] += 1
                if self.refusals[name] == 2:
                    self._set(name, "dead: nothing accepts connections there (ZeroMQ keeps "
                              "retrying)")
            elif kind == zmq.EVENT_DISCONNECTED:
                self._set(name, "dead: the publisher went away (ZeroMQ keeps retrying)")
                self._reconnect(name)

    def _reconnect(self, name: str) -> None:
        """Connect again after a disconnection: ZeroMQ retries by itself when the peer went
        away, but not after a protocol error (a message over :data:`MAX_MESSAGE_BYTES`).
        A bound endpoint waits for the engine, which connects again by itself."""
        e = self.endpoints[name]
        if e.bind:
            return
        sock = self.by_name[name]
        # the endpoint may be gone with its session: connect anew either way
        with contextlib.suppress(self._zmq.ZMQError):
            sock.disconnect(e.url)
        sock.connect(e.url)

    def _set(self, name: str, state: str) -> None:
        if self.state.get(name) != state:
            self.state[name] = state
            self.changes.append((name, state))

    def replay(self, name: str, first: int, upto: int | None = None, *,
               timeout_s: float | None = None) -> tuple[list[tuple[int, bytes]], str | None]:
        """Ask ``name``'s replay endpoint for the messages ``first..upto-1`` (``None``: all it
        has): those it sent, in ``first <= seq < upto``, and why the replay is incomplete
        (``None``: it ended).

        Bounded: at most :data:`MAX_REPLAY` messages are asked for (the last ones of a longer
        gap), at most that many more are read before the endpoint is cut off, and the whole
        replay takes at most ``timeout_s`` (default ``replay_timeout_s``).
        """
        zmq = self._zmq
        url = self.endpoints[name].replay
        if url is None:
            return [], "no replay endpoint configured (add ,replay=URL)"
        if upto is not None:
            first = max(first, upto - MAX_REPLAY)
        timeout = self.replay_timeout_s if timeout_s is None else timeout_s
        wanted = MAX_REPLAY if upto is None else upto - first
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(url)
            sock.send_multipart([b"", encode_seq(first)])
            deadline = time.monotonic() + timeout
            for _ in range(wanted + MAX_REPLAY + 1):
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    return got, f"replay endpoint {url} did not finish within {timeout:g} s"
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    return got, f"replay reply of {len(frames)} frame(s), expected 4"
                seq = decode_seq(frames[2])
                if seq is None:
                    return got, "replay reply with a bad sequence frame"
                if seq == END_SEQ:
                    return got, None
                if seq >= first and (upto is None or seq < upto):
                    got.append((seq, frames[3]))
                    if len(got) >= wanted:
                        return got, None
            return got, f"replay endpoint {url} sent more than {wanted + MAX_REPLAY:,} replies"
        finally:
            sock.close(0)

    def close(self) -> None:
        """Close every socket (and the context if it is this subscriber's). Safe twice."""
        for sock in list(self.subs):
            sock.disable_monitor()
            sock.close(0)
        for monitor in list(self.monitors):
            monitor.close(0)
        self.subs.clear()
        self.by_name.clear()
        self.monitors.clear()
        if self._own:
            self.ctx.term()
            self._own = False
