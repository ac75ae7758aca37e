"""``--state etcd://HOST:PORT`` (any metadata URL): master state in a metadata service,
written behind the master's lock.

In etcd the state is a log of batches over a snapshot (:mod:`kvctl.store.state.etcdlog`), under
``kvctl/[cluster/]store/``, so a standby master started with the same URL loads it and
takes over.

Changes leave the master's lock at once, into an ordered queue (latest value per key,
oldest change first); writer threads take batches from its front (at most ``max_txn_ops``
changes and ``max_txn_bytes`` of records, under etcd's 1.5 MiB ``--max-request-bytes``),
each batch one etcd transaction putting one log key, ``inflight`` of them at a time on
distinct keys, so each key's changes land in order. A
request is acknowledged only once every change it made is in etcd
(:meth:`MetadataState.ack`); a change etcd does not take within ``ack_timeout_s`` fails
the acknowledgement (the change stays queued and is written when etcd answers), and while
writes fail, or the queue holds more than ``max_backlog`` changes, the master refuses new
puts (:meth:`MetadataState.refusal`). A stalled etcd thus slows durability, never reads.

The master snapshots its live state into etcd in the background (:meth:`snapshot_wanted`:
the log outgrew twice the live objects, or holds more batches than an eighth of them, or
the store is still in the old one-key-per-record layout), which replaces the log batches
it covers. Loading reads everything at one revision in pages, the next page fetched while
one is decoded, each request with a timeout of ``load_timeout_s`` sized to a page, not the
2 s of a change. Other metadata services (``memory://``, ``file://``, ``http://``,
``redis://``) keep one key per record, written one change at a time by the same writer
threads and loaded in one listing.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec

from kvctl.errors import UsageError
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.state.base import (
    JournalEntry,
    LoadedState,
    NodeRecord,
    ObjectRecord,
    Snapshot,
    StateBackend,
    register_state,
)
from kvctl.store.state.etcdlog import (
    CHUNK_BYTES,
    OLD_LAYOUT,
    WATERMARK,
    EtcdSnapshot,
    LogReader,
    delete_entry,
    delete_old_layout,
    log_key,
    pack,
    per_key_records,
    read_watermark,
    too_large,
    watermark,
)

if TYPE_CHECKING:
    from kvctl.metadata.etcd import EtcdMetadata

_log = logging.getLogger("kvctl.store.state")

#: Seconds of failing writes after which acknowledgements fail at once instead of waiting.
FAIL_FAST_S = 1.0
#: Seconds before a snapshot that failed is tried again.
SNAPSHOT_RETRY_S = 30.0
#: Fewest bytes of records in a batch or snapshot chunk that etcd refused as too large.
MIN_TXN_BYTES = 16 << 10
#: Seconds a writer with nothing to write waits before it checks etcd's revision again.
REVISION_CHECK_S = 1.0
#: One change: full key, value (``None``: delete).
Change = tuple[str, bytes | None]


class MetadataState(StateBackend):
    """Objects and nodes as keys of a metadata service (etcd in production).

    Args:
        url: metadata URL (``etcd://127.0.0.1:2379``).
        cluster_id: key namespace of this store.
        token: signs requests to kvctl's own metadata server.
        timeout_s: per request to the service, seconds.
        max_txn_ops: most changes in one transaction (one log batch in etcd; other
            services take one change at a time).
        max_txn_bytes: most key and value bytes in one transaction.
        inflight: transactions in flight at once (on distinct keys).
        ack_timeout_s: how long an acknowledgement waits for its changes, seconds.
        max_backlog: queued changes past which new puts are refused.
        page_size: keys per range request when loading the old layout.
        load_timeout_s: per range request when loading, seconds.
        compact_min: log changes below which no snapshot is taken (but for the old
            layout); log batches: a tenth of it.
        snapshot_chunk_bytes: records per snapshot chunk (one etcd key), bytes.
        fence: a leader's ``(key, term)``: every transaction applies only while that key
            is still at that mod revision (etcd only; see
            :mod:`kvctl.store.master.election`). A fenced write stops every writer for
            good and calls ``on_fenced`` with why.
        on_fenced: called (once, from a writer thread) when a write was fenced.
    """

    #: Longest pause between attempts while the service refuses writes, seconds.
    RETRY_S = 1.0

    def __init__(self, url: str, *, cluster_id: str = "", token: str | None = None,
                 timeout_s: float = 2.0, max_txn_ops: int = 8192,
                 max_txn_bytes: int = 1 << 20, inflight: int = 2,
                 ack_timeout_s: float = 10.0, max_backlog: int = 262_144,
                 page_size: int = 10_000, load_timeout_s: float = 120.0,
                 compact_min: int = 100_000, snapshot_chunk_bytes: int = CHUNK_BYTES,
                 fence: tuple[str, int] | None = None,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        from kvctl.metadata import key_prefix, open_metadata
        from kvctl.metadata.etcd import EtcdMetadata

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
        # etcd's log (see kvctl.store.state.etcdlog): the next batch's sequence number (learnt
        # from etcd's revision: None until then), what the log holds since the snapshot
        self._instance = secrets.token_hex(4)
        self._next_seq: int | None = None
        self._log_batches = 0
        self._log_changes = 0
        self._old_layout = False
        #: old-layout keys a snapshot replaced are still to be deleted (by sync())
        self._old_left = False
        self._compact_min = compact_min
        self._chunk_bytes = snapshot_chunk_bytes
        self._snapshot: EtcdSnapshot | None = None
        self._snapshot_from = (0, 0)
        self._retry_at = 0.0
        self._cleanup: threading.Thread | None = None
        #: the highest etcd revision seen (the watermark: etcd never goes below it unless
        #: it was restored from a backup), and why etcd went back (``None``: it did not;
        #: else the master takes no puts until it has re-written its state)
        self._high_rev = 0
        self.rewound: str | None = None
        #: times etcd went back, and that count when the running snapshot began
        self._rewinds = 0
        self._snapshot_rewinds = 0
        self._cleanup_stop = threading.Event()
        self._threads = [threading.Thread(target=self._writer, name=f"kvctl-state-writer-{i}",
                                          daemon=True) for i in range(max(1, inflight))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ load

    def _loader(self) -> EtcdMetadata:
        """An etcd client of its own for loading, its timeout sized to a page."""
        from kvctl.metadata import MetadataError, open_metadata
        from kvctl.metadata.etcd import EtcdMetadata

        try:
            loader = open_metadata(self._url, token=self._token,
                                   timeout_s=self._load_timeout_s)
        except MetadataError as exc:
            raise StoreUnavailableError(
                f"master state {self.description}: cannot load: {exc.cause}",
                exc.hint or "check that the metadata service is running") from exc
        if not isinstance(loader, EtcdMetadata):  # pragma: no cover - same URL as _client
            loader.close()
            raise StoreUnavailableError(f"master state {self.description}: not etcd",
                                        "use an etcd:// URL")
        return loader

    def replay(self) -> Iterator[JournalEntry]:
        from kvctl.metadata import MetadataError

        if self._etcd is None:
            for prefix, kind in OLD_LAYOUT:
                try:
                    listed = self._client.list(self._prefix + prefix)
                except MetadataError as exc:
                    raise StoreUnavailableError(
                        f"master state {self.description}: loading {prefix} failed: "
                        f"{exc.cause}",
                        exc.hint or "check that the metadata service is running") from exc
                yield from per_key_records(listed.items(), kind)
            return
        loader = self._loader()
        try:
            reader = LogReader(loader, self._prefix, description=self.description,
                               page_size=self._page_size)
            yield from reader.entries()
        finally:
            loader.close()
        with self._cv:
            self._learn(reader.revision)
            self._next_seq = max(self._next_seq or 0, reader.last_seq + 1)
            self._high_rev = max(self._high_rev, reader.revision)
            self._log_batches, self._log_changes = reader.log_batches, reader.log_changes
            self._old_layout = reader.old_keys > 0
            self._old_left = reader.old_left
        _log.info("master state %s: loaded %s, %d log batch(es) of %d change(s)%s",
                  self.description,
                  f"snapshot of {reader.manifest.records} records" if reader.manifest
                  else "no snapshot", reader.log_batches, reader.log_changes,
                  f", {reader.old_keys} records of the old layout" if reader.old_keys
                  else "")

    def _learn(self, revision: int) -> None:
        """Number log batches after everything written by etcd ``revision`` (``_cv``
        held)."""
        self._next_seq = max(self._next_seq or 0, (revision + 1) << 32)

    # ------------------------------------------------------------------ changes

    def _change(self, key: str, value: bytes | None) -> None:
        with self._cv:
            self._seq += 1
            self._queue.pop(key, None)
            self._queue[key] = (self._seq, value)
            self._local.seq = self._seq
            # No writer is woken here: the request's thread wakes them when it acks, once
            # every change it makes is queued (one batch, not the first few changes of it
            # in one and the rest in more round trips); the tick wakes them for the rest.

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
            self._cv.notify_all()
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
        if self.rewound is not None:
            return f"master state {self.description} takes no puts: {self.rewound}"
        error, backlog = self._error, len(self._queue)
        if error is not None:
            return f"master state {self.description} takes no writes: {error}"
        if backlog > self._max_backlog:
            return (f"master state {self.description} is {backlog} changes behind "
                    f"(more than {self._max_backlog})")
        return None

    def sync(self) -> None:
        if self._queue:  # changes nobody acknowledges (an eviction's): written now
            with self._cv:
                self._cv.notify_all()
        if (self._old_left and not self._stop and time.monotonic() >= self._retry_at
                and (self._cleanup is None or not self._cleanup.is_alive())):
            self._old_left = False  # old-layout keys a snapshot replaced: deleted now
            self._cleanup = threading.Thread(target=self._delete_old_layout, daemon=True,
                                             name="kvctl-state-cleanup")
            self._cleanup.start()

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
        from kvctl.metadata import MetadataError

        delay = 0.0
        while True:
            error: str | None = None
            idle = False
            with self._cv:
                while not self._ready():
                    if not self._cv.wait(REVISION_CHECK_S) and self._etcd is not None:
                        idle = True
                        break
                learn = self._etcd is not None and self._next_seq is None
            if idle:  # nothing to write: check that etcd did not go back meanwhile
                self._check_revision()
                continue
            if learn:  # changes to write before the state was loaded (tools, tests)
                error = self._learn_revision()
            if error is None and self._etcd is not None:
                error = self._check_revision()
            with self._cv:
                batch = self._take() if error is None else []
                if not batch and error is None:
                    if self._stop:  # and nothing left to take
                        return
                    continue  # another writer took them while this one learnt
                log_seq = 0
                if self._next_seq is not None and batch:
                    log_seq, self._next_seq = self._next_seq, self._next_seq + 1
                self._busy.update(key for key, _, _ in batch)
                first = batch[0][1] if batch else self._seq + 1
                self._inflight_first.append(first)
            try:
                if error is None and not self._write(
                        [(key, value) for key, _, value in batch], log_seq):
                    error = self._fenced_now()
            except MetadataError as exc:
                error = exc.cause
                smaller = max(MIN_TXN_BYTES, min(self._max_bytes, sum(
                    len(k) + len(v or b"") for k, _, v in batch)) // 2)
                if too_large(error) and len(batch) > 1 and smaller < self._max_bytes:
                    # etcd takes smaller requests than --max-request-bytes's default (or
                    # the batch did not compress): smaller batches from now on, at once,
                    # rather than the same batch refused for good (no writes ever again).
                    with self._cv:
                        self._max_bytes = smaller
                        _log.warning("master state %s: etcd refused a batch of %d "
                                     "change(s) as too large; batches of at most %d "
                                     "bytes from now on", self.description, len(batch),
                                     self._max_bytes)
                        self._busy.difference_update(key for key, _, _ in batch)
                        self._inflight_first.remove(first)
                        self._cv.notify_all()
                    continue
            with self._cv:
                self._busy.difference_update(key for key, _, _ in batch)
                self._inflight_first.remove(first)
                if error is None:
                    self.txns += 1
                    self._log_batches += 1
                    self._log_changes += len(batch)
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
                    break
            if delay:
                time.sleep(delay)
        self._tell_fenced()

    def _check_revision(self) -> str | None:
        """Check etcd's revision against the watermark before a write (and when idle): a
        revision below the highest seen means etcd was restored from an older backup (or
        replaced), and the log batches written since that backup are gone with it. The
        master still holds every record: it refuses new puts, says so, and re-writes its
        whole state as a snapshot (:meth:`snapshot_wanted`). ``None`` when etcd is
        fine, else why this write waits."""
        from kvctl.metadata import MetadataError

        assert self._etcd is not None
        # Compared with the watermark as it was before the request: a (linearizable) read
        # answers at least every revision seen before it was sent, not one seen by
        # another writer's read answered meanwhile.
        before = self._high_rev
        try:
            revision = self._etcd.list_page(self._prefix + WATERMARK, limit=1).revision
        except MetadataError as exc:
            return exc.cause
        with self._cv:
            if revision >= before:
                self._high_rev = max(self._high_rev, revision)
                return None
            why = (f"etcd went back from revision {before} to {revision} (restored "
                   "from an older backup?): the changes recorded since are gone from it")
            self._high_rev = revision  # its history goes on from here
            if self.rewound is None:
                _log.error("master state %s: %s; refusing new puts while this master "
                           "re-writes every record it holds", self.description, why)
            self.rewound = why
            self._rewinds += 1
            self._retry_at = 0.0
            self._cv.notify_all()
        return None

    def _learn_revision(self) -> str | None:
        """Learn etcd's revision to number log batches by; why not, when etcd failed."""
        from kvctl.metadata import MetadataError

        assert self._etcd is not None
        try:
            page = self._etcd.list_page(self._prefix + WATERMARK, limit=1)
        except MetadataError as exc:
            return exc.cause
        with self._cv:
            self._learn(page.revision)
            self._high_rev = max(self._high_rev, page.revision)
            for key, value in page.entries:
                if key == self._prefix + WATERMARK:
                    mark = read_watermark(value)
                    if mark is not None:
                        self._next_seq = max(self._next_seq or 0, mark[0] + 1)
        return None

    def _write(self, changes: list[Change], seq: int) -> bool:
        """Write ``changes`` (in etcd: as log batch ``seq``); ``False`` when the fence
        refused them."""
        if self._etcd is not None:
            skip = len(self._prefix)
            entries = [value if value is not None else delete_entry(key[skip:])
                       for key, value in changes]
            return self._etcd.write_batch(
                [(log_key(self._prefix, seq, self._instance), pack(entries)),
                 (self._prefix + WATERMARK, watermark(seq, self._high_rev))],
                guard=self._fence)
        for key, value in changes:
            if value is None:
                self._client.delete(key)
            else:
                self._client.put(key, value)
        return True

    # ------------------------------------------------------------------ snapshots (etcd)

    def snapshot_wanted(self, live_objects: int) -> bool:
        if (self._etcd is None or self._snapshot is not None or self._stop
                or time.monotonic() < self._retry_at):
            return False
        return (self.rewound is not None or self._old_layout
                or self._log_changes > 2 * live_objects + self._compact_min
                or self._log_batches > live_objects // 8 + self._compact_min // 10)

    def start_snapshot(self, nodes: Sequence[NodeRecord]) -> Snapshot | None:
        with self._cv:
            if (self._etcd is None or self._snapshot is not None or self._stop
                    or self._next_seq is None):
                return None
            # Its number is taken from the log's: batches taken from now on (every change
            # made from now on) come after it and are replayed over it.
            gen, self._next_seq = self._next_seq, self._next_seq + 1
            self._snapshot_from = (self._log_batches, self._log_changes)
            self._snapshot_rewinds = self._rewinds
            self._snapshot = EtcdSnapshot(self._prefix, gen, nodes, write=self._snapshot_txn,
                                          done=self._snapshot_done,
                                          chunk_bytes=self._chunk_bytes)
            return self._snapshot

    def _snapshot_txn(self, changes: list[Change], delete_ranges: Sequence[tuple[str, str]]
                      ) -> bool:
        from kvctl.metadata import MetadataError

        assert self._etcd is not None
        if self._stop:
            return False
        error = self._check_revision()
        if error is not None:
            raise MetadataError(error)
        if self._rewinds != self._snapshot_rewinds:  # its earlier chunks may be gone
            raise MetadataError("etcd went back while the snapshot was written")
        if self._etcd.write_batch(changes, guard=self._fence, delete_ranges=delete_ranges):
            return True
        self._fenced_now()
        self._tell_fenced()
        return False

    def _snapshot_done(self, error: str | None) -> None:
        with self._cv:
            snapshot, self._snapshot = self._snapshot, None
            if error is not None:
                self._retry_at = time.monotonic() + (
                    self.RETRY_S if self.rewound is not None else SNAPSHOT_RETRY_S)
                if too_large(error) and self._chunk_bytes > MIN_TXN_BYTES:
                    # etcd takes smaller requests than a chunk: smaller chunks, tried
                    # again at the next tick (the same ones would be refused for good).
                    self._chunk_bytes = max(MIN_TXN_BYTES, self._chunk_bytes // 2)
                    self._retry_at = 0.0
                    _log.warning("master state %s: etcd refused a snapshot chunk as too "
                                 "large; chunks of %d bytes from now on", self.description,
                                 self._chunk_bytes)
                    return
                if error != "abandoned" and not self._stop:  # (closing, or fenced)
                    _log.warning("master state %s: snapshot failed (%s); trying again in "
                                 "%.0f s", self.description, error, SNAPSHOT_RETRY_S)
                return
            if self.rewound is not None and self._rewinds == self._snapshot_rewinds:
                _log.warning("master state %s: every record this master holds is written "
                             "again (snapshot %024x, after %s); taking puts again",
                             self.description, snapshot.gen if snapshot else 0,
                             self.rewound)
                self.rewound = None
            batches, changes = self._snapshot_from
            self._log_batches = max(0, self._log_batches - batches)
            self._log_changes = max(0, self._log_changes - changes)
            self._old_left = self._old_left or self._old_layout
            self._old_layout = False
        _log.info("master state %s: snapshot %024x written", self.description,
                  snapshot.gen if snapshot is not None else 0)

    def _delete_old_layout(self) -> None:
        try:
            loader = self._loader()
        except StoreUnavailableError:
            deleted, done = 0, False
        else:
            try:
                deleted, done = delete_old_layout(loader, self._prefix, self._snapshot_txn,
                                                  self._cleanup_stop)
            finally:
                loader.close()
        _log.info("master state %s: %d record(s) of the old layout deleted%s",
                  self.description, deleted, "" if done else "; the rest later")
        if not done:
            with self._cv:
                self._old_left = True
                self._retry_at = time.monotonic() + SNAPSHOT_RETRY_S

    # ------------------------------------------------------------------ fencing

    def _tell_fenced(self) -> None:
        """Call ``on_fenced`` once, if writes were fenced."""
        with self._cv:
            fenced, self._on_fenced = (self._on_fenced if self.fenced is not None else None,
                                       None if self.fenced is not None else self._on_fenced)
        if fenced is not None:
            fenced(self.fenced or "")

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
        self._cleanup_stop.set()
        if self._cleanup is not None:
            self._cleanup.join(timeout=self._ack_timeout_s)
        with self._cv:
            if self._stop:
                if self.fenced is not None and not self._closed:  # stopped by the fence
                    self._closed = True
                    self._client.close()
                return
            self._closed = True
            self._cv.notify_all()
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


def _open_metadata_state(spec: str, cluster_id: str, token: str | None) -> StateBackend:
    return MetadataState(spec, cluster_id=cluster_id, token=token)


def register_metadata_schemes() -> None:
    """Register :class:`MetadataState` for every metadata URL scheme
    (:func:`kvctl.metadata.known_schemes`) that no other backend took: ``file://`` stays
    the journal's. Safe to call again."""
    from kvctl.metadata import known_schemes

    for scheme in known_schemes():
        register_state(scheme)(_open_metadata_state)


def read_state(url: str, *, cluster_id: str = "", token: str | None = None) -> LoadedState:
    """What a master's state in the metadata service ``url`` holds now, loaded as a
    standby master would (tools and tests; this writes nothing).

    Raises:
        StoreUnavailableError: the service failed, or a record is unreadable.
    """
    state = MetadataState(url, cluster_id=cluster_id, token=token, inflight=1)
    try:
        return state.load()
    finally:
        state.close()
