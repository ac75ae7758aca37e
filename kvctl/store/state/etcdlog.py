"""How a store master's state lies in etcd: a log of write-behind batches over a snapshot.

Under ``kvctl/[cluster/]store/``:

- ``log/<seq>.<writer>``: one key per write-behind batch (one etcd transaction), its value a
  msgpack array of :data:`~kvctl.store.state.base.JournalEntry` records, compressed
  (:func:`pack`), so a batch of thousands of changes costs etcd one key, not one per
  change. ``seq`` (24 hex digits) is the writer's etcd revision when it started, shifted
  32 bits, plus a counter: a master started later (a restart, a standby that took over)
  writes after everything an earlier one wrote. ``writer`` names the process, so two
  never overwrite each other's batch.
- ``snapshots/<gen>/<part>``: a snapshot of the master's live state in chunks of about
  :data:`CHUNK_BYTES`, nodes first, written in the background from the master's index a
  slice of keys at a time (a fuzzy checkpoint, as the journal's: ``gen`` is a sequence
  number taken when it began, every log batch after it is replayed over it).
- ``manifest``: which snapshot counts (:class:`Manifest`). One transaction puts it and
  deletes the log batches the snapshot covers and every other snapshot, so a master
  killed while writing a snapshot leaves the previous one and its log whole.
- ``nodes/<id>`` and ``objects/<key>``: the layout before the log (one key per record).
  A store written that way loads (those keys, then the log written since) and moves to the
  log with its first snapshot; the old keys are deleted afterwards in slices.

Loading reads everything at one revision (the manifest's), in pages, the next page fetched
while one is decoded. etcd's JSON gateway costs about 15 us per key and etcd 3.4 counts
the rest of a range on every paged request, so a million records as a million keys took
23 s to read here; as a few thousand log batches, 3 s (most of it decoding the records).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec

from kvctl.metadata import MetadataError
from kvctl.metadata.etcd import EtcdMetadata, prefix_range_end
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.state.base import (
    DeleteNode,
    DeleteObject,
    JournalEntry,
    NodeRecord,
    ObjectRecord,
    Snapshot,
    StateMovedError,
)

_log = logging.getLogger("kvctl.store.state")

LOG = "log/"
SNAPSHOTS = "snapshots/"
MANIFEST = "manifest"
#: The watermark: the last log batch's sequence number and the highest etcd revision its
#: writer had seen, put in every log batch's transaction (see :func:`watermark`).
WATERMARK = "watermark"
#: The one-key-per-record layout of earlier versions (still loaded): prefix, record kind.
OLD_LAYOUT: tuple[tuple[str, type[NodeRecord] | type[ObjectRecord]], ...] = (
    ("nodes/", NodeRecord), ("objects/", ObjectRecord))
#: Bytes of records per snapshot chunk (one etcd key, well under its 1.5 MiB requests).
CHUNK_BYTES = 512 << 10
#: Log batches or snapshot chunks per range request when loading.
BLOB_PAGE = 16
#: Largest page of the old layout (keys per range request).
MAX_PAGE = 100_000
#: Old-layout keys deleted per transaction once a snapshot has replaced them.
CLEANUP_PAGE = 10_000


class Manifest(msgspec.Struct, array_like=True, frozen=True, tag="manifest"):
    #: the snapshot's sequence number: log batches up to it are in the snapshot
    gen: int
    #: chunks under ``snapshots/<gen>/``
    parts: int
    #: records in them
    records: int


def log_key(prefix: str, seq: int, writer: str = "") -> str:
    """The key of log batch ``seq`` (without ``writer``: where batches from ``seq`` on
    start)."""
    return f"{prefix}{LOG}{seq:024x}" + (f".{writer}" if writer else "")


def chunks_prefix(prefix: str, gen: int) -> str:
    return f"{prefix}{SNAPSHOTS}{gen:024x}/"


def pack(entries: Sequence[bytes]) -> bytes:
    """The value of a log batch or snapshot chunk: a msgpack array of already encoded
    records, compressed (zlib level 1: a quarter of the bytes, and etcd's JSON gateway
    costs about 0.1 us per byte: a batch of 512 records is written in 2.0 ms instead of
    5.2, for 0.4 ms of compression)."""
    n = len(entries)
    if n < 16:
        head = bytes([0x90 | n])
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return zlib.compress(head + b"".join(entries), 1)


def watermark(seq: int, revision: int) -> bytes:
    """The watermark's value after log batch ``seq`` written with etcd at ``revision``."""
    return msgspec.msgpack.encode([seq, revision])


