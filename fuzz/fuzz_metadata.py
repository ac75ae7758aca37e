"""Fuzz kvctl's metadata HTTP server (``kvctl/metadata/server.py``): HTTP parsing,
body limits, signature checks, JSON decoding and the request handlers over both stores.

The first byte picks the mode:

- 0 / 1: the JSON API in-process: ``MetadataServer.dispatch(method, route, body)`` on the
  in-memory store (0) or the ``--data-dir`` file store (1); the second byte picks the
  method and route, the rest is the body. Only the server's own refusal (an HTTP 4xx/5xx
  answer) may come out; any other exception is a crash.
- 2: the rest as raw bytes on a TCP connection to the running server (no token);
- 3: the same against a server that requires a token.

Properties: no crash (modes 0/1: no other exception; modes 2/3: the server's catch-all logs
none); every connection ends within a deadline; mode 3 never gets a 2xx answer and changes
no entry. Every ``CHECK_EVERY`` inputs a well-formed client puts and gets a key through
the real listener (the server keeps serving).

Run: ``python -m fuzz.fuzz_metadata -runs=100000 fuzz/corpus/metadata``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from fuzz._util import ErrorTrap, FuzzFinding, Pump, TcpPair

TOKEN = "fuzz-metadata-" + os.urandom(8).hex()
CHECK_EVERY = 64
ROUTES = ("/v1/put", "/v1/get", "/v1/list", "/v1/delete", "/v1/lease/grant",
          "/v1/lease/keepalive", "/v1/lease/revoke", "/v1/health", "/v1/nope")
_LOGGER = "kvctl.metadata.server"
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


class MetadataHarness:
    """An open in-memory server, an open file-backed server and a token-protected server."""

    def __init__(self) -> None:
        from kvctl.metadata.server import MetadataServer

        self._dir = Path(tempfile.mkdtemp(prefix="kvctl-fuzz-metadata-"))
        self.trap = ErrorTrap([_LOGGER])
        limits: dict[str, Any] = {"request_timeout_s": 2.0, "max_body_bytes": 64 << 10}
        self.memory = MetadataServer(port=0, **limits).start()
        self.files = MetadataServer(port=0, data_dir=self._dir, **limits).start()
        self.auth = MetadataServer(port=0, token=TOKEN, **limits).start()
        self.pair = TcpPair()
        self.inputs = 0

    def close(self) -> None:
        for server in (self.memory, self.files, self.auth):
            server.stop()
        self.pair.close()
        __import__("logging").getLogger(_LOGGER).removeHandler(self.trap)
        shutil.rmtree(self._dir, ignore_errors=True)

    def one_input(self, data: bytes) -> None:
        """Run ``data`` through one mode and check every property."""
        if not data:
            return
        mode, body = data[0] % 4, data[1:]
        if mode in (0, 1):
            self._dispatch(self.memory if mode == 0 else self.files, body)
        else:
            self._raw(self.memory if mode == 2 else self.auth, body, refused=mode == 3)
        self.trap.check()
        self.inputs += 1
        if self.inputs % CHECK_EVERY == 0:
            self.roundtrip()

    def _dispatch(self, server: Any, data: bytes) -> None:
        from kvctl.metadata.server import _RefusedError

        if not data:
            return
        method = "GET" if data[0] & 0x80 else "POST"
        route = ROUTES[(data[0] & 0x7F) % len(ROUTES)]
        try:
            answer = server.dispatch(method, route, data[1:])
        except _RefusedError as exc:
            if not 400 <= exc.status < 600:
                raise FuzzFinding(f"refusal with HTTP status {exc.status}") from None
            return
        json.dumps(answer)  # what the handler sends must be JSON-encodable

    def _raw(self, server: Any, data: bytes, *, refused: bool) -> None:
        before = len(self.auth._store.list("")) if refused else 0
        client, conn = self.pair()
        # Hand the accepted connection to the server the way its accept loop does.
        listener = server._listener
        pump = Pump(client, data)
        try:
            listener.process_request(conn, ("fuzz", 0))
        finally:
            try:
                reply = pump.join()
            finally:
                client.close()
        if refused:
            for status in _STATUS.findall(reply):
                if status.startswith(b"2"):
                    raise FuzzFinding("token-protected server answered "
                                      f"{status.decode()} to an unsigned request")
            if len(self.auth._store.list("")) != before:
                raise FuzzFinding("an unsigned request changed the token server's entries")

    def roundtrip(self) -> None:
        """A well-formed client puts and gets a key on each open server."""
        from kvctl.metadata import open_metadata

        for server in (self.memory, self.files):
            key = f"kvctl/fuzz-check/{os.urandom(4).hex()}"
            with open_metadata(server.url, timeout_s=10) as client:
                client.put(key, b"value")
                if client.get(key) != b"value":
                    raise FuzzFinding(f"well-formed put/get on {server.url} lost the value")
                client.delete(key)


_HARNESS: MetadataHarness | None = None


def harness() -> MetadataHarness:
    """The process-wide harness (created on first use)."""
    global _HARNESS  # noqa: PLW0603 - one harness per fuzzing process
    if _HARNESS is None:
        _HARNESS = MetadataHarness()
    return _HARNESS


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the name atheris expects
    harness().one_input(data)


def seeds() -> dict[str, bytes]:
    """Named seed inputs (written to fuzz/corpus/metadata by fuzz/make_seeds.py)."""

    def api(mode: int, route: str, body: object, method: str = "POST") -> bytes:
        sel = ROUTES.index(route) | (0x80 if method == "GET" else 0)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return bytes([mode, sel]) + raw

    def http(mode: int, text: bytes) -> bytes:
        return bytes([mode]) + text

    put = b'{"key": "kvctl/a", "value": "aGk=", "lease": null}'
    return {
        "put": api(0, "/v1/put", {"key": "kvctl/a", "value": "aGk=", "lease": None}),
        "put_files": api(1, "/v1/put", {"key": "kvctl/a/\u00e9", "value": "aGk="}),
        "get": api(0, "/v1/get", {"key": "kvctl/a"}),
        "list": api(1, "/v1/list", {"prefix": ""}),
        "delete": api(0, "/v1/delete", {"key": "kvctl/a"}),
        "grant_huge_ttl": api(0, "/v1/lease/grant", b'{"ttl_s": 1' + b"0" * 400 + b"}"),
        "grant_nan": api(0, "/v1/lease/grant", b'{"ttl_s": NaN}'),
        "keepalive_big": api(0, "/v1/lease/keepalive", {"lease": 2**64}),
        "revoke_neg": api(1, "/v1/lease/revoke", {"lease": -1}),
        "put_bad_b64": api(1, "/v1/put", {"key": "k", "value": "!!"}),
        "put_long_key": api(1, "/v1/put", {"key": "k" * 400, "value": ""}),
        "health_get": api(0, "/v1/health", b"", method="GET"),
        "not_json": api(0, "/v1/get", b"\xff\xfe{"),
        "http_put": http(2, b"POST /v1/put HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         + str(len(put)).encode() + b"\r\n\r\n" + put),
        "http_length_2_40": http(2, b"POST /v1/put HTTP/1.1\r\nContent-Length: 1099511627776"
                                 b"\r\n\r\n"),
        "http_length_5000_digits": http(2, b"POST /v1/put HTTP/1.1\r\nContent-Length: "
                                        + b"9" * 5000 + b"\r\n\r\n"),
        "http_chunked": http(2, b"POST /v1/get HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n0\r\n\r\n"),
        "http_keepalive_two": http(2, b"GET /v1/health HTTP/1.1\r\n\r\nGET /v1/health "
                                   b"HTTP/1.1\r\n\r\n"),
        "http_garbage": http(2, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"),
        "http_negative_length": http(2, b"POST /v1/get HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
        "auth_unsigned_put": http(3, b"POST /v1/put HTTP/1.1\r\nContent-Length: "
                                  + str(len(put)).encode() + b"\r\n\r\n" + put),
        "auth_forged": http(3, b"POST /v1/put HTTP/1.1\r\nX-Kvctl-Time: 1\r\nX-Kvctl-Nonce: n"
                            b"\r\nX-Kvctl-Signature: 00\r\nContent-Length: 2\r\n\r\n{}"),
    }


def main() -> None:
    """atheris entry point: ``python -m fuzz.fuzz_metadata [libFuzzer flags] [corpus dirs]``."""
    import logging

    import atheris

    logging.getLogger("kvctl").setLevel(logging.ERROR)
    logging.getLogger(_LOGGER).setLevel(logging.ERROR)
    with atheris.instrument_imports(include=["kvctl"]):
        import kvctl.metadata.file
        import kvctl.metadata.memory
        import kvctl.metadata.server
        import kvctl.net.auth  # noqa: F401
    from fuzz._util import run_atheris

    run_atheris(TestOneInput, sys.argv)


if __name__ == "__main__":
    main()
