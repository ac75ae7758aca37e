"""Keep a lease alive, and the entries published under it, from a daemon thread.

::

    with LeaseKeeper(client, ttl_s=10).start() as keeper:
        keeper.publish("kvctl/segments/host-a", descriptor_json)
        ...  # entries stay while this process lives; they vanish TTL seconds after it dies

The keeper renews the lease every ``ttl_s / 3``. When the service says the lease is gone (it
restarted and lost its state, or the process stalled past the TTL) or no renewal succeeded
for a whole TTL, the keeper grants a new lease and publishes every entry again. ``stop()``
revokes the lease, removing the entries at once. Every ``RESTORE_EVERY`` renewals it also
reads its entries back and puts any that someone else rewrote or deleted (a tokenless
rewrite of a signed descriptor is refused by readers; this brings the real one back).
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Self

from kvctl.errors import UsageError
from kvctl.metadata.base import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
)

_log = logging.getLogger(__name__)

#: Renewals between read-backs of the published entries.
RESTORE_EVERY = 3


class LeaseKeeper:
    """One lease kept alive by a heartbeat thread, and the entries that ride on it.

    Args:
        client: the metadata service (stays open; the keeper does not close it).
        ttl_s: lease time to live, in seconds: how long entries outlive a crash.
        interval_s: seconds between renewals (``ttl_s / 3`` when ``None``).
        name: thread name, for logs and debuggers.
    """

    def __init__(self, client: MetadataClient, ttl_s: float, *, interval_s: float | None = None,
                 name: str = "kvctl-lease-keeper") -> None:
        if not ttl_s > 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        interval = ttl_s / 3 if interval_s is None else interval_s
        if not 0 < interval < ttl_s:
            raise UsageError(f"renewal interval {interval} s is not below the TTL {ttl_s} s",
                             "renew a few times per TTL, e.g. every TTL/3")
        self.client = client
        self.ttl_s = ttl_s
        self.interval_s = interval
        self._name = name
        self._entries: dict[str, bytes] = {}
        self._lease: LeaseId | None = None
        self._lost = False
        self._last_renewal = 0.0
        self._regrants = 0
        self._renewals = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def __repr__(self) -> str:
        return f"LeaseKeeper(url={self.client.url!r}, ttl_s={self.ttl_s}, lease={self._lease})"

    @property
    def lease(self) -> LeaseId | None:
        """The current lease (changes after a re-grant); ``None`` before start or after stop."""
        with self._lock:
            return self._lease

    @property
    def regrants(self) -> int:
        """How many times the lease was lost and granted again."""
        with self._lock:
            return self._regrants

    @property
    def healthy(self) -> bool:
        """Whether the last renewal (or grant) succeeded less than a TTL ago."""
        with self._lock:
            return (self._lease is not None and not self._lost
                    and time.monotonic() - self._last_renewal < self.ttl_s)

    def start(self) -> Self:
        """Grant the lease (in the caller, so failures raise here) and start renewing it.

        Raises:
            MetadataError: the service cannot grant a lease.
        """
        with self._lock:
            if self._stopped:
                raise UsageError("this lease keeper was stopped", "create a new LeaseKeeper")
            if self._thread is not None:
                return self
            self._lease = self.client.grant_lease(self.ttl_s)
            self._last_renewal = time.monotonic()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def publish(self, key: str, value: bytes) -> None:
        """Put ``key`` under the lease now, and again after every re-grant.

        The entry is remembered even when the put fails (the service is down); the keeper
        publishes it once it has a lease again.

        Raises:
            MetadataError: the put failed now.
        """
        with self._lock:
            if self._lease is None:
                raise UsageError("the lease keeper is not running",
                                 "call start() before publish()")
            self._entries[key] = bytes(value)
            if self._lost:
                raise MetadataError(
                    f"lease on {self.client.url} is lost; {key} will be published when it is "
                    "granted again", "check that the metadata service is up")
            try:
                self.client.put(key, value, lease=self._lease)
            except LeaseExpiredError:
                self._lost = True
                self._wake.set()
                raise

    def unpublish(self, key: str) -> bool:
        """Forget ``key`` and delete it from the service; ``True`` if it was there."""
        with self._lock:
            self._entries.pop(key, None)
            return self.client.delete(key)

    def stop(self) -> None:
        """Stop renewing and revoke the lease (its entries vanish now). Safe to call twice.

        A failure to revoke is logged, not raised: the entries then expire after the TTL.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread, self._thread = self._thread, None
            lease, self._lease = self._lease, None
        self._stop.set()
        self._wake.set()
        if thread is not None:
            thread.join(timeout=self.ttl_s + 30.0)
        if lease is not None:
            try:
                self.client.revoke(lease)
            except MetadataError as exc:
                _log.warning("could not revoke lease %s on %s (%s); its entries expire in %.1f s",
                             lease, self.client.url, exc.cause, self.ttl_s)

    close = stop

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- the heartbeat thread -----------------------------------------------------------

    def _run(self) -> None:
        retry_s = min(self.interval_s, 1.0)
        delay = self.interval_s
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            delay = self.interval_s if self._tick() else retry_s

    def _tick(self) -> bool:
        """One renewal (or re-grant); ``True`` when it succeeded."""
        with self._lock:
            if self._stopped or self._lease is None:
                return True
            if not self._lost:
                try:
                    self.client.keepalive(self._lease)
                    self._last_renewal = time.monotonic()
                    self._renewals += 1
                    if self._renewals % RESTORE_EVERY == 0:
                        self._restore()
                    return True
                except LeaseExpiredError:
                    _log.warning("lease %s on %s expired; granting a new one and republishing",
                                 self._lease, self.client.url)
                    self._lost = True
                except MetadataError as exc:
                    silent_s = time.monotonic() - self._last_renewal
                    _log.warning("lease %s on %s not renewed for %.1f s: %s", self._lease,
                                 self.client.url, silent_s, exc.cause)
                    if silent_s < self.ttl_s:
                        return False
                    self._lost = True
            return self._regrant()

    def _restore(self) -> None:
        """Put back entries whose stored value is not ours (rewritten or deleted)."""
        for key, value in self._entries.items():
            try:
                if self.client.get(key) != value:
                    _log.warning("%s on %s was changed by someone else; restoring it", key,
                                 self.client.url)
                    self.client.put(key, value, lease=self._lease)
            except MetadataError as exc:
                _log.debug("could not read back %s: %s", key, exc.cause)
                return

    def _regrant(self) -> bool:
        try:
            lease = self.client.grant_lease(self.ttl_s)
            for key, value in self._entries.items():
                self.client.put(key, value, lease=lease)
        except MetadataError as exc:
            _log.warning("cannot re-grant a lease on %s yet: %s", self.client.url, exc.cause)
            return False
        _log.info("lease on %s granted again (%s); %d entries republished", self.client.url,
                  lease, len(self._entries))
        self._lease = lease
        self._lost = False
        self._last_renewal = time.monotonic()
        self._regrants += 1
        return True
