"""Metadata HTTP answers are signed and bound to their request, and the replay window
outlives a restart (issue 27.6).

The attack: a relay without the token answered a signed put with a forged ``200 {}`` (the
client took it), answered a get with a value of its choosing (taken too), and a recorded
request refused as a replay (401) was taken (200) once the server restarted on its
``--data-dir``. Now every answer carries ``X-Kvctl-Reply``, an HMAC over its status and
body and the request's signature, checked before the client reads it; and the nonces of the
window are kept in ``data_dir/replay-nonces``."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.metadata.base import MetadataError
from kvctl.metadata.http_backend import HttpMetadata
from kvctl.metadata.server import REPLAY_JOURNAL, MetadataServer
from kvctl.net.auth import REPLY_HEADER, RequestVerifier, sign_request

TOKEN = "metadata-relay-token-0123"

#: (method, path, headers, body) of a request → the raw HTTP answer the relay sends.
Answer = Callable[[str, str, dict[str, str], bytes], bytes]


class HttpRelay:
    """A loopback HTTP relay holding no token: ``answer`` makes each reply (forged, or the
    upstream's, altered or not); one thread per connection, keep-alive served."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError), conn.makefile("rb") as rfile:
            while line := rfile.readline():
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (header := rfile.readline().decode().strip()):
                    name, _, value = header.partition(":")
                    headers[name.strip()] = value.strip()
                body = rfile.read(int(headers.get("Content-Length", "0")))
                conn.sendall(self.answer(method, path, headers, body))

    def close(self) -> None:
        self.listener.close()


def _raw(status: int, body: bytes, signature: str = "") -> bytes:
    extra = f"{REPLY_HEADER}: {signature}\r\n" if signature else ""
    return (f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _upstream(server: MetadataServer, method: str, path: str, headers: dict[str, str],
              body: bytes) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read(), response.getheader(REPLY_HEADER, "") or ""
    finally:
        conn.close()


def test_a_forged_ok_to_a_put_is_refused() -> None:
    held: list[tuple[str, str, dict[str, str], bytes]] = []

    def forge(method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        held.append((method, path, headers, body))  # kept back, to be released later
        return _raw(200, b"{}")

    relay = HttpRelay(forge)
    try:
        with HttpMetadata("127.0.0.1", relay.port, token=TOKEN, timeout_s=5) as client, \
                pytest.raises(MetadataError, match="unsigned answer") as caught:
            client.put("k", b"v1")
        assert "HTTP 200" in caught.value.cause
        assert len(held) == 1
    finally:
        relay.close()


def test_a_forged_get_answer_is_refused_even_with_a_real_signature() -> None:
    with MetadataServer(port=0, token=TOKEN) as server:
        with HttpMetadata("127.0.0.1", server.port, token=TOKEN) as direct:
            direct.put("k", b"genuine")

        def rewrite(method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
            status, data, signature = _upstream(server, method, path, headers, body)
            if path == "/v1/get":  # the server's own signature, over another body
                data = json.dumps({"value": base64.b64encode(b"forged").decode()}).encode()
            return _raw(status, data, signature)

        relay = HttpRelay(rewrite)
        try:
            with HttpMetadata("127.0.0.1", relay.port, token=TOKEN, timeout_s=5) as client:
                client.put("other", b"x")  # untouched answers pass through the relay
                with pytest.raises(MetadataError, match="wrongly signed answer"):
                    client.get("k")
        finally:
            relay.close()


def test_an_answer_recorded_for_another_request_is_refused() -> None:
    with MetadataServer(port=0, token=TOKEN) as server:
        recorded: list[tuple[int, bytes, str]] = []

        def replay(method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
            answer = _upstream(server, method, path, headers, body)
            if path == "/v1/get" and not recorded:
                recorded.append(answer)  # v1's answer, signed for that first get
            return _raw(*(recorded[0] if path == "/v1/get" else answer))

        relay = HttpRelay(replay)
        try:
            with HttpMetadata("127.0.0.1", relay.port, token=TOKEN, timeout_s=5) as client:
                client.put("k", b"v1")
                assert client.get("k") == b"v1"
                client.put("k", b"v2")
                with pytest.raises(MetadataError, match="wrongly signed"):
                    client.get("k")  # the stale v1 answer, replayed
        finally:
            relay.close()


def test_a_replay_refused_before_a_restart_stays_refused_after(tmp_path: Path) -> None:
    body = json.dumps({"key": "k", "value": base64.b64encode(b"v").decode(),
                       "lease": None}).encode()
    headers = {"Content-Type": "application/json",
               **sign_request(TOKEN, "POST", "/v1/put", body)}
    with MetadataServer(port=0, token=TOKEN, data_dir=tmp_path) as first:
        assert _upstream(first, "POST", "/v1/put", headers, body)[0] == 200
        assert _upstream(first, "POST", "/v1/put", headers, body)[0] == 401
    assert (tmp_path / REPLAY_JOURNAL).is_file()
    with MetadataServer(port=0, token=TOKEN, data_dir=tmp_path) as second:
        status, data, signature = _upstream(second, "POST", "/v1/put", headers, body)
        assert status == 401, data
        assert signature  # a refusal is signed too
        with HttpMetadata("127.0.0.1", second.port, token=TOKEN) as client:
            assert client.get("k") == b"v"  # the state came back with the journal


def test_the_replay_journal_stays_bounded(tmp_path: Path) -> None:
    journal = tmp_path / REPLAY_JOURNAL
    verifier = RequestVerifier(TOKEN, window_s=1.0, journal=journal, now=1000.0)
    try:
        for i in range(10_000):  # 100 requests a second for 100 s: ~100 live at a time
            now = 1000.0 + i / 100
            headers = sign_request(TOKEN, "POST", "/v1/get", b"{}", now=now)
            assert verifier.verify("POST", "/v1/get", b"{}", headers, now=now)
        lines = journal.read_text().splitlines()
        assert 0 < len(lines) <= 4097
    finally:
        verifier.close()
    # Reloaded later, only the window's nonces come back (here: none).
    reloaded = RequestVerifier(TOKEN, window_s=1.0, journal=journal, now=5000.0)
    reloaded.close()
    assert journal.read_text() == ""
