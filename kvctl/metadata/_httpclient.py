"""A small keep-alive HTTP/1.1 client on ``http.client`` shared by the HTTP and etcd backends.

Idle connections are kept in a pool and reused; a request that fails on a *reused*
connection (the server closed it while idle, or restarted) is retried once on a fresh one.
Failures to connect or to get an answer raise :class:`EndpointDown` for the caller to turn
into a :class:`~kvctl.metadata.base.MetadataError` (or to fail over).
"""

from __future__ import annotations

import dataclasses
import errno
import http.client
import socket
import threading

from kvctl.net.auth import REPLY_HEADER

_MAX_IDLE = 8


class EndpointDown(Exception):  # noqa: N818 - internal signal, converted by callers
    """The endpoint did not answer: refused, reset, timed out or unresolvable."""

    def __init__(self, endpoint: str, reason: str, *, refused: bool) -> None:
        super().__init__(f"{endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason
        self.refused = refused


@dataclasses.dataclass(frozen=True)
class Reply:
    """One HTTP answer: status code, the whole body, and its signature header (``""`` when
    it carries none; see :func:`kvctl.net.auth.sign_reply`)."""

    status: int
    body: bytes
    signature: str = ""


class HttpPool:
    """Keep-alive connections to one ``host:port``. Thread-safe."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.endpoint = f"{host}:{port}"
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def request(self, method: str, path: str, body: bytes,
                headers: dict[str, str] | None = None) -> Reply:
        """Send one request and read the whole answer.

        Raises:
            EndpointDown: no answer (connection refused, reset, timeout, DNS failure).
        """
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        for attempt in range(2):
            conn, reused = self._take(fresh=attempt > 0)
            try:
                conn.request(method, path, body=body, headers=all_headers)
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                timed_out = isinstance(exc, TimeoutError)
                if reused and attempt == 0 and not timed_out:
                    continue  # stale keep-alive connection: once more on a fresh one
                raise _down(self.endpoint, exc) from exc
            if response.will_close:
                conn.close()
            else:
                self._give(conn)
            return Reply(response.status, data, response.getheader(REPLY_HEADER, "") or "")
        raise EndpointDown(self.endpoint, "no answer", refused=False)  # pragma: no cover

    def close(self) -> None:
        """Close every idle connection. Safe to call twice."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self, *, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if fresh:  # the idle ones may all be stale (the server restarted): drop them
                stale, self._idle = self._idle, []
            elif self._idle:
                return self._idle.pop(), True
            else:
                stale = []
        for conn in stale:
            conn.close()
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()


def _down(endpoint: str, exc: BaseException) -> EndpointDown:
    if isinstance(exc, ConnectionRefusedError):
        return EndpointDown(endpoint, "connection refused", refused=True)
    if isinstance(exc, TimeoutError):
        return EndpointDown(endpoint, "timed out", refused=False)
    if isinstance(exc, socket.gaierror):
        return EndpointDown(endpoint, f"cannot resolve host ({exc.strerror})", refused=False)
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return EndpointDown(endpoint, "host unreachable", refused=False)
    if isinstance(exc, OSError):
        return EndpointDown(endpoint, exc.strerror or type(exc).__name__, refused=False)
    return EndpointDown(endpoint, f"bad answer ({type(exc).__name__}: {exc})", refused=False)
