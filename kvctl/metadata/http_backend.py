"""``http://host:port``: the client of kvctl's own metadata server (:mod:`.server`).

Requests go over keep-alive HTTP/1.1 connections (stdlib ``http.client``), each with a
timeout; with a token every request is signed (:func:`kvctl.net.auth.sign_request`) and
every answer must carry the server's signature bound to that request
(:func:`kvctl.net.auth.check_reply`), or the call fails.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import urllib.parse
from typing import Any

from kvctl.errors import UsageError
from kvctl.metadata._httpclient import EndpointDown, HttpPool
from kvctl.metadata.base import (
    DEFAULT_TIMEOUT_S,
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
    MetadataOptions,
    register_backend,
    split_endpoints,
)
from kvctl.net.auth import check_reply, sign_request


class HttpMetadata(MetadataClient):
    """A client of ``kvctl metadata serve``. Thread-safe; ``close()`` is idempotent."""

    def __init__(self, host: str, port: int, *, token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, url: str | None = None) -> None:
        self.url = url or f"http://{host}:{port}"
        self._token = token
        self._pool = HttpPool(host, port, timeout_s)
        self._closed = threading.Event()

    def __repr__(self) -> str:
        return f"HttpMetadata(url={self.url!r}, signed={self._token is not None})"

    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        self._call("/v1/put", {"key": key, "value": base64.b64encode(value).decode(),
                               "lease": None if lease is None else int(lease)})

    def get(self, key: str) -> bytes | None:
        value = self._call("/v1/get", {"key": key}).get("value")
        return None if value is None else _b64(value, self.url)

    def list(self, prefix: str) -> dict[str, bytes]:
        entries = self._call("/v1/list", {"prefix": prefix}).get("entries")
        if not isinstance(entries, dict):
            raise self._bad_answer("list without entries")
        return {str(k): _b64(v, self.url) for k, v in sorted(entries.items())}

    def delete(self, key: str) -> bool:
        return bool(self._call("/v1/delete", {"key": key}).get("deleted"))

    def grant_lease(self, ttl_s: float) -> LeaseId:
        if not ttl_s > 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        lease = self._call("/v1/lease/grant", {"ttl_s": ttl_s}).get("lease")
        if not isinstance(lease, int):
            raise self._bad_answer("grant without a lease id")
        return LeaseId(lease)

    def keepalive(self, lease: LeaseId) -> None:
        self._call("/v1/lease/keepalive", {"lease": int(lease)})

    def revoke(self, lease: LeaseId) -> None:
        self._call("/v1/lease/revoke", {"lease": int(lease)})

    def health(self) -> dict[str, Any]:
        """The server's health answer (``{"ok": true, "version": ...}``)."""
        return self._call("/v1/health", None)

    def close(self) -> None:
        self._closed.set()
        self._pool.close()

    def _call(self, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        if self._closed.is_set():
            raise MetadataError(f"metadata client {self.url} is closed",
                                "open a new client with open_metadata()")
        method = "GET" if payload is None else "POST"
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = sign_request(self._token, method, path, body) if self._token else {}
        try:
            reply = self._pool.request(method, path, body, headers)
        except EndpointDown as exc:
            hint = ("start it with 'kvctl metadata serve --listen HOST:PORT', or point "
                    "--metadata / KVCTL_METADATA at a running one")
            raise MetadataError(
                f"cannot reach metadata server {self.url}: {exc.reason}", hint
            ) from None
        if self._token and not check_reply(self._token, headers["X-Kvctl-Signature"],
                                           reply.status, reply.body, reply.signature):
            # Checked before the answer is read (issue 27.6: a relay answered a signed put
            # with a forged 200 and held the put back; a forged get answer was taken).
            if not reply.signature:
                cause = (f"metadata server {self.url} sent an unsigned answer (HTTP "
                         f"{reply.status}) to a signed request: it is not signed with this "
                         "host's token")
                hint = ("set the same KVCTL_TOKEN on the metadata server as here (a server "
                        "without a token signs nothing); if it has one, upgrade it (an older "
                        "kvctl does not sign answers) or look for something between the "
                        "hosts that forges answers; the request may or may not have been "
                        "applied")
            else:
                cause = (f"metadata server {self.url} sent a wrongly signed answer (HTTP "
                         f"{reply.status}) to a signed request")
                hint = ("the server runs with another KVCTL_TOKEN, or something between the "
                        "hosts forges or replays answers; the request may or may not have "
                        "been applied")
            raise MetadataError(cause, hint)
        try:
            answer = json.loads(reply.body) if reply.body else {}
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise self._bad_answer(f"HTTP {reply.status} with a non-JSON body")
        if reply.status == 200:
            return answer
        message = str(answer.get("message", ""))[:300]
        if reply.status == 401:
            raise MetadataError(
                f"metadata server {self.url} refused the request: {message or 'unauthorized'}",
                "set KVCTL_TOKEN (or common.token) to the server's token; check the clocks",
            )
        if reply.status == 409:
            raise LeaseExpiredError(f"{message} (server {self.url})",
                                    "grant a new lease and publish again")
        raise MetadataError(f"metadata server {self.url} answered HTTP {reply.status}: {message}",
                            "see the server's log (kvctl -v metadata serve)")

    def _bad_answer(self, what: str) -> MetadataError:
        return MetadataError(f"metadata server {self.url} gave a bad answer: {what}",
                             "check that the URL points at 'kvctl metadata serve'")


def _b64(value: Any, url: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except binascii.Error:
        raise MetadataError(f"metadata server {url} sent a value that is not base64",
                            "check that the URL points at 'kvctl metadata serve'") from None


@register_backend("http")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    endpoints = split_endpoints(parsed, url, default_port=None)
    if len(endpoints) != 1 or parsed.path not in ("", "/"):
        raise UsageError(f"metadata URL {url!r} must be http://HOST:PORT",
                         "kvctl's metadata server takes one host and no path")
    host, port = endpoints[0]
    return HttpMetadata(host, port, token=options.token, timeout_s=options.timeout_s,
                        url=f"http://{parsed.netloc}")