def read_watermark(value: bytes) -> tuple[int, int] | None:
    """``(seq, revision)`` of a watermark's value, or ``None`` when it is not one."""
    try:
        seq, revision = msgspec.msgpack.decode(value, type=tuple[int, int])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return seq, revision


def _key_seq(prefix: str, key: str) -> int:
    """The sequence number of log batch ``key`` (0: not one)."""
    try:
        return int(key[len(prefix + LOG):].split(".", 1)[0], 16)
    except ValueError:
        return 0


class _Unpacker:
    """Reads what :func:`pack` wrote: the records, and whether any of them may be a
    node's (its tag is in the bytes); ``None`` for a value that is not that."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(list[JournalEntry])

    def __call__(self, value: bytes) -> tuple[list[JournalEntry], bool] | None:
        try:
            raw = zlib.decompress(value)
            return self._decoder.decode(raw), b"node" in raw
        except (zlib.error, msgspec.DecodeError, msgspec.ValidationError):
            return None


def delete_entry(kind_key: str) -> bytes:
    """The record forgetting ``objects/<key>`` or ``nodes/<id>``."""
    kind, _, name = kind_key.partition("/")
    if kind == "nodes":
        return msgspec.msgpack.encode(DeleteNode(name))
    return msgspec.msgpack.encode(DeleteObject(name))


def per_key_records(pairs: Iterable[tuple[str, bytes]], kind: type[NodeRecord | ObjectRecord],
                    unreadable: Callable[[str], Exception] | None = None
                    ) -> Iterator[JournalEntry]:
    """The records of a one-key-per-record listing (``kind`` each); an unreadable one is
    skipped with a warning (it is one record, not part of a batch), or with
    ``unreadable`` raises what that makes of its key."""
    decoder = msgspec.msgpack.Decoder(JournalEntry)
    for key, value in pairs:
        try:
            entry = decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            entry = None
        if not isinstance(entry, kind):
            if unreadable is not None:
                raise unreadable(key)
            _log.warning("master state: skipping unreadable record %s", key)
            continue
        yield entry


def too_large(cause: str) -> bool:
    """Whether etcd refused a request for its size (``--max-request-bytes``)."""
    return "request is too large" in cause


def _unavailable(description: str, what: str, exc: MetadataError) -> StoreUnavailableError:
    if "required revision has been compacted" in exc.cause:
        return StateMovedError(
            f"master state {description}: etcd compacted the revision it was being "
            f"loaded at (reading {what})",
            "load it again; if this keeps happening, compact etcd less often "
            "(--auto-compaction-retention) than a master takes to load")
    return StoreUnavailableError(
        f"master state {description}: loading {what} failed: {exc.cause}",
        exc.hint or "check that the metadata service is running")


def read_pages(loader: EtcdMetadata, prefix: str, *, limit: int, revision: int,
               start: str | None = None, grow: bool = False
               ) -> Iterator[list[tuple[str, bytes]]]:
    """Pages of the keys under ``prefix`` (from ``start``) at ``revision``, the next one
    fetched by a thread while the caller decodes one. With ``grow`` the page size grows
    to about a twentieth of the range (etcd 3.4 counts the rest of the range on every
    request, so many small pages cost O(n^2)).

    Raises:
        MetadataError: a request failed.
    """
    pages: queue.Queue[tuple[list[tuple[str, bytes]], MetadataError | None]] = \
        queue.Queue(maxsize=2)
    stop = threading.Event()

    def fetch() -> None:
        after: str | None = None
        size = limit
        try:
            while not stop.is_set():
                page = loader.list_page(prefix, after=after, limit=size, revision=revision,
                                        start=start)
                pages.put((list(page.entries), None))
                if not page.more or not page.entries:
                    break
                if grow and after is None:
                    size = max(size, min(MAX_PAGE, page.remaining // 20))
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
                raise error
            if not page:
                return
            yield page
    finally:
        stop.set()
        while fetcher.is_alive():
            with contextlib.suppress(queue.Empty):
                pages.get(timeout=0.1)


class LogReader:
    """Everything a master recorded in etcd, read at one revision (see the module
    docstring): :meth:`entries` yields the records in an order :func:`restore` takes
    (a node's record before objects placed on it); once it is exhausted the attributes
    say what it found.

    Attributes:
        revision: the revision everything was read at.
        manifest: the snapshot that counted (``None``: none yet).
        old_keys: records loaded from the old one-key-per-record layout.
        old_left: keys of the old layout are left beside a snapshot (a master stopped
            while deleting them; they are not loaded).
        log_batches, log_changes: log batches read and the changes in them.
        last_seq: the highest sequence number in the state (the snapshot's or a log
            batch's, or the watermark's): a master's next batch must come after it.
    """

    def __init__(self, loader: EtcdMetadata, prefix: str, *, description: str,
                 page_size: int) -> None:
        self._loader = loader
        self._prefix = prefix
        self._description = description
        self._page_size = page_size
        self.revision = 0
        self.manifest: Manifest | None = None
        self.old_keys = 0
        self.old_left = False
        self.log_batches = 0
        self.log_changes = 0
        self.last_seq = 0
        self._mark: tuple[int, int] | None = None

    def entries(self) -> Iterator[JournalEntry]:
        """Raises:
            StoreUnavailableError: etcd failed, or a record is unreadable."""
        manifest_key = self._prefix + MANIFEST
        try:
            page = self._loader.list_page(manifest_key, limit=1)
        except MetadataError as exc:
            raise _unavailable(self._description, manifest_key, exc) from exc
        self.revision = page.revision
        self._read_watermark()
        for key, value in page.entries:
            if key == manifest_key:
                try:
                    self.manifest = msgspec.msgpack.decode(value, type=Manifest)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    raise self._unreadable(key) from None
        if self.manifest is not None:
            self._refuse_old_layout_written_since(manifest_key)
            yield from self._snapshot(self.manifest)
            first = self.manifest.gen + 1
            for sub, _ in OLD_LAYOUT:
                self.old_left = self.old_left or any(True for _ in self._read(
                    self._prefix + sub, 1, pages=1))
        else:
            self._refuse_a_lost_manifest()
            first_batch = next(self._read(self._prefix + LOG, 1, pages=1), None)
            self._refuse_old_layout_written_since(first_batch and first_batch[0])
            yield from self._old_layout()
            first = 0
        yield from self._log(first)
        self._check_watermark()

    def _read_watermark(self) -> None:
        key = self._prefix + WATERMARK
        try:
            page = self._loader.list_page(key, limit=1, revision=self.revision)
        except MetadataError as exc:
            raise _unavailable(self._description, key, exc) from exc
        for name, value in page.entries:
            if name == key:
                self._mark = read_watermark(value)
                if self._mark is None:
                    raise self._unreadable(key)

    def _check_watermark(self) -> None:
        """The watermark says which log batch was written last and the revision etcd was
        at: a log that ends before that batch, or etcd at a lower revision, lost changes a
        master acknowledged (etcd restored from an older backup, in part, or keys
        deleted). Loading on would make that loss silent and permanent, so it stops."""
        if self.manifest is not None:
            self.last_seq = max(self.last_seq, self.manifest.gen)
        if self._mark is None:
            return
        seq, revision = self._mark
        if revision > self.revision or seq > self.last_seq:
            raise StoreUnavailableError(
                f"master state {self._description}: the watermark says log batch "
                f"{seq:024x} was written at etcd revision {revision}, but the log ends at "
                f"{self.last_seq:024x} and etcd is at revision {self.revision}: etcd lost "
                "changes a master acknowledged (restored from an older backup?)",
                "restore etcd under the running master that wrote them (it re-writes "
                "what it holds), or from a newer backup; see docs/store.md (Restoring "
                "etcd); delete the watermark key only to accept the loss")
        self.last_seq = max(self.last_seq, seq)

    def _refuse_a_lost_manifest(self) -> None:
        """A snapshot's chunks with neither a manifest nor anything older beside them (no
        log batch before them, no old-layout key) mean the manifest is gone, not that a
        first snapshot was cut short (that leaves the log or the old layout it was taken
        from): the log after it alone would be a silent part of the state."""
        chunk = next(self._read(self._prefix + SNAPSHOTS, 1, pages=1), None)
        if chunk is None:
            return
        gen = chunk[0][len(self._prefix + SNAPSHOTS):].split("/", 1)[0]
        older = [self._prefix + LOG, *(self._prefix + sub for sub, _ in OLD_LAYOUT)]
        for prefix in older:
            first = next(self._read(prefix, 1, pages=1), None)
            if first is not None and (prefix != older[0]
                                      or first[0] < self._prefix + LOG + gen):
                return
        raise StoreUnavailableError(
            f"master state {self._description}: snapshot {gen} is in etcd but "
            f"{self._prefix}{MANIFEST} is not, and nothing older is: the manifest was "
            "deleted, so only the changes made after that snapshot are left to load",
            f"restore etcd from a backup, or put {self._prefix}{MANIFEST} back "
            "(a master cannot start on part of its state)")

    def _refuse_old_layout_written_since(self, since: str | None) -> None:
        """Old-layout keys newer than ``since`` (the manifest, or the first log batch)
        were written by an earlier kvctl after this store moved to the log (a downgrade):
        loading would drop them (or replay older changes over them) and the cleanup would
        delete them, so the load stops instead."""
        if since is None:
            return
        try:
            entry = self._loader.get_entry(since)
            newer = [key for sub, _ in OLD_LAYOUT if entry is not None and (
                key := self._loader.modified_after(self._prefix + sub, entry[1],
                                                   revision=self.revision))]
        except MetadataError as exc:
            raise _unavailable(self._description, since, exc) from exc
        if newer:
            raise StoreUnavailableError(
                f"master state {self._description}: {newer[0]} (one key per record) was "
                f"written after {since}, by a kvctl older than the log layout (a "
                "downgrade): loading would lose it and what else that kvctl wrote",
                "run the kvctl that wrote them, or copy what they hold aside and delete "
                "them (etcdctl del --prefix); downgrading a store is not supported")

    def _snapshot(self, manifest: Manifest) -> Iterator[JournalEntry]:
        unpack = _Unpacker()
        parts = records = 0
        for key, value in self._read(chunks_prefix(self._prefix, manifest.gen), BLOB_PAGE):
            parts += 1
            unpacked = unpack(value)
            if unpacked is None:
                raise self._unreadable(key)
            records += len(unpacked[0])
            yield from unpacked[0]
        if parts != manifest.parts or records != manifest.records:
            raise StoreUnavailableError(
                f"master state {self._description}: snapshot {manifest.gen:024x} has "
                f"{parts} of its {manifest.parts} chunks and {records} of its "
                f"{manifest.records} records",
                "restore etcd from a backup; a master cannot start on part of its state")

    def _old_layout(self) -> Iterator[JournalEntry]:
        for sub, kind in OLD_LAYOUT:
            pairs = self._read(self._prefix + sub, self._page_size, grow=True)
            # Strict: the first snapshot makes what is loaded here the whole state and
            # deletes these keys, so a record skipped now would be lost for good.
            for entry in per_key_records(pairs, kind, self._unreadable):
                self.old_keys += 1
                yield entry

    def _log(self, first: int) -> Iterator[JournalEntry]:
        """The log from batch ``first`` on: the last change of each node first, then the
        objects' changes in order (the write-behind queue keeps one change per key, so a
        node's record can come after objects placed on it)."""
        unpack = _Unpacker()
        nodes: dict[str, JournalEntry] = {}
        batches: list[tuple[list[JournalEntry], bool]] = []
        for key, value in self._read(self._prefix + LOG, BLOB_PAGE,
                                     start=log_key(self._prefix, first)):
            unpacked = unpack(value)
            if unpacked is None:
                raise self._unreadable(key)
            records, mixed = unpacked
            self.last_seq = max(self.last_seq, _key_seq(self._prefix, key))
            self.log_batches += 1
            self.log_changes += len(records)
            if mixed:
                for entry in records:
                    if isinstance(entry, NodeRecord | DeleteNode):
                        nodes[entry.node_id] = entry
            batches.append(unpacked)
        yield from nodes.values()
        for records, mixed in batches:
            if mixed:
                yield from (e for e in records if isinstance(e, ObjectRecord | DeleteObject))
            else:
                yield from records

    def _read(self, prefix: str, limit: int, *, start: str | None = None,
              grow: bool = False, pages: int | None = None) -> Iterator[tuple[str, bytes]]:
        try:
            for n, page in enumerate(read_pages(self._loader, prefix, limit=limit,
                                                revision=self.revision, start=start,
                                                grow=grow)):
                yield from page
                if pages is not None and n + 1 >= pages:
                    return
        except MetadataError as exc:
            raise _unavailable(self._description, prefix, exc) from exc

    def _unreadable(self, key: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"master state {self._description}: {key} is unreadable",
            "restore etcd from a backup; a master cannot start on part of its state")


