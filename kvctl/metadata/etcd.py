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
import http.client
import json
import logging
import math
import socket
import threading
import urllib.parse
from collections.abc import Sequence
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
from kvctl.metadata.watch import (
    DEFAULT_POLL_S,
    Change,
    QueueWatch,
    Snapshot,
    Watch,
    WatchEvent,
)

_log = logging.getLogger(__name__)

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
        self.timeout_s = timeout_s
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
                  revision: int = 0, start: str | None = None) -> EtcdPage:
        """One page of the keys under ``prefix`` in key order: at most ``limit`` entries
        after the key ``after`` (from ``start``, or the first, when ``None``), read at
        ``revision`` (0: the newest; pass the revision of the first page to read every
        page at one moment)."""
        first = (start or prefix).encode() if after is None else after.encode() + b"\0"
        request: dict[str, Any] = {"key": _b64(first or b"\0"),
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

    def modified_after(self, prefix: str, mod_revision: int, *, revision: int = 0
                       ) -> str | None:
        """A key under ``prefix`` last modified after ``mod_revision`` (read at
        ``revision``; 0: the newest), or ``None``. (etcd filters by mod revision after
        counting, so ``count`` would not say; it reads the whole range to filter it.)"""
        request: dict[str, Any] = {"key": _b64(prefix.encode() or b"\0"),
                                   "range_end": _b64(prefix_range_end(prefix.encode())),
                                   "keys_only": True, "limit": "1",
                                   "min_mod_revision": str(mod_revision + 1)}
        if revision:
            request["revision"] = str(revision)
        for kv in self._call("kv/range", request).get("kvs") or []:
            return self._unb64(kv.get("key", "")).decode("utf-8", errors="replace")
        return None

    def write_batch(self, changes: Sequence[tuple[str, bytes | None]], *,
                    guard: tuple[str, int] | None = None,
                    delete_ranges: Sequence[tuple[str, str]] = ()) -> bool:
        """Puts (a value) and deletes (``None``) of distinct keys, and deletes of the key
        ranges ``[start, end)`` in ``delete_ranges``, in one transaction: all of them or
        none. etcd refuses more than ``--max-txn-ops`` (128 by default) operations or
        ``--max-request-bytes`` (1.5 MiB) in one.

        With ``guard`` (key, revision) the transaction applies only while that key's mod
        revision is still ``revision`` (a leader fencing its writes by its term);
        ``False`` when it was not applied for that reason."""
        # Built as text (base64 needs no JSON escaping): a third of json.dumps's time, and
        # this runs for every change a store master records.
        ops: builtins.list[str] = [
            f'{{"request_delete_range":{{"key":"{_b64(start.encode())}",'
            f'"range_end":"{_b64(end.encode())}"}}}}' for start, end in delete_ranges]
        for key, value in changes:
            if value is None:
                ops.append(f'{{"request_delete_range":{{"key":"{_b64(key.encode())}"}}}}')
            else:
                ops.append(f'{{"request_put":{{"key":"{_b64(key.encode())}",'
                           f'"value":"{_b64(value)}"}}}}')
        compare = ""
        if guard is not None:
            compare = (f'"compare":[{{"key":"{_b64(guard[0].encode())}","result":"EQUAL",'
                       f'"target":"MOD","mod_revision":"{int(guard[1])}"}}],')
        answer = self._call_body(
            "kv/txn", ("{" + compare + '"success":[' + ",".join(ops) + "]}").encode())
        return guard is None or bool(answer.get("succeeded"))

    def get_entry(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and mod revision, or ``None`` when it is absent."""
        kvs = self._call("kv/range", {"key": _b64(key.encode())}).get("kvs") or []
        for kv in kvs:
            return self._unb64(kv.get("value", "")), int(kv.get("mod_revision", 0) or 0)
        return None

    def claim(self, key: str, value: bytes, *, lease: LeaseId, term_key: str,
              replace: int = 0, term: int = 0) -> tuple[bool, int]:
        """One transaction of a leader election: put ``key`` = ``value`` under ``lease``
        only if ``key`` is absent (or, with ``replace``, still at that mod revision).
        Without ``term`` ``term_key`` is put too (a new term); with it, the claim also
        needs ``term_key`` still at mod revision ``term`` and leaves it alone (a leader
        whose lease lapsed takes the key back, keeping its term, if nobody claimed since).
        ``(won, revision)``: the transaction's revision when won (a new term's number),
        else ``term_key``'s mod revision (the current term; 0: never claimed)."""
        encoded, encoded_term = _b64(key.encode()), _b64(term_key.encode())
        compare = [{"key": encoded, "result": "EQUAL", "target": "MOD",
                    "mod_revision": str(replace)} if replace else
                   {"key": encoded, "result": "EQUAL", "target": "CREATE",
                    "create_revision": "0"}]
        success = [{"request_put": {"key": encoded, "value": _b64(value),
                                    "lease": str(int(lease))}}]
        if term:
            compare.append({"key": encoded_term, "result": "EQUAL", "target": "MOD",
                            "mod_revision": str(term)})
        else:
            success.append({"request_put": {"key": encoded_term, "value": _b64(value)}})
        answer = self._call("kv/txn", {"compare": compare, "success": success,
                                        "failure": [{"request_range": {"key": encoded_term}}]})
        if answer.get("succeeded"):
            return True, int((answer.get("header") or {}).get("revision", 0) or 0)
        for response in answer.get("responses") or []:
            for kv in (response.get("response_range") or {}).get("kvs") or []:
                return False, int(kv.get("mod_revision", 0) or 0)
        return False, 0

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

    def watch(self, prefixes: str | Sequence[str], *, poll_s: float = DEFAULT_POLL_S) -> Watch:
        """Pushed: one ``/v3/watch`` stream per prefix (see :class:`_EtcdWatch`); lease
        expiries arrive as deletions the moment etcd revokes the lease."""
        if not poll_s > 0:
            raise ValueError(f"watch poll interval {poll_s} s is not positive")
        return _EtcdWatch(self, prefixes)

    def endpoints(self) -> builtins.list[tuple[str, int]]:
        """The endpoints, the one that answered last first."""
        with self._lock:
            first = self._current
        pools = self._pools[first:] + self._pools[:first]
        return [(p.host, p.port) for p in pools]

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
        raise MetadataError(f"etcd {self.url} failed {path}: {message}", _hint_for(message))

    def _unb64(self, text: str) -> bytes:
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError):
            raise self._bad_answer("a key or value that is not base64") from None

    def _bad_answer(self, what: str) -> MetadataError:
        return MetadataError(f"etcd {self.url} gave a bad answer: {what}",
                             "check that the URL points at an etcd v3 client port")


