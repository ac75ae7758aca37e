"""``--state etcd://HOST:PORT`` (any metadata URL): master state in a metadata service,
written behind the master's lock.

Keys: ``kvctl/[cluster/]store/objects/<key>`` and ``.../store/nodes/<node_id>``, values
msgpack records, so a standby master started with the same URL loads them and takes over.

Changes leave the master's lock at once, into an ordered queue (latest value per key,
oldest change first); writer threads take batches from its front into etcd transactions
(at most ``max_txn_ops`` changes, 128 as etcd's ``--max-txn-ops`` default, and
``max_txn_bytes`` of keys and values, well under its 1.5 MiB ``--max-request-bytes``),
``inflight`` of them at a time on distinct keys, so each key's changes land in order. A
request is acknowledged only once every change it made is in etcd
(:meth:`MetadataState.ack`); a change etcd does not take within ``ack_timeout_s`` fails
the acknowledgement (the change stays queued and is written when etcd answers), and while
writes fail, or the queue holds more than ``max_backlog`` changes, the master refuses new
puts (:meth:`MetadataState.refusal`). A stalled etcd thus slows durability, never reads.

Loading reads etcd in pages (``page_size`` keys per range request, every page at the
revision of the first, the next page fetched while one is decoded), each request with a
timeout of ``load_timeout_s`` sized to a page, not the 2 s of a change, whatever the store
holds. Other metadata services (``memory://``, ``file://``, ``http://``,
``redis://``) are written one change at a time by the same writer threads and loaded in
one listing.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import msgspec

from kvctl.errors import UsageError
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.statebase import JournalEntry, NodeRecord, ObjectRecord, StateBackend

_log = logging.getLogger("kvctl.store.state")

#: Seconds of failing writes after which acknowledgements fail at once instead of waiting.
FAIL_FAST_S = 1.0
#: Largest page when loading (keys per range request).
MAX_PAGE = 100_000
#: One change: full key, value (``None``: delete).
Change = tuple[str, bytes | None]


class MetadataState(StateBackend):
    """Objects and nodes as keys of a metadata service (etcd in production).

    Args:
        url: metadata URL (``etcd://127.0.0.1:2379``).
        cluster_id: key namespace of this store.
        token: signs requests to kvctl's own metadata server.
        timeout_s: per request to the service, seconds.
        max_txn_ops: most changes in one transaction.
        max_txn_bytes: most key and value bytes in one transaction.
        inflight: transactions in flight at once (on distinct keys).
        ack_timeout_s: how long an acknowledgement waits for its changes, seconds.
        max_backlog: queued changes past which new puts are refused.
        page_size: keys per range request when loading.
        load_timeout_s: per range request when loading, seconds.
        fence: a leader's ``(key, term)``: every transaction applies only while that key
            is still at that mod revision (etcd only; see
            :mod:`kvctl.store.master.election`). A fenced write stops every writer for
            good and calls ``on_fenced`` with why.
        on_fenced: called (once, from a writer thread) when a write was fenced.
    """

    #: Longest pause between attempts while the service refuses writes, seconds.
    RETRY_S = 1.0

    def __init__(self, url: str, *, cluster_id: str = "", token: str | None = None,
                 timeout_s: float = 2.0, max_txn_ops: int = 128,
                 max_txn_bytes: int = 1 << 20, inflight: int = 2,
                 ack_timeout_s: float = 10.0, max_backlog: int = 262_144,
                 page_size: int = 10_000, load_timeout_s: float = 120.0,
                 fence: tuple[str, int] | None = None,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        from kvctl.transfer.metadata import key_prefix, open_metadata
        from kvctl.transfer.metadata.etcd import EtcdMetadata

        self.description = f"metadata {url}"
        self._url = url
        self._token = token
        self._load_timeout_s = load_timeout_s
        self._client = open_metadata(url, token=token, timeout_s=timeout_s)
        self._etcd = self._client if isinstance(self._client, EtcdMetadata) else None
        if fence is not None and self._etcd is None:
            self._client.close()
            raise UsageError(f"master state {url}: leader fencing needs etcd",
                             "use an etcd:// URL for masters that stand by for each other")
        self._fence = fence
        self._on_fenced = on_fenced
        #: why writes were fenced (another master leads now): nothing is written again
        self.fenced: str | None = None
        self._closed = False
        self._prefix = key_prefix(cluster_id) + "store/"
        self._encoder = msgspec.msgpack.Encoder()
        self._max_ops = max(1, max_txn_ops if self._etcd is not None else 1)
        self._max_bytes = max_txn_bytes
        self._ack_timeout_s = ack_timeout_s
        self._max_backlog = max_backlog
        self._page_size = page_size
        self._cv = threading.Condition(threading.Lock())
        #: full key -> (seq, value), oldest change first
        self._queue: dict[str, tuple[int, bytes | None]] = {}
        #: keys in a transaction now, and the oldest change of each transaction in flight
        self._busy: set[str] = set()
        self._inflight_first: list[int] = []
        self._seq = 0
        self._durable = 0
        self._local = threading.local()
        self._error: str | None = None
        #: when the current run of failed writes began (None: the last write succeeded)
        self._failing_since: float | None = None
        self._stop = False
        self.txns = 0
        self._threads = [threading.Thread(target=self._writer, name=f"kvctl-state-writer-{i}",
                                          daemon=True) for i in range(max(1, inflight))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ load

    def _entries(self, prefix: str) -> Iterator[tuple[str, bytes]]:
        from kvctl.transfer.metadata import MetadataError, open_metadata
        from kvctl.transfer.metadata.etcd import EtcdMetadata

        try:
            if self._etcd is None:
                yield from self._client.list(prefix).items()
                return
            # Pages get a client of their own whose timeout is sized to a page: etcd 3.4
            # counts every key left in the range on each request, so early pages of a
            # large store take longer than a single change ever does.
            loader = open_metadata(self._url, token=self._token,
                                   timeout_s=self._load_timeout_s)
        except MetadataError as exc:
            raise StoreUnavailableError(
                f"master state {self.description}: loading {prefix} failed: {exc.cause}",
                exc.hint or "check that the metadata service is running") from exc
        if not isinstance(loader, EtcdMetadata):  # pragma: no cover - same URL as _client
            loader.close()
            raise StoreUnavailableError(f"master state {self.description}: not etcd",
                                        "use an etcd:// URL")
        pages: queue.Queue[tuple[list[tuple[str, bytes]], MetadataError | None]] = \
            queue.Queue(maxsize=2)
        stop = threading.Event()

        def fetch() -> None:  # the next page comes while this one is decoded
            after: str | None = None
            revision = 0
            limit = self._page_size
            try:
                while not stop.is_set():
                    page = loader.list_page(prefix, after=after, limit=limit,
                                            revision=revision)
                    pages.put((list(page.entries), None))
                    if not page.more or not page.entries:
                        break
                    if not revision:  # about 20 pages in all: each one counts the rest
                        limit = max(limit, min(MAX_PAGE, page.remaining // 20))
                    revision = page.revision
                    after = page.entries[-1][0]
            except MetadataError as exc:
                pages.put(([], exc))
                return
            pages.put(([], None))

        fetcher = threading.Thread(target=fetch, name="kvctl-state-loader", daemon=True)
        fetcher.start()
        try:
            while True:
                page, error = pages.get()
                if error is not None:
                    raise StoreUnavailableError(
                        f"master state {self.description}: loading {prefix} failed: "
                        f"{error.cause}",
                        error.hint or "check that the metadata service is running") from error
                if not page:
                    return
                yield from page
        finally:
            stop.set()
            while fetcher.is_alive():
                with contextlib.suppress(queue.Empty):
                    pages.get(timeout=0.1)
            loader.close()

    def replay(self) -> Iterator[JournalEntry]:
        decoder = msgspec.msgpack.Decoder(JournalEntry)
        for prefix, kind in (("nodes/", NodeRecord), ("objects/", ObjectRecord)):
            for key, value in self._entries(self._prefix + prefix):
                try:
                    entry = decoder.decode(value)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    entry = None
                if not isinstance(entry, kind):
                    _log.warning("master state: skipping unreadable record %s", key)
                    continue
                yield entry

    # ------------------------------------------------------------------ changes

    def _change(self, key: str, value: bytes | None) -> None:
        with self._cv:
            self._seq += 1
            self._queue.pop(key, None)
            self._queue[key] = (self._seq, value)
            self._local.seq = self._seq
            self._cv.notify()

    def put_object(self, record: ObjectRecord) -> None:
        self._change(self._prefix + "objects/" + record.key, self._encoder.encode(record))

    def delete_object(self, key: str) -> None:
        self._change(self._prefix + "objects/" + key, None)

    def put_node(self, record: NodeRecord) -> None:
        self._change(self._prefix + "nodes/" + record.node_id, self._encoder.encode(record))

    def delete_node(self, node_id: str) -> None:
        self._change(self._prefix + "nodes/" + node_id, None)

    def wait_for_key(self, key: str) -> None:
        with self._cv:
            entry = self._queue.get(self._prefix + "objects/" + key)
            if entry is not None and entry[0] > getattr(self._local, "seq", 0):
                self._local.seq = entry[0]

    def ack(self, timeout_s: float | None = None) -> str | None:
        seq = getattr(self._local, "seq", 0)
        self._local.seq = 0
        if seq <= self._durable:
            return None
        wait_s = self._ack_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        with self._cv:
            while self._durable < seq:
                now = time.monotonic()
                left = started + wait_s - now
                # Writes failing for a while already (etcd down): say so at once rather
                # than hold every acknowledgement (and its connection) for the timeout.
                failing = self._failing_since is not None and (
                    now - self._failing_since > FAIL_FAST_S)
                if left <= 0 or self._stop or failing:
                    why = self._error or "the service is slow"
                    return (f"master state {self.description}: the change is not durable "
                            f"after {now - started:.1f} s ({why}); it is written once the "
                            "service takes it")
                self._cv.wait(min(left, FAIL_FAST_S))
        return None

    def refusal(self) -> str | None:
        error, backlog = self._error, len(self._queue)
        if error is not None:
            return f"master state {self.description} takes no writes: {error}"
        if backlog > self._max_backlog:
            return (f"master state {self.description} is {backlog} changes behind "
                    f"(more than {self._max_backlog})")
        return None

    @property
    def backlog(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ writers

    def _take(self) -> list[tuple[str, int, bytes | None]]:
        """The oldest changes of keys not in flight, within the transaction limits (the
        caller holds ``_cv``)."""
        batch: list[tuple[str, int, bytes | None]] = []
        size = 0
        for key, (seq, value) in self._queue.items():
            if key in self._busy:
                continue
            size += len(key) + (len(value) if value is not None else 0)
            if batch and size > self._max_bytes:
                break
            batch.append((key, seq, value))
            if len(batch) >= self._max_ops:
                break
        return batch

    def _ready(self) -> bool:
        return self._stop or any(k not in self._busy for k in self._queue)

    def _writer(self) -> None:
        from kvctl.transfer.metadata import MetadataError

        delay = 0.0
        while True:
            with self._cv:
                while not self._ready():
                    self._cv.wait()
                batch = self._take()
                if not batch:  # stopping, and nothing left this thread may take
                    return
                self._busy.update(key for key, _, _ in batch)
                first = batch[0][1]
                self._inflight_first.append(first)
            error: str | None = None
            try:
                if not self._write([(key, value) for key, _, value in batch]):
                    error = self._fenced_now()
            except MetadataError as exc:
                error = exc.cause
            with self._cv:
                self._busy.difference_update(key for key, _, _ in batch)
                self._inflight_first.remove(first)
                if error is None:
                    self.txns += 1
                    for key, seq, _ in batch:
                        entry = self._queue.get(key)
                        if entry is not None and entry[0] == seq:
                            del self._queue[key]
                    if self._error is not None:
                        _log.info("master state %s: reachable again; %d change(s) behind",
                                  self.description, len(self._queue))
                    self._error = None
                    self._failing_since = None
                    delay = 0.0
                else:
                    if self._error is None:
                        _log.warning("master state %s: %s; keeping %d change(s) until it "
                                     "answers (no new puts meanwhile)", self.description,
                                     error, len(self._queue))
                    self._error = error
                    if self._failing_since is None:
                        self._failing_since = time.monotonic()
                    delay = min(self.RETRY_S, max(0.05, delay * 2))
                oldest = [*self._inflight_first]
                if self._queue:
                    oldest.append(next(iter(self._queue.values()))[0])
                self._durable = min(oldest) - 1 if oldest else self._seq
                self._cv.notify_all()
                if self._stop and error is not None:
                    fenced, self._on_fenced = (self.fenced is not None and self._on_fenced,
                                               None)
                    if fenced:
                        fenced(self.fenced or "")
                    return
            if delay:
                time.sleep(delay)

    def _write(self, changes: list[Change]) -> bool:
        """Write ``changes``; ``False`` when the fence refused them."""
        if self._etcd is not None:
            return self._etcd.write_batch(changes, guard=self._fence)
        for key, value in changes:
            if value is None:
                self._client.delete(key)
            else:
                self._client.put(key, value)
        return True

    def fence_writes(self, fence: tuple[str, int], on_fenced: Callable[[str], None]) -> None:
        """From now on, write only while ``fence`` holds (see the ``fence`` argument):
        a master that has just been elected, before it serves anything.

        Raises:
            UsageError: the service is not etcd.
        """
        if self._etcd is None:
            raise UsageError(f"master state {self._url}: leader fencing needs etcd",
                             "use an etcd:// URL for masters that stand by for each other")
        with self._cv:
            self._fence, self._on_fenced = fence, on_fenced

    def _fenced_now(self) -> str:
        """A transaction was refused by the fence: another master holds the leader key.
        Nothing is written from here on (the queue stays in memory: it is not ours to
        write any more)."""
        with self._cv:
            if self.fenced is None:
                assert self._fence is not None
                self.fenced = (f"another master leads now (the leader key {self._fence[0]} "
                               f"is past this master's term {self._fence[1]})")
                _log.error("master state %s: write refused: %s; this master writes "
                           "nothing more", self.description, self.fenced)
            self._stop = True
            self._cv.notify_all()
            return self.fenced

    def close(self) -> None:
        with self._cv:
            if self._stop:
                if self.fenced is not None and not self._closed:  # stopped by the fence
                    self._closed = True
                    self._client.close()
                return
            self._closed = True
            deadline = time.monotonic() + self._ack_timeout_s
            while self._queue and self._error is None and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._stop = True
            left = len(self._queue)
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=self._ack_timeout_s)
        if left:
            _log.warning("master state %s: %d change(s) could not be written before close",
                         self.description, left)
        self._client.close()