#: Writes one transaction (puts, range deletes) under the leader's fence: ``False`` when
#: the fence refused it. Raises MetadataError when etcd failed.
TxnWriter = Callable[[list[tuple[str, bytes | None]], Sequence[tuple[str, str]]], bool]


class EtcdSnapshot(Snapshot):
    """A snapshot written into ``snapshots/<gen>/`` a chunk at a time; :meth:`finish`
    switches the manifest to it and deletes what it replaces, in one transaction."""

    def __init__(self, prefix: str, gen: int, nodes: Sequence[NodeRecord], *,
                 write: TxnWriter, done: Callable[[str | None], None],
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self._prefix = prefix
        self.gen = gen
        self._write = write
        self._done = done
        self._chunk_bytes = chunk_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._current: list[bytes] = []
        self._size = 0
        self._sealed: list[bytes] = []
        self._parts = 0
        self._records = 0
        self._error: str | None = None
        self._ended = False
        self._take(nodes)

    def _take(self, records: Sequence[NodeRecord | ObjectRecord]) -> None:
        encode = self._encoder.encode
        for rec in records:
            payload = encode(rec)
            self._current.append(payload)
            self._size += len(payload)
            if self._size >= self._chunk_bytes:
                self._seal()
        self._records += len(records)

    def _seal(self) -> None:
        self._sealed.append(pack(self._current))
        self._current, self._size = [], 0

    def add(self, records: Sequence[ObjectRecord]) -> None:
        self._take(records)

    def _txn(self, changes: list[tuple[str, bytes | None]],
             delete_ranges: Sequence[tuple[str, str]] = ()) -> None:
        if self._error is not None:
            return
        try:
            if not self._write(changes, delete_ranges):
                self._error = "fenced"
        except MetadataError as exc:
            self._error = exc.cause

    def write(self) -> None:
        sealed, self._sealed = self._sealed, []
        base = chunks_prefix(self._prefix, self.gen)
        for chunk in sealed:
            self._txn([(f"{base}{self._parts:08x}", chunk)])
            self._parts += 1

    def finish(self) -> bool:
        if self._ended:
            return False
        if self._current:
            self._seal()
        self.write()
        manifest = Manifest(self.gen, self._parts, self._records)
        base = chunks_prefix(self._prefix, self.gen)
        snapshots = self._prefix + SNAPSHOTS
        self._txn([(self._prefix + MANIFEST, msgspec.msgpack.encode(manifest))], [
            (self._prefix + LOG, log_key(self._prefix, self.gen + 1)),
            (snapshots, base),
            (prefix_range_end(base.encode()).decode(),
             prefix_range_end(snapshots.encode()).decode())])
        self._ended = True
        self._done(self._error)
        return self._error is None

    def abort(self) -> None:
        if not self._ended:
            self._ended = True
            self._done("abandoned")


def delete_old_layout(loader: EtcdMetadata, prefix: str, write: TxnWriter,
                      stop: threading.Event) -> tuple[int, bool]:
    """Delete the old layout's keys (a snapshot has replaced them) ``CLEANUP_PAGE`` at a
    time, so etcd never applies one huge deletion: the keys deleted, and whether none is
    left. Stops at ``stop``, a fenced write or an etcd error."""
    deleted = 0
    for sub, _ in OLD_LAYOUT:
        while not stop.is_set():
            try:
                page = loader.list_page(prefix + sub, limit=CLEANUP_PAGE)
                if not page.entries:
                    break
                last = page.entries[-1][0]
                if not write([], [(page.entries[0][0], last + "\0")]):
                    return deleted, False
            except MetadataError as exc:
                _log.info("master state: deleting the old layout's keys paused: %s",
                          exc.cause)
                return deleted, False
            deleted += len(page.entries)
    return deleted, not stop.is_set()
