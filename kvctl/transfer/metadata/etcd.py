"""``etcd://host:2379[,host2:2379]``: etcd v3 through its JSON gRPC gateway.

etcd (3.4 and later) serves its v3 API as JSON on the client port: ``/v3/kv/put``,
``/v3/kv/range``, ``/v3/kv/deleterange``, ``/v3/lease/grant``, ``/v3/lease/keepalive`` and
``/v3/lease/revoke``, with keys and values in base64 and 64-bit integers as strings.

This backend speaks it with the stdlib ``http.client`` (keep-alive, timeouts) rather than the
``etcd3gw`` package: kvctl needs six calls, failover across several endpoints (``etcd3gw``
talks to one host), and the same error mapping as the ``http://`` backend; ``etcd3gw`` would
add ``requests``, ``futurist`` and ``pbr`` for none of that. When an endpoint refuses, resets
or times out, the call moves on to the next one and sticks with whichever answered.

etcd grants whole-second TTLs and enforces a minimum (1.5 x the election timeout, 2 s with
default flags), so a lease may last a little longer than asked.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import contextlib
import dataclasses
import json
import math
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

from kvctl.errors import UsageError
from kvctl.transfer.metadata._httpclient import EndpointDown, HttpPool
from kvctl.transfer.metadata.base import (
    DEFAULT_TIMEOUT_S,
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
    MetadataOptions,
    register_backend,
    split_endpoints,
)

_LEASE_NOT_FOUND = "requested lease not found"


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's ``range_end`` for every key starting with ``prefix`` (``b"\\0"``: to the end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


@dataclasses.dataclass(frozen=True)
class EtcdPage:
    """One page of a range read (:meth:`EtcdMetadata.list_page`).

    Attributes:
        entries: ``(key, value)`` pairs in key order.
        more: whether keys follow this page.
        revision: the store revision the page was read at.
        remaining: keys in the range from this page's first on (etcd counts them all).
    """

    entries: Sequence[tuple[str, bytes]]
    more: bool
    revision: int
    remaining: int


class EtcdMetadata(MetadataClient):
    """Leased entries in an etcd v3 cluster. Thread-safe; ``close()`` is idempotent."""

    def __init__(self, endpoints: list[tuple[str, int]], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, url: str | None = None) -> None:
        if not endpoints:
            raise UsageError("etcd metadata needs at least one endpoint",
                             "write e.g. etcd://127.0.0.1:2379")
        self.url = url or "etcd://" + ",".join(f"{h}:{p}" for h, p in endpoints)
        self._pools = [HttpPool(host, port, timeout_s) for host, port in endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        request: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease is not None:
            request["lease"] = str(int(lease))
        self._call("kv/put", request)

    def get(self, key: str) -> bytes | None:
        kvs = self._call("kv/range", {"key": _b64(key.encode())}).get("kvs") or []
        for kv in kvs:
            return self._unb64(kv.get("value", ""))
        return None

    def list(self, prefix: str) -> dict[str, bytes]:
        start = prefix.encode() or b"\0"
        answer = self._call("kv/range", {"key": _b64(start),
                                          "range_end": _b64(prefix_range_end(prefix.encode()))})
        found: dict[str, bytes] = {}
        for kv in answer.get("kvs") or []:
            key = self._unb64(kv.get("key", "")).decode("utf-8", errors="replace")
            found[key] = self._unb64(kv.get("value", ""))
        return dict(sorted(found.items()))

    def list_page(self, prefix: str, *, after: str | None = None, limit: int = 1000,
                  revision: int = 0) -> EtcdPage:
        """One page of the keys under ``prefix`` in key order: at most ``limit`` entries
        after the key ``after`` (from the first when ``None``), read at ``revision`` (0:
        the newest; pass the revision of the first page to read every page at one
        moment)."""
        start = prefix.encode() if after is None else after.encode() + b"\0"
        request: dict[str, Any] = {"key": _b64(start or b"\0"),
                                   "range_end": _b64(prefix_range_end(prefix.encode())),
                                   "limit": str(limit)}
        if revision:
            request["revision"] = str(revision)
        answer = self._call("kv/range", request)
        entries = [(self._unb64(kv.get("key", "")).decode("utf-8", errors="replace"),
                    self._unb64(kv.get("value", ""))) for kv in answer.get("kvs") or []]
        read_at = int((answer.get("header") or {}).get("revision", revision) or 0)
        return EtcdPage(entries, bool(answer.get("more")), read_at,
                        int(answer.get("count", len(entries)) or 0))

    def write_batch(self, changes: Sequence[tuple[str, bytes | None]]) -> None:
        """Puts (a value) and deletes (``None``) of distinct keys in one transaction: all
        of them or none. etcd refuses more than ``--max-txn-ops`` (128 by default) changes
        or ``--max-request-bytes`` (1.5 MiB) in one."""
        # Built as text (base64 needs no JSON escaping): a third of json.dumps's time, and
        # this runs for every change a store master records.
        ops: builtins.list[str] = []
        for key, value in changes:
            if value is None:
                ops.append(f'{{"request_delete_range":{{"key":"{_b64(key.encode())}"}}}}')
            else:
                ops.append(f'{{"request_put":{{"key":"{_b64(key.encode())}",'
                           f'"value":"{_b64(value)}"}}}}')
        self._call_body("kv/txn", ('{"success":[' + ",".join(ops) + "]}").encode())

    def delete(self, key: str) -> bool:
        answer = self._call("kv/deleterange", {"key": _b64(key.encode())})
        return int(answer.get("deleted", 0)) > 0

    def grant_lease(self, ttl_s: float) -> LeaseId:
        if not ttl_s > 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        answer = self._call("lease/grant", {"TTL": str(max(1, math.ceil(ttl_s)))})
        if answer.get("error"):
            raise MetadataError(f"etcd {self.url} refused a lease: {answer['error']}",
                                "check the etcd server's log")
        try:
            return LeaseId(int(answer["ID"]))
        except (KeyError, TypeError, ValueError):
            raise self._bad_answer("lease grant without an ID") from None

    def keepalive(self, lease: LeaseId) -> None:
        answer = self._call("lease/keepalive", {"ID": str(int(lease))})
        result = answer.get("result", answer)
        if not isinstance(result, dict) or int(result.get("TTL", 0)) <= 0:
            raise LeaseExpiredError(f"lease {lease} in {self.url} has expired",
                                    "grant a new lease and republish")

    def revoke(self, lease: LeaseId) -> None:
        with contextlib.suppress(LeaseExpiredError):  # already gone: revoking is idempotent
            self._call("lease/revoke", {"ID": str(int(lease))})

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for pool in self._pools:
            pool.close()

    # -- transport ----------------------------------------------------------------------

    def _call(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        return self._call_body(path, json.dumps(request).encode())

    def _call_body(self, path: str, body: bytes) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise MetadataError(f"metadata client {self.url} is closed",
                                    "open a new client with open_metadata()")
            first = self._current
        failures: list[str] = []
        for step in range(len(self._pools)):
            index = (first + step) % len(self._pools)
            pool = self._pools[index]
            try:
                reply = pool.request("POST", "/v3/" + path, body)
            except EndpointDown as exc:
                failures.append(f"{exc.endpoint} {exc.reason}")
                continue
            if reply.status == 503:  # no leader, or the member is stopping: try another
                failures.append(f"{pool.endpoint} unavailable (HTTP 503)")
                continue
            with self._lock:
                self._current = index
            return self._answer(path, reply.status, reply.body)
        raise MetadataError(
            f"cannot reach etcd at {self.url}: {'; '.join(failures)}",
            "check that etcd is running and that its client URL (--advertise-client-urls) "
            "matches the metadata URL",
        )

    def _answer(self, path: str, status: int, body: bytes) -> dict[str, Any]:
        # Streaming calls (keepalive) answer newline-separated JSON messages: take the first.
        text = body.decode("utf-8", errors="replace").strip().split("\n", 1)[0]
        try:
            answer = json.loads(text) if text else {}
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise self._bad_answer(f"HTTP {status} with a non-JSON body to {path}")
        error = answer.get("error")  # a dict in streamed answers, a string otherwise
        if status == 200 and not isinstance(error, dict):
            return answer
        if isinstance(error, dict):
            message = str(error.get("message") or error)[:300]
        else:
            message = str(answer.get("message") or error or f"HTTP {status}")[:300]
        if _LEASE_NOT_FOUND in message:
            raise LeaseExpiredError(f"etcd {self.url}: {message}",
                                    "grant a new lease and publish again")
        raise MetadataError(f"etcd {self.url} failed {path}: {message}",
                            "check the etcd server's log and that it runs v3.4 or later")

    def _unb64(self, text: str) -> bytes:
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError):
            raise self._bad_answer("a key or value that is not base64") from None

    def _bad_answer(self, what: str) -> MetadataError:
        return MetadataError(f"etcd {self.url} gave a bad answer: {what}",
                             "check that the URL points at an etcd v3 client port")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@register_backend("etcd")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    if parsed.path not in ("", "/"):
        raise UsageError(f"metadata URL {url!r} has a path; etcd URLs name endpoints only",
                         "write etcd://HOST:2379[,HOST2:2379]")
    endpoints = split_endpoints(parsed, url, default_port=2379)
    return EtcdMetadata(endpoints, timeout_s=options.timeout_s, url=url)
