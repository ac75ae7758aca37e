"""kvctl's own metadata server: a leased key/value store behind a small JSON-over-HTTP API.

Run it with ``kvctl metadata serve`` or embed it::

    with MetadataServer(port=0) as server:
        client = open_metadata(server.url)

The state lives in memory (leases on a monotonic clock), or, with ``data_dir``, in a
``file:///`` store under that directory, so entries and leases survive a restart.

API (every call ``POST`` with a JSON body except the health check; values are base64):

====================  =====================================  ==============================
path                  request                                answer
====================  =====================================  ==============================
/v1/put               {"key", "value", "lease": id|null}     {}
/v1/get               {"key"}                                {"value": b64|null}
/v1/list              {"prefix"}                             {"entries": {key: b64}}
/v1/delete            {"key"}                                {"deleted": bool}
/v1/lease/grant       {"ttl_s"}                              {"lease": id}
/v1/lease/keepalive   {"lease"}                              {} or 409 lease_expired
/v1/lease/revoke      {"lease"}                              {}
GET /v1/health                                               {"ok": true, "version"}
====================  =====================================  ==============================

Errors answer ``{"error": code, "message": text}`` with a 4xx/5xx status and leave the server
serving. Bodies are capped (``max_body_bytes``), a client that stalls mid-request is dropped
after ``request_timeout_s``, and at most ``max_connections`` connections are served at once.
With a token, every request must carry the headers of :func:`kvctl.net.auth.sign_request`
(401 otherwise), every answer carries ``X-Kvctl-Reply`` (:func:`kvctl.net.auth.sign_reply`,
bound to the request's signature) and, with ``data_dir``, the nonces of the replay window
are kept in ``data_dir/replay-nonces`` so a restart does not forget them; the token is never
logged.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from kvctl import __version__
from kvctl.errors import KvctlError, UsageError
from kvctl.metrics import HIT, MISS, OK
from kvctl.net.advertise import advertised_addresses, join_host_port
from kvctl.net.auth import REPLY_HEADER, RequestVerifier
from kvctl.net.bind import LOOPBACK, announce_bind, is_unspecified
from kvctl.net.limits import PAUSE_MAX_S, PAUSE_MIN_S, RESOURCE_ERRNOS, PendingLimit

if TYPE_CHECKING:
    from kvctl.metrics import ServerMetrics
from kvctl.metadata.base import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
)

_log = logging.getLogger(__name__)

#: Longest lease a client may ask for, in seconds (one day).
MAX_LEASE_TTL_S = 86400.0
_AUTH_HEADERS = ("X-Kvctl-Time", "X-Kvctl-Nonce", "X-Kvctl-Signature")
#: The file under ``data_dir`` that keeps the signed requests' nonces of the last window.
REPLAY_JOURNAL = "replay-nonces"


class _RefusedError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _Listener(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 drops SYNs under a burst of clients

    def __init__(self, address: tuple[str, int], owner: MetadataServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.owner = owner
        self.active: set[socket.socket] = set()
        self.active_lock = threading.Lock()
        # Connections waiting for a request that passes (signed, with a token) are few and
        # short: a flood of idle or slow-drip sockets cuts its own oldest, not new clients.
        self.pending = PendingLimit(owner.max_pending, "metadata server",
                                    deadline_s=owner.request_timeout_s)
        self._accept_pause_s = PAUSE_MIN_S
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            request = super().get_request()
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:  # out of descriptors: wait, do not spin
                time.sleep(self._accept_pause_s)
                self._accept_pause_s = min(self._accept_pause_s * 2, PAUSE_MAX_S)
            raise
        self._accept_pause_s = PAUSE_MIN_S
        return request

    def server_close(self) -> None:
        self.pending.close()
        super().server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.active_lock:
            full = len(self.active) >= self.owner.max_connections
            if not full:
                self.active.add(request)
        if not full:
            self.pending.admit(request, str(client_address[0]))
        if full:
            _log.warning("metadata server: refusing %s, %d connections already open",
                         client_address[0], self.owner.max_connections)
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def close_request(self, request: Any) -> None:
        self.pending.trusted(request)
        with self.active_lock:
            self.active.discard(request)
        super().close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Called by socketserver inside its except block; only that connection is closed.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client hung up, or stop() shut the socket
            _log.debug("metadata server: connection from %s ended: %s", client_address[0], exc)
        else:  # a bug in a handler
            _log.exception("metadata server: request from %s failed", client_address[0])

    def drop_connections(self) -> None:
        with self.active_lock:
            sockets = list(self.active)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle's algorithm and the
    # client's delayed ACK add ~40 ms to every answer.
    disable_nagle_algorithm = True
    server_version = f"kvctl-metadata/{__version__}"
    server: _Listener

    def setup(self) -> None:
        # Socket timeout: a client stalled mid-request (or idle on keep-alive) is dropped.
        self.request.settimeout(self.server.owner.request_timeout_s)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        # Only method, path and status reach the log: never headers (signatures) or bodies.
        _log.debug("metadata server %s: " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        owner = self.server.owner
        started = time.perf_counter()
        status, payload, body = self._answer(method, owner)
        if owner.metrics is not None:  # counted before replying: a client sees it counted
            op = self.path.split("?", 1)[0].removeprefix("/v1/")
            outcome, bytes_in, bytes_out = _counted(op, status, payload, body)
            owner.metrics.record(op if op in _METRIC_OPS else "other",
                                 time.perf_counter() - started, outcome, bytes_in=bytes_in,
                                 bytes_out=bytes_out)
        self._reply(status, payload, owner.verifier)
        if not self.close_connection and owner.verifier is None:
            # Without a token a connection proves nothing: between requests it is pending
            # again. With one, a connection that signed a request stays trusted.
            self.server.pending.admit(self.request)

    def _answer(self, method: str, owner: MetadataServer
                ) -> tuple[int, dict[str, Any], bytes]:
        """Read, check and answer one request: HTTP status, reply payload, body."""
        body = b""
        try:
            body = self._read_body(method, owner.max_body_bytes)
            if owner.verifier is not None:
                headers = {name: self.headers.get(name, "") for name in _AUTH_HEADERS}
                try:
                    verified = owner.verifier.verify(method, self.path, body, headers)
                except KvctlError as exc:  # the replay journal cannot be written
                    raise _RefusedError(503, "replay_journal", exc.cause) from None
                if not verified:
                    raise _RefusedError(401, "unauthorized",
                                      "missing, wrong, stale or replayed request signature")
            self.server.pending.trusted(self.request)
            return 200, owner.dispatch(method, self.path, body), body
        except _RefusedError as exc:
            if exc.status >= 500:
                _log.warning("metadata server: %s %s failed: %s", method, self.path, exc.message)
            return exc.status, {"error": exc.code, "message": exc.message}, body

    def _read_body(self, method: str, limit: int) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise _RefusedError(411, "length_required", "send a Content-Length, not chunks")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            if method == "POST":
                self.close_connection = True
                raise _RefusedError(411, "length_required", "POST needs a Content-Length")
            return b""
        length_text = length_text.strip()
        # ASCII digits only: str.isdigit() also accepts "²" and other digits int() refuses.
        if not (length_text.isascii() and length_text.isdigit()):
            self.close_connection = True
            raise _RefusedError(400, "bad_length", "Content-Length is not a number")
        # More than 18 digits is over any limit (and past 4300, int() itself refuses).
        length = int(length_text) if len(length_text) <= 18 else limit + 1
        if length > limit:
            self.close_connection = True  # the unread body would be parsed as a request
            raise _RefusedError(413, "too_large", f"body of {length} bytes exceeds {limit} bytes")
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            raise _RefusedError(400, "short_body", "connection closed before the body ended")
        return body

    def _reply(self, status: int, payload: dict[str, Any], verifier: RequestVerifier | None
               ) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if verifier is not None:
                # Signed and bound to the request (issue 27.6: a relay answered a signed
                # put with a forged 200 and the client took it).
                self.send_header(REPLY_HEADER, verifier.sign_reply(
                    self.headers.get("X-Kvctl-Signature", ""), status, data))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away: nothing to tell it
            self.close_connection = True


class MetadataServer:
    """kvctl's metadata server, run in background threads.

    Args:
        host: address to bind (loopback unless told otherwise).
        port: TCP port; ``0`` picks a free one (see :attr:`port` / :attr:`url` after start).
        token: shared secret; when set every request must be signed with it.
        data_dir: keep entries and leases in files under this directory (survive restarts);
            ``None`` keeps them in memory.
        request_timeout_s: a connection idle or stalled this long (seconds) is dropped.
        max_body_bytes: largest request body accepted (413 beyond).
        max_connections: connections served at once (503 beyond).
        max_pending: connections at once waiting for a request that passes (a signed one,
            with a token); past it the oldest waiting one is cut.
        metrics: where to count requests (``kvctl metadata serve --metrics-port``).
        advertise: ``HOST`` or ``HOST:PORT`` peers should use (``--advertise``); by default
            the bound address, or the host's first interface address for a wildcard bind.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        data_dir: Path | None = None,
        request_timeout_s: float = 10.0,
        max_body_bytes: int = 4 << 20,
        max_connections: int = 256,
        max_pending: int = 64,
        metrics: ServerMetrics | None = None,
        advertise: Sequence[str] = (),
    ) -> None:
        if request_timeout_s <= 0 or max_body_bytes <= 0 or max_connections <= 0:
            raise UsageError("metadata server limits must be positive",
                             "give a positive request timeout, body limit and connection cap")
        self.host = host
        self.port = port
        self.advertise = tuple(advertise)
        self.data_dir = data_dir
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.max_pending = max_pending
        self.max_connections = max_connections
        self._token = token
        self.verifier = RequestVerifier(token) if token else None
        self.metrics = metrics
        if metrics is not None:
            metrics.gauge("entries", "Live entries held by the server.", self.entry_count)
        self._store: MetadataClient | None = None
        self._listener: _Listener | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MetadataServer(url={self.url!r}, auth={self.verifier is not None})"

    @property
    def url(self) -> str:
        """The URL peers use: ``http://HOST:PORT`` at the advertised address (an interface
        address of this host when bound to all, never ``0.0.0.0``)."""
        return f"http://{advertised_addresses(self.host, self.port, self.advertise)[0]}"

    @property
    def local_url(self) -> str:
        """The URL for clients in this process or host: the bound address (loopback for a
        wildcard bind), whatever is advertised to peers."""
        host = LOOPBACK if is_unspecified(self.host) else self.host
        return f"http://{join_host_port(host, self.port)}"

    def entry_count(self) -> int:
        """Live entries held right now (0 when stopped); the ``entries`` metric."""
        store = self._store
        return 0 if store is None else len(store.list(""))

    @property
    def running(self) -> bool:
        """Whether the server is accepting connections."""
        return self._listener is not None

    def start(self) -> Self:
        """Bind and serve in a background thread.

        Raises:
            UsageError: the address cannot be bound (in use, not local, not permitted).
            MetadataError: ``data_dir`` cannot be used.
        """
        with self._lock:
            if self._listener is not None:
                return self
            store = self._open_store()
            if self._token and self.data_dir is not None:
                # The nonces of the last window outlive a restart (issue 27.6: a request
                # refused as a replay was taken after a --data-dir restart).
                try:
                    self.verifier = RequestVerifier(
                        self._token, journal=self.data_dir.expanduser().resolve()
                        / REPLAY_JOURNAL)
                except KvctlError:
                    store.close()
                    raise
            try:
                listener = _Listener((self.host, self.port), self)
            except OSError as exc:
                store.close()
                hint = "choose another port (or 0 for any free one) with --listen HOST:PORT"
                if exc.errno == errno.EADDRNOTAVAIL:
                    hint = "listen on an address of this host, e.g. 127.0.0.1 or 0.0.0.0"
                raise UsageError(
                    f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}", hint
                ) from exc
            self.port = int(listener.server_address[1])
            self._store, self._listener = store, listener
            self._thread = threading.Thread(
                target=listener.serve_forever, kwargs={"poll_interval": 0.1},
                name=f"kvctl-metadata-{self.port}", daemon=True,
            )
            self._thread.start()
        announce_bind("metadata server", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving, drop open connections and close the store. Safe to call twice."""
        with self._lock:
            listener, self._listener = self._listener, None
            thread, self._thread = self._thread, None
            store, self._store = self._store, None
        if listener is not None:
            listener.shutdown()
            listener.server_close()
            listener.drop_connections()
        if thread is not None:
            thread.join(timeout=5.0)
        if store is not None:
            store.close()
        if self.verifier is not None:
            self.verifier.close()

    close = stop

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _open_store(self) -> MetadataClient:
        if self.data_dir is None:
            from kvctl.metadata.memory import MemoryMetadata

            return MemoryMetadata.private()
        from kvctl.metadata.file import FileMetadata

        return FileMetadata(self.data_dir.expanduser().resolve())

    # -- request handling (called from handler threads) ---------------------------------

    def dispatch(self, method: str, path: str, body: bytes) -> dict[str, Any]:
        """Answer one authenticated request; raises _RefusedError for every refusal."""
        store = self._store
        if store is None:
            raise _RefusedError(503, "stopping", "the server is shutting down")
        route = path.split("?", 1)[0]
        if route == "/v1/health":
            return {"ok": True, "version": __version__}
        handler = _ROUTES.get(route)
        if handler is None:
            raise _RefusedError(404, "not_found", f"no such endpoint {route[:100]!r}")
        if method != "POST":
            raise _RefusedError(405, "method_not_allowed", f"{route} takes POST")
        request = _parse_json(body)
        try:
            return handler(store, request)
        except LeaseExpiredError as exc:
            raise _RefusedError(409, "lease_expired", exc.cause) from None
        except UsageError as exc:
            raise _RefusedError(400, "bad_request", exc.cause) from None
        except MetadataError as exc:
            raise _RefusedError(500, "store_failed", exc.cause) from None


def _parse_json(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _RefusedError(400, "bad_json", "the body is not valid JSON") from None
    if not isinstance(request, dict):
        raise _RefusedError(400, "bad_json", "the body must be a JSON object")
    return request


def _field(request: dict[str, Any], name: str, kind: type[Any], *, optional: bool = False
           ) -> Any:
    value = request.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise _RefusedError(400, "bad_field", f"field {name!r} must be a {kind.__name__}")
    return value


def _key(request: dict[str, Any]) -> str:
    key: str = _field(request, "key", str)
    if not key:
        raise _RefusedError(400, "bad_field", "field 'key' must not be empty")
    return key


def _lease(request: dict[str, Any], *, optional: bool = False) -> LeaseId | None:
    value = _field(request, "lease", int, optional=optional)
    if value is None:
        return None
    if value <= 0 or value >= 1 << 63:
        raise _RefusedError(400, "bad_field", "field 'lease' is out of range")
    return LeaseId(value)


def _put(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    key = _key(request)
    try:
        value = base64.b64decode(_field(request, "value", str), validate=True)
    except binascii.Error:
        raise _RefusedError(400, "bad_field", "field 'value' is not base64") from None
    store.put(key, value, lease=_lease(request, optional=True))
    return {}


def _get(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    value = store.get(_key(request))
    return {"value": None if value is None else base64.b64encode(value).decode()}


def _list(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    entries = store.list(_field(request, "prefix", str))
    return {"entries": {k: base64.b64encode(v).decode() for k, v in entries.items()}}


def _delete(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    return {"deleted": store.delete(_key(request))}


def _grant(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    raw = request.get("ttl_s")
    if not isinstance(raw, int | float) or isinstance(raw, bool):
        raise _RefusedError(400, "bad_field", "field 'ttl_s' must be a number")
    try:
        ttl_s = float(raw)
    except OverflowError:  # a JSON integer too large for a float
        ttl_s = float("inf")
    if not 0 < ttl_s <= MAX_LEASE_TTL_S:
        raise _RefusedError(400, "bad_field", f"ttl_s must be in (0, {MAX_LEASE_TTL_S:.0f}]")
    return {"lease": int(store.grant_lease(ttl_s))}


def _keepalive(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    lease = _lease(request)
    if lease is not None:
        store.keepalive(lease)
    return {}


def _revoke(store: MetadataClient, request: dict[str, Any]) -> dict[str, Any]:
    lease = _lease(request)
    if lease is not None:
        store.revoke(lease)
    return {}


_ROUTES = {
    "/v1/put": _put,
    "/v1/get": _get,
    "/v1/list": _list,
    "/v1/delete": _delete,
    "/v1/lease/grant": _grant,
    "/v1/lease/keepalive": _keepalive,
    "/v1/lease/revoke": _revoke,
}
#: Operation labels for metrics: the routes without their ``/v1/`` prefix, plus health.
_METRIC_OPS = frozenset(r.removeprefix("/v1/") for r in _ROUTES) | {"health"}


def _b64_size(text: object) -> int:
    """Decoded size of base64 ``text`` (0 for anything else), without decoding it."""
    if not isinstance(text, str):
        return 0
    return len(text) * 3 // 4 - len(text) + len(text.rstrip("="))


def _counted(op: str, status: int, payload: dict[str, Any], body: bytes
             ) -> tuple[str, int, int]:
    """(outcome, payload bytes in, payload bytes out) of one answered request: a get is a
    ``hit`` or a ``miss``; bytes are values' sizes (decoded), not the JSON around them."""
    if status != 200:
        return str(payload["error"]), 0, 0
    if op == "get":
        value = payload.get("value")
        return (MISS, 0, 0) if value is None else (HIT, 0, _b64_size(value))
    if op == "list":
        return OK, 0, sum(_b64_size(v) for v in payload.get("entries", {}).values())
    if op == "put":  # the value was checked as base64 when it was stored
        return OK, _b64_size(json.loads(body).get("value")), 0
    return OK, 0, 0
