"""kvctl's metadata server: refuses bad requests with 4xx and keeps serving; token auth."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from kvctl.errors import UsageError
from kvctl.metadata import MetadataError, MetadataServer, open_metadata
from kvctl.net.auth import sign_request
from tests.metadata._util import wait_until

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-value"


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    with MetadataServer(port=0, request_timeout_s=0.5, max_body_bytes=1024,
                        max_connections=4) as s:
        yield s


def _post(server: MetadataServer, path: str, body: bytes, headers: dict[str, str] | None = None,
          method: str = "POST") -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        data = reply.read()
        try:
            answer = json.loads(data)
        except ValueError:
            answer = {}
        return reply.status, answer
    finally:
        conn.close()


def _still_serves(server: MetadataServer) -> None:
    with open_metadata(server.url) as c:
        c.put("kvctl/alive", b"yes")
        assert c.get("kvctl/alive") == b"yes"


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/get", b"{not json", 400, "bad_json"),
    ("/v1/get", b"[1, 2]", 400, "bad_json"),
    ("/v1/get", b"\xff\xfe", 400, "bad_json"),
    ("/v1/get", b'{"key": 5}', 400, "bad_field"),
    ("/v1/get", b'{"key": ""}', 400, "bad_field"),
    ("/v1/put", b'{"key": "kvctl/a", "value": "not base64!"}', 400, "bad_field"),
    ("/v1/put", b'{"key": "kvctl/a", "value": "", "lease": -3}', 400, "bad_field"),
    ("/v1/put", b'{"key": "kvctl/a", "value": "", "lease": true}', 400, "bad_field"),
    ("/v1/lease/grant", b'{"ttl_s": 0}', 400, "bad_field"),
    ("/v1/lease/grant", b'{"ttl_s": "10"}', 400, "bad_field"),
    ("/v1/lease/keepalive", b'{"lease": 12345}', 409, "lease_expired"),
    ("/v1/nope", b"{}", 404, "not_found"),
    ("/../../etc/passwd", b"{}", 404, "not_found"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(
    server: MetadataServer, path: str, body: bytes, status: int, code: str
) -> None:
    got, answer = _post(server, path, body)
    assert (got, answer.get("error")) == (status, code)
    assert answer.get("message")
    _still_serves(server)


def test_wrong_methods_and_missing_length(server: MetadataServer) -> None:
    assert _post(server, "/v1/get", b"", method="GET")[0] == 405
    assert _post(server, "/v1/get", b"{}", method="PUT")[0] == 501
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/get HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 411 " in sock.recv(4096)
    _still_serves(server)


def test_oversized_body_is_refused_without_reading_it(server: MetadataServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/put HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
        assert b" 413 " in sock.recv(4096)
    big = json.dumps({"key": "kvctl/big", "value": "A" * 2000}).encode()
    assert _post(server, "/v1/put", big)[0] == 413
    _still_serves(server)


def test_stalled_client_is_dropped_and_others_are_served(server: MetadataServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
        slow.sendall(b"POST /v1/get HTTP/1.1\r\nHost: x\r\nContent-Le")  # ...and stall
        _still_serves(server)  # served while the slow client holds its connection
        start = time.monotonic()
        assert slow.recv(4096) == b""  # the server hangs up after its request timeout
        assert time.monotonic() - start < 3.0
    _still_serves(server)


def test_connections_beyond_the_cap_get_503(server: MetadataServer) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            assert b" 503 " in extra.recv(4096)
    finally:
        for sock in idle:
            sock.close()
    # The idle ones are closed (or timed out): room again.
    wait_until(lambda: _post(server, "/v1/health", b"", method="GET")[0] == 200, 5.0)


def test_keep_alive_connection_is_reused_after_server_idle_timeout(server: MetadataServer) -> None:
    with open_metadata(server.url) as c:
        c.put("kvctl/k", b"1")
        time.sleep(0.8)  # longer than the server's 0.5 s timeout: it closed our connection
        assert c.get("kvctl/k") == b"1"


def test_stop_drops_open_connections() -> None:
    server = MetadataServer(port=0).start()
    with open_metadata(server.url, timeout_s=1) as c:
        c.put("kvctl/k", b"1")
        server.stop()
        server.stop()  # idempotent
        with pytest.raises(MetadataError):
            c.get("kvctl/k")


def test_port_in_use_is_usage_error(server: MetadataServer) -> None:
    with pytest.raises(UsageError) as info:
        MetadataServer(port=server.port).start()
    assert str(server.port) in info.value.cause


# -- token auth ---------------------------------------------------------------------------


@pytest.fixture
def secured() -> Iterator[MetadataServer]:
    with MetadataServer(port=0, token=TOKEN) as s:
        yield s


def test_unsigned_and_wrongly_signed_requests_get_401(secured: MetadataServer) -> None:
    with open_metadata(secured.url) as anonymous, pytest.raises(MetadataError) as info:
        anonymous.get("kvctl/x")
    assert "refused" in info.value.cause
    assert "KVCTL_TOKEN" in (info.value.hint or "")
    with open_metadata(secured.url, token="wrong") as wrong, pytest.raises(MetadataError):
        wrong.put("kvctl/x", b"v")
    with open_metadata(secured.url, token=TOKEN) as right:
        right.put("kvctl/x", b"v")
        assert right.get("kvctl/x") == b"v"
        assert right.list("kvctl/") == {"kvctl/x": b"v"}


def test_signature_covers_path_and_body(secured: MetadataServer) -> None:
    body = b'{"key": "kvctl/x"}'
    headers = sign_request(TOKEN, "POST", "/v1/get", body)
    assert _post(secured, "/v1/delete", body, headers)[0] == 401  # other path
    assert _post(secured, "/v1/get", b'{"key": "kvctl/y"}', headers)[0] == 401  # other body
    stale = sign_request(TOKEN, "POST", "/v1/get", body, now=time.time() - 3600)
    assert _post(secured, "/v1/get", body, stale)[0] == 401


def test_replayed_request_is_refused(secured: MetadataServer) -> None:
    body = b'{"key": "kvctl/x"}'
    headers = sign_request(TOKEN, "POST", "/v1/get", body)
    assert _post(secured, "/v1/get", body, headers)[0] == 200
    assert _post(secured, "/v1/get", body, headers)[0] == 401


def test_token_is_never_logged_or_shown(secured: MetadataServer,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with open_metadata(secured.url, token=TOKEN) as c:
        c.put("kvctl/x", b"v")
        assert TOKEN not in repr(c)
    with open_metadata(secured.url, token="wrong") as c, pytest.raises(MetadataError):
        c.get("kvctl/x")
    assert caplog.records  # the server did log the requests
    assert TOKEN not in caplog.text
    assert TOKEN not in repr(secured)


def test_keep_alive_requests_do_not_stall_on_nagle(server: MetadataServer) -> None:
    # Answers written in two parts stall ~40 ms each without TCP_NODELAY (delayed ACK).
    with open_metadata(server.url) as c:
        c.put("kvctl/k", b"v")
        times = []
        for _ in range(21):
            start = time.perf_counter()
            c.get("kvctl/k")
            times.append(time.perf_counter() - start)
    assert sorted(times)[10] < 0.02