#: Seconds a watch stream may stay silent before it is reopened (from the revision it
#: reached, so nothing is missed): how long a watch can sit on a dead connection.
WATCH_IDLE_S = 30.0
#: Largest watch message read (etcd batches a revision's events: a 128-change transaction
#: of values near etcd's 1.5 MiB request limit stays under it).
WATCH_MESSAGE_MAX_CHARS = 256 << 20
#: Longest wait between attempts to reopen a broken watch stream.
WATCH_RETRY_MAX_S = 5.0


class _EtcdWatch(QueueWatch):
    """etcd's watch API through the JSON gateway: per prefix, a range read (the snapshot,
    at revision R) and a ``POST /v3/watch`` from R+1, whose chunked answer streams JSON
    messages of events. A stream that breaks, or is silent for :data:`WATCH_IDLE_S`, is
    reopened from the revision it had reached; one etcd can no longer serve from there
    (compacted) is restarted with a new snapshot. Endpoints are tried in turn."""

    def __init__(self, client: EtcdMetadata, prefixes: str | Sequence[str]) -> None:
        super().__init__(prefixes, on_close=self._interrupt)
        self._client = client
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._conns_lock = threading.Lock()
        self._next: dict[str, int | None] = {}  # prefix -> the next revision it watches from
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._follow, args=(p,), daemon=True,
                                          name=f"kvctl-etcd-watch-{p}")
                         for p in self.prefixes]
        for thread in self._threads:
            thread.start()

    def _interrupt(self) -> None:
        self._stop.set()
        with self._conns_lock:
            conns = list(self._conns.values())
        for conn in conns:  # wakes the reader blocked in recv()
            with contextlib.suppress(OSError):
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)

    def _follow(self, prefix: str) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                revision = self._next.get(prefix)  # where to watch from (None: snapshot)
                if revision is None:
                    revision = self._next[prefix] = self._snapshot(prefix)
                self._next[prefix] = self._stream(prefix, revision)
                backoff = 0.2
            except MetadataError as exc:
                if self._stop.is_set():
                    return
                self.fail(exc)
                self._stop.wait(backoff)
                backoff = min(WATCH_RETRY_MAX_S, backoff * 2)

    def _snapshot(self, prefix: str) -> int:
        answer = self._client._call("kv/range", {
            "key": _b64(prefix.encode() or b"\0"),
            "range_end": _b64(prefix_range_end(prefix.encode()))})
        entries = {self._client._unb64(kv.get("key", "")).decode("utf-8", errors="replace"):
                   self._client._unb64(kv.get("value", "")) for kv in answer.get("kvs") or []}
        self.push([Snapshot(prefix, entries)])
        return int((answer.get("header") or {}).get("revision", 0) or 0) + 1

    def _stream(self, prefix: str, revision: int) -> int | None:
        """Follow one stream from ``revision``; returns where to go on from (``None``: take
        a new snapshot first).

        Raises:
            MetadataError: no endpoint accepted the stream, or it broke.
        """
        body = json.dumps({"create_request": {
            "key": _b64(prefix.encode() or b"\0"),
            "range_end": _b64(prefix_range_end(prefix.encode())),
            "start_revision": str(revision)}}).encode()
        failures: list[str] = []
        for host, port in self._client.endpoints():
            conn = http.client.HTTPConnection(host, port, timeout=self._client.timeout_s)
            with self._conns_lock:
                self._conns[prefix] = conn
            try:
                if self._stop.is_set():
                    return revision
                conn.request("POST", "/v3/watch", body=body,
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                if response.status != 200:
                    failures.append(f"{host}:{port} HTTP {response.status}")
                    continue
                if conn.sock is not None:
                    conn.sock.settimeout(WATCH_IDLE_S)
                return self._read(prefix, response, revision)
            except TimeoutError:
                return revision  # silent for WATCH_IDLE_S (or a slow connect): reopen
            except (OSError, http.client.HTTPException) as exc:
                if self._stop.is_set():
                    return revision
                failures.append(f"{host}:{port} {type(exc).__name__}: {exc}")
            finally:
                with self._conns_lock:
                    self._conns.pop(prefix, None)
                conn.close()
        raise MetadataError(f"cannot watch {prefix} in etcd at {self._client.url}: "
                            f"{'; '.join(failures) or 'no endpoint'}",
                            "check that etcd is running; the watch retries on its own")

    def _read(self, prefix: str, response: http.client.HTTPResponse, revision: int
              ) -> int | None:
        decoder = json.JSONDecoder()
        buffer = ""
        while not self._stop.is_set():
            chunk = response.read1(65536)
            if not chunk:
                raise MetadataError(f"etcd {self._client.url} closed the watch of {prefix}",
                                    "the watch reopens on its own")
            buffer += chunk.decode("utf-8", errors="replace")
            while True:
                buffer = buffer.lstrip()
                if not buffer:
                    break
                if not buffer.startswith("{"):
                    raise MetadataError(f"etcd {self._client.url} sent a watch answer that "
                                        f"is not JSON: {buffer[:80]!r}",
                                        "check that the URL points at an etcd v3 client port")
                try:
                    message, end = decoder.raw_decode(buffer)
                except ValueError:
                    if len(buffer) > WATCH_MESSAGE_MAX_CHARS:
                        raise MetadataError(
                            f"etcd {self._client.url} sent a watch message over "
                            f"{WATCH_MESSAGE_MAX_CHARS >> 20} MiB", "check the etcd server"
                        ) from None
                    break  # the rest of the message has not arrived yet
                buffer = buffer[end:]
                step = self._message(prefix, message, revision)
                self._next[prefix] = step  # a stream that breaks next resumes from here
                if step is None:
                    return None
                revision = step
        return revision

    def _message(self, prefix: str, message: Any, revision: int) -> int | None:
        result = message.get("result") if isinstance(message, dict) else None
        if not isinstance(result, dict):
            error = message.get("error") if isinstance(message, dict) else message
            raise MetadataError(f"etcd {self._client.url} ended the watch of {prefix}: "
                                f"{str(error)[:200]}", "the watch reopens on its own")
        header_revision = int((result.get("header") or {}).get("revision", 0) or 0)
        if result.get("created") and 0 < header_revision < revision - 1:
            # etcd is behind what this watch saw: it lost its data (restarted empty), and
            # would stay silent until it caught up with the old revision
            _log.info("watch of %s restarts from a snapshot (etcd went back from revision "
                      "%d to %d)", prefix, revision - 1, header_revision)
            return None
        if result.get("canceled") or result.get("compact_revision"):
            _log.info("watch of %s restarts from a snapshot (%s)", prefix,
                      result.get("cancel_reason") or "history compacted")
            return None
        changes: builtins.list[Change] = []
        for event in result.get("events") or []:
            kv = event.get("kv") or {}
            key = self._client._unb64(kv.get("key", "")).decode("utf-8", errors="replace")
            if event.get("type") == "DELETE":
                changes.append(WatchEvent(key, None))
            else:
                changes.append(WatchEvent(key, self._client._unb64(kv.get("value", ""))))
            revision = max(revision, int(kv.get("mod_revision", 0) or 0) + 1)
        if changes:
            self.push(changes)
        return revision


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@register_backend("etcd")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    if parsed.path not in ("", "/"):
        raise UsageError(f"metadata URL {url!r} has a path; etcd URLs name endpoints only",
                         "write etcd://HOST:2379[,HOST2:2379]")
    endpoints = split_endpoints(parsed, url, default_port=2379)
    return EtcdMetadata(endpoints, timeout_s=options.timeout_s, url=url)


#: etcd's answers that say what to do, by a phrase in their message.
_HINTS = (
    ("database space exceeded",
     "etcd reached its backend quota (--quota-backend-bytes) and takes no writes: compact "
     "old revisions (etcdctl compact REV), defragment each member (etcdctl defrag), then "
     "etcdctl alarm disarm; see docs/store.md, State"),
    ("request is too large",
     "the request is over etcd's --max-request-bytes; raise it (1.5 MiB by default)"),
    ("too many operations in txn",
     "the transaction is over etcd's --max-txn-ops; raise it (128 by default)"),
    ("required revision has been compacted",
     "etcd compacted the revision being read; try again (and compact less often)"),
)


def _hint_for(message: str) -> str:
    for phrase, hint in _HINTS:
        if phrase in message:
            return hint
    return "check the etcd server's log and that it runs v3.4 or later"

