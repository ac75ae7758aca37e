"""``redis://[[user]:password@]host:6379[/db]``: leased entries in Redis (redis-py).

Redis has no leases, so they are built from key expiry, with no sweeper on the server:

- an entry ``kvctl/x`` lives in the hash ``kvctl:e:kvctl/x`` = ``{v: value, l: lease id}``;
- a lease lives in the hash ``kvctl:l:<id>`` = ``{ttl: ms, cur: scan cursor,
  "k:<entry>": 1, ...}`` whose fields name the entries put under it, with PEXPIRE = its TTL;
- an entry under a lease is alive while its lease key is: get and list check the lease
  (and delete an entry whose lease is gone), so a keepalive only resets the lease key's
  PEXPIRE: O(1), however many entries share the lease (the old keepalive reset every
  entry's expiry: 72 ms with Redis blocked, at 10^4 entries on one lease);
- entries also carry a backstop PEXPIRE of :data:`BACKSTOP` lease TTLs, so nothing an
  expired lease leaves behind outlives it for long; each keepalive pushes the backstop of
  a bounded slice of the lease's entries further (an HSCAN cursor kept in the lease), so
  every entry of a live lease is pushed well before its backstop comes.

Each of put, get, grant, keepalive, revoke and delete is one Lua script, hence atomic; put,
delete and revoke also PUBLISH each changed entry's name on ``kvctl:w:<db>``, which watches
follow (a watch re-lists then; a lease that expires publishes nothing and is found by the
watch's poll). Prefix listing uses SCAN (never KEYS). Lease ids are random 62-bit numbers,
so a client that held a lease before the server restarted cannot renew another client's
lease. Scripts touch keys computed at run
time, which Redis Cluster does not allow: use a standalone Redis (or one with replicas).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvctl.errors import UnavailableError, UsageError
from kvctl.metadata.base import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
    MetadataOptions,
    register_backend,
    split_endpoints,
)
from kvctl.metadata.watch import DEFAULT_POLL_S, PollingWatch, Watch

if TYPE_CHECKING:
    import redis

T = TypeVar("T")

ENTRY_PREFIX = "kvctl:e:"
LEASE_PREFIX = "kvctl:l:"
#: Pub/sub channel (then the database number) on which writers announce changed entries.
WATCH_CHANNEL = "kvctl:w:"
_SCAN_COUNT = 1000

#: An entry under a lease expires on its own this many lease TTLs after its lease was last
#: seen alive by a keepalive slice (get and list treat it as gone once its lease is).
BACKSTOP = 64
#: Entries whose backstop one keepalive pushes, at least (more on leases holding more
#: entries than BACKSTOP / 3 keepalives can go through).
REFRESH_SLICE = 256

# KEYS[1] entry; ARGV[1] value; with a lease also KEYS[2] lease hash, ARGV[2] lease id and
# ARGV[3] the backstop in lease TTLs.
_PUT = """
local entry = KEYS[1]
if #KEYS == 1 then
  redis.call('DEL', entry)
  redis.call('HSET', entry, 'v', ARGV[1])
  redis.call('PUBLISH', ARGV[#ARGV], entry)
  return 1
end
if redis.call('PTTL', KEYS[2]) <= 0 then return 0 end
local ttl = tonumber(redis.call('HGET', KEYS[2], 'ttl'))
redis.call('DEL', entry)
redis.call('HSET', entry, 'v', ARGV[1], 'l', ARGV[2])
redis.call('PEXPIRE', entry, ttl * tonumber(ARGV[3]))
redis.call('HSET', KEYS[2], 'k:' .. entry, '1')
redis.call('PUBLISH', ARGV[#ARGV], entry)
return 1
"""

# KEYS[1] entry; ARGV[1] the watch channel. 1 when it existed.
_DELETE = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('PUBLISH', ARGV[1], KEYS[1])
return 1
"""

# KEYS[1] entry; ARGV[1] the lease key prefix. The value, or nil when absent or when its
# lease is gone (the entry is deleted then).
_GET = """
local got = redis.call('HMGET', KEYS[1], 'v', 'l')
if not got[1] then return nil end
if got[2] and redis.call('EXISTS', ARGV[1] .. got[2]) == 0 then
  redis.call('DEL', KEYS[1])
  return nil
end
return got[1]
"""

# KEYS[1] lease hash; ARGV[1] ttl in ms. 0 when the id is taken.
_GRANT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'ttl', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS[1] lease hash; ARGV[1] lease id, ARGV[2] the smallest slice, ARGV[3] the backstop in
# lease TTLs. -1 when the lease is gone, else the entries whose backstop this call pushed
# (one slice of the lease's entries, not all of them).
_KEEPALIVE = """
local lease = KEYS[1]
local ttl = tonumber(redis.call('HGET', lease, 'ttl'))
if not ttl then return -1 end
redis.call('PEXPIRE', lease, ttl)
local backstop = tonumber(ARGV[3])
local count = math.max(tonumber(ARGV[2]), math.ceil(redis.call('HLEN', lease) * 3 / backstop))
local cursor = redis.call('HGET', lease, 'cur') or '0'
local scanned = redis.call('HSCAN', lease, cursor, 'COUNT', count)
redis.call('HSET', lease, 'cur', scanned[1])
local pushed = 0
local fields = scanned[2]
for i = 1, #fields, 2 do
  local field = fields[i]
  if string.sub(field, 1, 2) == 'k:' then
    local entry = string.sub(field, 3)
    if redis.call('HGET', entry, 'l') == ARGV[1] then
      redis.call('PEXPIRE', entry, ttl * backstop)
      pushed = pushed + 1
    else
      redis.call('HDEL', lease, field)
    end
  end
end
return pushed
"""

# KEYS[1] lease hash; ARGV[1] lease id, ARGV[2] the watch channel. Deletes the entries
# still bound to the lease.
_REVOKE = """
local lease = KEYS[1]
for _, field in ipairs(redis.call('HKEYS', lease)) do
  if string.sub(field, 1, 2) == 'k:' then
    local entry = string.sub(field, 3)
    if redis.call('HGET', entry, 'l') == ARGV[1] then
      redis.call('DEL', entry)
      redis.call('PUBLISH', ARGV[2], entry)
    end
  end
end
redis.call('DEL', lease)
return 1
"""


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisMetadata(MetadataClient):
    """Leased entries in one Redis database. Thread-safe; ``close()`` is idempotent."""

    def __init__(self, client: redis.Redis, url: str, db: int = 0) -> None:
        self.url = url
        self._redis = client
        self.channel = f"{WATCH_CHANNEL}{db}"  # channels span databases: name ours
        self._scripts = {name: client.register_script(text) for name, text in
                         (("put", _PUT), ("get", _GET), ("grant", _GRANT),
                          ("keepalive", _KEEPALIVE), ("revoke", _REVOKE),
                          ("delete", _DELETE))}
        self._closed = threading.Event()

    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        entry = ENTRY_PREFIX + key
        if lease is None:
            self._run("put", [entry], [bytes(value), self.channel])
            return
        done = self._run("put", [entry, f"{LEASE_PREFIX}{int(lease)}"],
                         [bytes(value), str(int(lease)), BACKSTOP, self.channel])
        if not done:
            raise LeaseExpiredError(f"lease {lease} in {self.url} has expired or never existed",
                                    "grant a new lease and publish again")

    def get(self, key: str) -> bytes | None:
        value = self._run("get", [ENTRY_PREFIX + key], [LEASE_PREFIX])
        return None if value is None else _as_bytes(value)

    def list(self, prefix: str) -> dict[str, bytes]:
        pattern = _glob_escape(ENTRY_PREFIX + prefix) + "*"

        def scan(r: redis.Redis) -> dict[str, bytes]:
            names = sorted(set(r.scan_iter(match=pattern, count=_SCAN_COUNT)))
            pipe = r.pipeline(transaction=False)
            for name in names:
                pipe.hmget(name, "v", "l")
            values = pipe.execute()
            # An entry is alive while its lease is: one EXISTS per distinct lease.
            leases = sorted({_as_bytes(lid) for _, lid in values if lid is not None})
            pipe = r.pipeline(transaction=False)
            for lid in leases:
                pipe.exists(LEASE_PREFIX.encode() + lid)
            alive = {lid for lid, n in zip(leases, pipe.execute(), strict=True) if n}
            found: dict[str, bytes] = {}
            for name, (value, lid) in zip(names, values, strict=True):
                if value is None:  # expired between SCAN and HMGET
                    continue
                if lid is not None and _as_bytes(lid) not in alive:
                    continue
                raw = name.decode("utf-8", errors="replace")
                found[raw[len(ENTRY_PREFIX):]] = _as_bytes(value)
            return found

        return self._do(scan)

    def delete(self, key: str) -> bool:
        return bool(self._run("delete", [ENTRY_PREFIX + key], [self.channel]))

    def grant_lease(self, ttl_s: float) -> LeaseId:
        if not ttl_s > 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        ttl_ms = max(1, round(ttl_s * 1000))
        for _ in range(8):
            lease = LeaseId(secrets.randbits(62) + 1)
            if self._run("grant", [f"{LEASE_PREFIX}{lease}"], [ttl_ms]):
                return lease
        raise MetadataError(f"redis {self.url} kept refusing new lease ids",  # pragma: no cover
                            "check for other writers under the kvctl:l: prefix")

    def keepalive(self, lease: LeaseId) -> None:
        renewed = self._run("keepalive", [f"{LEASE_PREFIX}{int(lease)}"],
                            [str(int(lease)), REFRESH_SLICE, BACKSTOP])
        if int(renewed) < 0:
            raise LeaseExpiredError(f"lease {lease} in {self.url} has expired",
                                    "grant a new lease and republish")

    def revoke(self, lease: LeaseId) -> None:
        self._run("revoke", [f"{LEASE_PREFIX}{int(lease)}"], [str(int(lease)), self.channel])

    def watch(self, prefixes: str | Sequence[str], *, poll_s: float = DEFAULT_POLL_S) -> Watch:
        """Listings diffed as by polling, taken as soon as kvctl's writers announce a change
        on the pub/sub channel :attr:`channel` (puts, deletes and revokes publish the key),
        and every ``poll_s`` otherwise: a lease that expires announces nothing."""
        return _RedisWatch(self, prefixes, poll_s=poll_s)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._redis.close()

    # -- helpers ----------------------------------------------------------------------

    def _run(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self._do(lambda r: self._scripts[script](keys=keys, args=args, client=r))

    def _do(self, call: Callable[[redis.Redis], T]) -> T:
        import redis.exceptions as rex

        if self._closed.is_set():
            raise MetadataError(f"metadata client {self.url} is closed",
                                "open a new client with open_metadata()")
        try:
            return call(self._redis)
        except rex.AuthenticationError as exc:
            raise MetadataError(f"redis {self.url} refused the credentials: {exc}",
                                "put the right password in the URL: redis://:PASSWORD@HOST:PORT"
                                ) from None
        except (rex.ConnectionError, rex.TimeoutError) as exc:
            raise MetadataError(
                f"cannot reach redis at {self.url}: {exc}",
                "check that redis-server is running and listening on that address",
            ) from None
        except rex.RedisError as exc:
            raise MetadataError(f"redis {self.url} failed: {exc}",
                                "check the redis server's log and that it is Redis 6.2 or later"
                                ) from None


class _RedisWatch(PollingWatch):
    def __init__(self, client: RedisMetadata, prefixes: str | Sequence[str], *,
                 poll_s: float) -> None:
        super().__init__(client, prefixes, poll_s=poll_s)
        self._client = client
        self._entry_prefixes = tuple(ENTRY_PREFIX + p for p in self.prefixes)
        self._pubsub: Any = None
        self._stopped = threading.Event()
        with contextlib.suppress(MetadataError):  # unreachable now: polled until it is back
            self._subscribe()
        threading.Thread(target=self._listen, daemon=True,
                         name=f"kvctl-redis-watch-{self.prefixes[0]}").start()

    def _subscribe(self) -> None:
        def subscribe(r: redis.Redis) -> Any:
            pubsub = r.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            pubsub.subscribe(self._client.channel)
            return pubsub

        self._pubsub = self._client._do(subscribe)
        self.nudge()  # writes before the subscription: list once more

    def _listen(self) -> None:
        import redis.exceptions as rex

        while not self._stopped.is_set():
            pubsub = self._pubsub
            try:
                if pubsub is None:
                    self._subscribe()
                    continue
                message = pubsub.get_message(timeout=1.0)
            except (MetadataError, rex.RedisError, OSError, ValueError):
                self._pubsub = None
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                self._stopped.wait(1.0)
                continue
            if message and message.get("type") == "message" and \
                    _as_bytes(message.get("data", b"")).decode(
                        "utf-8", errors="replace").startswith(self._entry_prefixes):
                self.nudge()
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()

    def close(self) -> None:
        self._stopped.set()
        super().close()


def _connect(host: str, port: int, db: int, parsed: urllib.parse.SplitResult,
             timeout_s: float) -> redis.Redis:
    try:
        import redis
        from redis.backoff import ConstantBackoff
        from redis.retry import Retry
    except ImportError as exc:
        raise UnavailableError(
            f"redis:// metadata is unavailable: the redis package is missing ({exc})",
            "install it with: pip install 'redis>=5'",
        ) from None
    return redis.Redis(
        host=host, port=port, db=db,
        username=urllib.parse.unquote(parsed.username) if parsed.username else None,
        password=urllib.parse.unquote(parsed.password) if parsed.password else None,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        # One quick retry on a fresh connection: after a server restart the pooled
        # connections are dead, and the next call should just work.
        retry=Retry(ConstantBackoff(0.05), 1),
        health_check_interval=30,
    )


@register_backend("redis")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    endpoints = split_endpoints(parsed, url, default_port=6379)
    if len(endpoints) != 1:
        raise UsageError(f"metadata URL {url!r} names several hosts",
                         "redis:// takes one host: redis://HOST:6379[/DB]")
    db_text = parsed.path.strip("/")
    if db_text and not (db_text.isascii() and db_text.isdigit()):
        raise UsageError(f"metadata URL {url!r} has a bad database number {db_text!r}",
                         "write redis://HOST:6379/0 (a number) or leave it out")
    host, port = endpoints[0]
    shown = url if parsed.password is None else url.replace(parsed.password, "***", 1)
    client = _connect(host, port, int(db_text or 0), parsed, options.timeout_s)
    return RedisMetadata(client, shown, int(db_text or 0))
