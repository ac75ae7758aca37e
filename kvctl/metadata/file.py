"""``file:///dir``: leased entries as files in a directory (one host, no server).

Layout under the directory::

    .lock               flock()ed by every change and every cleanup (processes and threads)
    entries/k<key>      one JSON file per key: {"key", "value" (base64), "lease"}
    leases/<id>         one JSON file per lease: {"ttl_s", "deadline"} (wall clock, epoch s)

Every file is written to a temporary name and moved into place with ``os.replace``, so a
reader sees the old or the new content, never half of one; reads take no lock. An entry
whose lease file is missing or past its deadline is invisible, and whoever notices removes
it (under the lock, after checking again). Deadlines are on the wall clock because several
processes share them; keep the host's clock stepped by NTP rather than jumped. Writes are not
fsync()ed: entries are leased and republished, not kept across a host crash.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import logging
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import UsageError
from kvctl.metadata.base import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    MetadataError,
    MetadataOptions,
    register_backend,
)

_log = logging.getLogger(__name__)

#: Longest file name most Linux file systems accept (ext4, xfs, tmpfs).
_MAX_NAME_BYTES = 255
#: How often (seconds) one client sweeps leases that expired without anybody reading them.
_SWEEP_INTERVAL_S = 5.0
#: Temporary files older than this (seconds) were left by a crashed writer.
_STALE_TMP_S = 60.0


class FileMetadata(MetadataClient):
    """Leased key/value entries in a directory shared by the processes of one host."""

    def __init__(self, root: Path) -> None:
        self.url = f"file://{root}"
        self.root = root
        self._entries = root / "entries"
        self._leases = root / "leases"
        self._thread_lock = threading.Lock()
        self._last_sweep = 0.0
        try:
            self._entries.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._leases.mkdir(exist_ok=True, mode=0o700)
            self._lock_fd: int | None = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise MetadataError(
                f"cannot use metadata directory {root}: {exc.strerror or exc}",
                "create it or choose a writable directory in the file:/// URL",
            ) from exc

    # -- the interface ----------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: LeaseId | None = None) -> None:
        path = self._entry_path(key)
        with self._locked():
            if lease is not None and not self._lease_alive(lease, time.time()):
                raise LeaseExpiredError(
                    f"lease {lease} in {self.url} has expired or never existed",
                    "grant a new lease and publish again",
                )
            record = {"key": key, "value": base64.b64encode(bytes(value)).decode(),
                      "lease": lease}
            self._write(path, record)

    def get(self, key: str) -> bytes | None:
        path = self._entry_path(key)
        self._check_open()
        entry = self._read_entry(path)
        if entry is None:
            return None
        if self._visible(entry, time.time(), {}):
            return entry[1]
        # Expired (or racing with a writer): decide under the lock, and clean up.
        with self._locked():
            entry = self._read_entry(path)
            if entry is None:
                return None
            if self._visible(entry, time.time(), {}):
                return entry[1]
            self._unlink(path)
            return None

    def list(self, prefix: str) -> dict[str, bytes]:
        self._check_open()
        now = time.time()
        alive: dict[LeaseId, bool] = {}
        found: dict[str, bytes] = {}
        expired: list[Path] = []
        for path in self._entry_files():
            key = _key_of(path.name)
            if key is None or not key.startswith(prefix):
                continue
            entry = self._read_entry(path)
            if entry is None:
                continue
            if self._visible(entry, now, alive):
                found[key] = entry[1]
            else:
                expired.append(path)
        if expired:
            self._remove_if_expired(expired)
        return dict(sorted(found.items()))

    def delete(self, key: str) -> bool:
        path = self._entry_path(key)
        with self._locked():
            entry = self._read_entry(path)
            if entry is None:
                return False
            visible = self._visible(entry, time.time(), {})
            self._unlink(path)
            return visible

    def grant_lease(self, ttl_s: float) -> LeaseId:
        if not ttl_s > 0:
            raise UsageError(f"lease TTL {ttl_s} s is not positive", "use a TTL above 0 s")
        with self._locked():
            now = time.time()
            if now - self._last_sweep >= _SWEEP_INTERVAL_S:
                self._sweep(now)
            while True:
                lease = LeaseId(secrets.randbits(62) + 1)
                if not (self._leases / str(lease)).exists():
                    break
            self._write(self._leases / str(lease), {"ttl_s": ttl_s, "deadline": now + ttl_s})
            return lease

    def keepalive(self, lease: LeaseId) -> None:
        path = self._leases / str(int(lease))
        with self._locked():
            now = time.time()
            if not self._lease_alive(lease, now):
                self._drop_lease(lease)
                raise LeaseExpiredError(f"lease {lease} in {self.url} has expired",
                                        "grant a new lease and republish")
            record = self._read_json(path) or {}
            try:
                ttl_s = float(record["ttl_s"])
            except (KeyError, TypeError, ValueError) as exc:
                raise MetadataError(f"lease file {path} is corrupt",
                                    "delete it and republish") from exc
            self._write(path, {"ttl_s": ttl_s, "deadline": now + ttl_s})

    def revoke(self, lease: LeaseId) -> None:
        with self._locked():
            self._drop_lease(lease)

    def close(self) -> None:
        with self._thread_lock:
            fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    # -- helpers ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise MetadataError(f"metadata client {self.url} is closed",
                                "open a new client with open_metadata()")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            self._check_open()
            fd = self._lock_fd
            if fd is None:  # pragma: no cover - _check_open ruled it out
                raise MetadataError(f"metadata client {self.url} is closed", None)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                raise self._os_error("lock", self.root / ".lock", exc) from exc
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _entry_path(self, key: str) -> Path:
        name = "k" + urllib.parse.quote(key, safe="")
        if not key or len(name.encode()) > _MAX_NAME_BYTES:
            raise UsageError(
                f"metadata key {key[:60]!r} is empty or too long for {self.url}",
                f"keep keys under {(_MAX_NAME_BYTES - 1) // 3} characters with the file backend",
            )
        return self._entries / name

    def _entry_files(self) -> tuple[Path, ...]:
        try:
            return tuple(p for p in self._entries.iterdir() if p.name.startswith("k"))
        except OSError as exc:
            raise self._os_error("list", self._entries, exc) from exc

    def _read_json(self, path: Path) -> dict[str, Any] | None:
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._os_error("read", path, exc) from exc
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise MetadataError(f"metadata file {path} is corrupt",
                                "delete it (its entry is lost) and republish")
        return record

    def _read_entry(self, path: Path) -> tuple[str, bytes, LeaseId | None] | None:
        record = self._read_json(path)
        if record is None:
            return None
        try:
            value = base64.b64decode(record["value"], validate=True)
            lease = record["lease"]
            return str(record["key"]), value, None if lease is None else LeaseId(int(lease))
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise MetadataError(f"metadata file {path} is corrupt ({exc})",
                                "delete it (its entry is lost) and republish") from exc

    def _lease_alive(self, lease: LeaseId, now: float) -> bool:
        record = self._read_json(self._leases / str(int(lease)))
        try:
            return record is not None and float(record["deadline"]) > now
        except (KeyError, TypeError, ValueError) as exc:
            raise MetadataError(f"lease file {self._leases / str(lease)} is corrupt",
                                "delete it and republish") from exc

    def _visible(self, entry: tuple[str, bytes, LeaseId | None], now: float,
                 cache: dict[LeaseId, bool]) -> bool:
        lease = entry[2]
        if lease is None:
            return True
        if lease not in cache:
            cache[lease] = self._lease_alive(lease, now)
        return cache[lease]

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            with tmp.open("w", encoding="utf-8") as fh:
                json.dump(record, fh)
            tmp.replace(path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self._os_error("write", path, exc) from exc

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise self._os_error("remove", path, exc) from exc

    def _remove_if_expired(self, paths: Sequence[Path]) -> None:
        with self._locked():
            now = time.time()
            for path in paths:
                entry = self._read_entry(path)
                if entry is not None and not self._visible(entry, now, {}):
                    self._unlink(path)

    def _drop_lease(self, lease: LeaseId) -> None:
        """Remove a lease and its entries (caller holds the lock)."""
        self._unlink(self._leases / str(int(lease)))
        for path in self._entry_files():
            entry = self._read_entry(path)
            if entry is not None and entry[2] == lease:
                self._unlink(path)

    def _sweep(self, now: float) -> None:
        """Remove expired leases, their entries and stale temporary files (lock held)."""
        self._last_sweep = now
        dead: set[LeaseId] = set()
        for folder in (self._leases, self._entries):
            try:
                paths = tuple(folder.iterdir())
            except OSError as exc:
                raise self._os_error("list", folder, exc) from exc
            for path in paths:
                name = path.name
                if name.startswith(".tmp-"):
                    with contextlib.suppress(OSError):
                        if now - path.stat().st_mtime > _STALE_TMP_S:
                            path.unlink()
                elif (folder is self._leases and name.isdigit()
                      and not self._lease_alive(LeaseId(int(name)), now)):
                    dead.add(LeaseId(int(name)))
                    self._unlink(path)
        for path in self._entry_files():
            entry = self._read_entry(path)
            if entry is not None and entry[2] is not None and (
                entry[2] in dead or not self._lease_alive(entry[2], now)
            ):
                self._unlink(path)
        if dead:
            _log.debug("swept %d expired leases from %s", len(dead), self.root)

    def _os_error(self, action: str, path: Path, exc: OSError) -> MetadataError:
        return MetadataError(
            f"cannot {action} {path} for metadata {self.url}: {exc.strerror or exc}",
            "check that the directory exists, is writable and is not full",
        )


def _key_of(name: str) -> str | None:
    if not name.startswith("k"):
        return None
    return urllib.parse.unquote(name[1:])


@register_backend("file")
def _open(parsed: urllib.parse.SplitResult, url: str, options: MetadataOptions) -> MetadataClient:
    if parsed.netloc not in ("", "localhost"):
        raise UsageError(
            f"metadata URL {url!r} names host {parsed.netloc!r}; file:// is local to one host",
            "write three slashes for an absolute directory, e.g. file:///var/lib/kvctl/metadata",
        )
    path = urllib.parse.unquote(parsed.path)
    if not path.startswith("/") or path == "/":
        raise UsageError(f"metadata URL {url!r} does not name an absolute directory",
                         "write e.g. file:///var/lib/kvctl/metadata")
    return FileMetadata(Path(path))
