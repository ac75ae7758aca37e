"""The SSD tier of a storage node: one file per object, verified on every read.

File layout (little endian)::

    magic "KVSO" | format u8 | pad | key_len u16 | size u64 | checksum u64 | version u64
    key (UTF-8) | object bytes

A file is written to a temporary name and renamed into place, so a reader sees either the
whole file or none; a file torn or corrupted anyway (crash without fsync, bad sector, a
truncated copy, a bit flip on a distributed file system) fails the header or checksum check
and is reported as :class:`SsdCorruptError`: the node deletes it and the master treats the
object as missing there. It is never served.

The directory may be on a distributed file system (3FS, NFS, CephFS): every node needs its
own directory (the node id is a subdirectory), the file system must make ``rename`` atomic
and visible to later opens (close-to-open consistency, as NFS gives), and it should be
mounted without client-side write-back caching that reorders data after rename (or set
``fsync=True``). See docs/store.md.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import xxhash

from kvctl.errors import UsageError
from kvctl.fsafe import create_private, private_dir, write_private_atomically
from kvctl.store.checksum import checksum
from kvctl.store.errors import StoreError

_HEADER = struct.Struct("<4sBxHQQQ")
_MAGIC = b"KVSO"
_FORMAT = 1


class SsdCorruptError(StoreError):
    """An SSD file failed its header or checksum check (torn, truncated or flipped)."""


class SsdStaleError(StoreError):
    """The DRAM copy changed before it could be persisted (removed or overwritten)."""


class SsdMissingError(StoreError):
    """No SSD file for the object (never written, or dropped)."""


class SsdTier:
    """Object files under ``directory`` (created if missing).

    Args:
        directory: where the files go (local SSD or a distributed file system mount).
        fsync: ``fsync`` each file before renaming it (durable across host crashes; slower).
    """

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = directory
        self.fsync = fsync
        try:
            private_dir(directory, what="SSD tier directory")
            fd, probe = create_private(directory, "kvctl-probe")
            os.close(fd)
            probe.unlink()
        except OSError as exc:
            raise UsageError(f"SSD directory {directory} is not writable: {exc.strerror or exc}",
                             "pass a writable --ssd directory") from exc

    def path_for(self, key: str) -> Path:
        """The file that holds ``key`` (named by a hash: keys may hold any character)."""
        return self.directory / (xxhash.xxh3_128_hexdigest(key.encode()) + ".kvo")

    def write(self, key: str, version: int, data: memoryview, expected_checksum: int) -> None:
        """Persist ``data`` for ``key``.

        Raises:
            SsdStaleError: ``data`` does not match ``expected_checksum`` (the DRAM copy
                changed under us: the file is not written).
            OSError: the file system failed (disk full, I/O error).
        """
        if checksum(data) != expected_checksum:
            raise SsdStaleError(f"DRAM copy of {key!r} does not match its checksum",
                                  "the object was overwritten while being persisted")
        kb = key.encode()
        header = _HEADER.pack(_MAGIC, _FORMAT, len(kb), data.nbytes, expected_checksum,
                              version)
        write_private_atomically(self.path_for(key), [header + kb, data], fsync=self.fsync)

    def read_into(self, key: str, dest: memoryview, expected_checksum: int) -> None:
        """Fill ``dest`` (exactly the object's size) with the verified SSD copy.

        Raises:
            SsdMissingError: no file for ``key``.
            SsdCorruptError: the file is torn, truncated, for another key, or fails its
                checksum (it is deleted).
        """
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise SsdMissingError(f"no SSD copy of {key!r}", "it was never persisted") from None
        try:
            kb = key.encode()
            head = os.pread(fd, _HEADER.size + len(kb), 0)
            if len(head) < _HEADER.size + len(kb):
                raise SsdCorruptError(f"SSD copy of {key!r} is truncated (header)", None)
            magic, fmt, key_len, size, csum, _version = _HEADER.unpack_from(head)
            if magic != _MAGIC or fmt != _FORMAT or key_len != len(kb) or (
                    head[_HEADER.size:] != kb) or size != dest.nbytes or (
                    csum != expected_checksum):
                raise SsdCorruptError(f"SSD copy of {key!r} has a bad header", None)
            got = 0
            base = _HEADER.size + len(kb)
            while got < size:
                n = os.preadv(fd, [dest[got:]], base + got)
                if n == 0:
                    raise SsdCorruptError(f"SSD copy of {key!r} is truncated ({got} of {size} "
                                          "bytes)", None)
                got += n
            if os.fstat(fd).st_size != base + size:
                raise SsdCorruptError(f"SSD copy of {key!r} has trailing bytes", None)
            if checksum(dest) != expected_checksum:
                raise SsdCorruptError(f"SSD copy of {key!r} fails its checksum", None)
        except SsdCorruptError:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        finally:
            os.close(fd)

    def drop(self, key: str) -> None:
        """Delete the SSD copy of ``key`` if there is one."""
        with contextlib.suppress(FileNotFoundError):
            self.path_for(key).unlink()

    def clear(self) -> int:
        """Delete every object file (a node starting with new memory); returns how many."""
        count = 0
        for path in self.directory.glob("*.kvo"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                count += 1
        for path in self.directory.glob(".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return count
