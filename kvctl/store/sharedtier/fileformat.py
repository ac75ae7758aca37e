"""Shared-tier object files: names, header, atomic write, verified read.

One object per file, named by the key's hash and the object's version (versions are
unique across keys within a master's state, so two objects never share a name, and an
overwrite never replaces the file a reader of the older version is reading)::

    ROOT/<first 2 hex digits>/<xxh3-128 of the key, 32 hex>-<version, hex>.kvs

File layout (little endian)::

    magic "KVST" | format u8 | pad | key_len u16 | size u64 | checksum u64 | version u64
    | writer epoch (8 bytes) | key (UTF-8) | object bytes

A writer creates a temporary name in the same directory (``.<name>.<random>.tmp``),
writes, ``fsync``s and renames it into place, so on a file system with atomic rename a
reader sees the whole file or none. A reader checks every header field against what the
master's index says (key, size, checksum, version) and the bytes against the checksum;
anything else (missing, torn, truncated, trailing bytes, flipped) is a
:class:`SharedMissError`: a miss, never served.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from pathlib import Path

import xxhash

from kvctl.fsafe import write_private_atomically
from kvctl.store.checksum import checksum
from kvctl.store.errors import StoreError

HEADER = struct.Struct("<4sBxHQQQ8s")
MAGIC = b"KVST"
FORMAT = 1
SUFFIX = ".kvs"
#: ``<32 hex>-<version hex>.kvs``
NAME_RE = re.compile(r"^([0-9a-f]{32})-([0-9a-f]{1,16})\.kvs$")
#: errno names the master counts separately (the rest count as ``other``).
COUNTED_ERRNOS = ("ENOSPC", "EDQUOT", "ESTALE", "EIO")


class SharedMissError(StoreError):
    """The shared-tier file is missing, torn, or not the object the index names."""


def file_name(key: str, version: int) -> str:
    """Relative path of ``key``'s file at ``version`` (``xx/<hash>-<version>.kvs``)."""
    digest = xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogatepass"))
    return f"{digest[:2]}/{digest}-{version:x}{SUFFIX}"


def header_bytes(key: str) -> int:
    """Bytes before the object's data in its file."""
    return HEADER.size + len(key.encode("utf-8", "surrogatepass"))


def file_bytes(key: str, size: int) -> int:
    """Size of the whole file of a ``size``-byte object."""
    return header_bytes(key) + size


def errno_name(exc: OSError) -> str:
    """``ENOSPC``, ``EDQUOT``, ``ESTALE`` ... for ``exc`` (``EIO`` when it has none)."""
    return errno.errorcode.get(exc.errno or errno.EIO, "EIO")


def write_object(path: Path, key: str, version: int, data: memoryview, csum: int,
                 epoch: str, *, fsync: bool = True) -> None:
    """Write ``data`` as ``key``'s file at ``path``: temporary name, fsync, rename.

    Raises:
        OSError: the file system failed (``ENOSPC``, ``EDQUOT``, ``ESTALE``, ``EIO``);
            the temporary file is removed.
    """
    kb = key.encode("utf-8", "surrogatepass")
    head = HEADER.pack(MAGIC, FORMAT, len(kb), data.nbytes, csum, version,
                       bytes.fromhex(epoch[:16].ljust(16, "0"))) + kb
    try:
        write_private_atomically(path, [head, data], fsync=fsync)
    except FileNotFoundError:  # the first file of its subdirectory
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private_atomically(path, [head, data], fsync=fsync)


def read_into(path: Path, key: str, version: int, csum: int, dest: memoryview) -> None:
    """Fill ``dest`` (exactly the object's size) from ``key``'s file, verified.

    One ``preadv`` reads the header, the bytes and one byte past them (a longer file is
    not this object).

    Raises:
        SharedMissError: missing, torn, truncated, longer, another object, or the bytes
            fail the checksum.
    """
    kb = key.encode("utf-8", "surrogatepass")
    head = bytearray(HEADER.size + len(kb))
    fd = _open(path, key)
    try:
        got = _preadv_all(fd, [memoryview(head), dest, memoryview(bytearray(1))], key)
    finally:
        os.close(fd)
    _check(head, got - len(head), kb, key, version, csum, dest.nbytes)
    if checksum(dest) != csum:
        raise SharedMissError(f"shared-tier file of {key!r} fails its checksum", None)


def read_bytes(path: Path, key: str, version: int, csum: int, size: int) -> bytes:
    """The verified bytes of ``key``'s file (``size`` bytes), read into a new ``bytes``
    (two ``pread`` calls: the header, then the data and one byte past it).

    Raises:
        SharedMissError: as :func:`read_into`.
    """
    kb = key.encode("utf-8", "surrogatepass")
    fd = _open(path, key)
    try:
        head = os.pread(fd, HEADER.size + len(kb), 0)
        data = os.pread(fd, size + 1, len(head)) if len(head) == HEADER.size + len(kb) else b""
        if len(head) == HEADER.size + len(kb) and len(data) < size:
            data += _pread_rest(fd, size + 1 - len(data), len(head) + len(data))
    except OSError as exc:
        raise SharedMissError(f"shared-tier file of {key!r} cannot be read: "
                              f"{errno_name(exc)}", None) from None
    finally:
        os.close(fd)
    _check(head, len(data), kb, key, version, csum, size)
    if checksum(data) != csum:
        raise SharedMissError(f"shared-tier file of {key!r} fails its checksum", None)
    return data


def _open(path: str | Path, key: str) -> int:
    """A regular file's descriptor (a link, FIFO or device planted at the name is a miss:
    ``O_NOFOLLOW``, and ``O_NONBLOCK`` so that opening a FIFO cannot hang)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise SharedMissError(f"shared-tier file of {key!r} cannot be opened: "
                              f"{errno_name(exc)}", "it was evicted or purged") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SharedMissError(f"shared-tier file of {key!r} is not a regular file", None)
    return fd


def _preadv_all(fd: int, views: list[memoryview], key: str) -> int:
    """Read into ``views`` from offset 0 until they are full or the file ends; bytes read."""
    want = sum(v.nbytes for v in views)
    got = 0
    try:
        while got < want:
            skip, bufs = got, []
            for v in views:
                if skip >= v.nbytes:
                    skip -= v.nbytes
                    continue
                bufs.append(v[skip:])
                skip = 0
            n = os.preadv(fd, bufs, got)
            if n == 0:
                break
            got += n
    except OSError as exc:
        raise SharedMissError(f"shared-tier file of {key!r} cannot be read: "
                              f"{errno_name(exc)}", None) from None
    return got


def _pread_rest(fd: int, count: int, offset: int) -> bytes:
    parts: list[bytes] = []
    while count > 0:
        chunk = os.pread(fd, count, offset)
        if not chunk:
            break
        parts.append(chunk)
        count -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _check(head: bytes | bytearray, data_bytes: int, kb: bytes, key: str, version: int,
           csum: int, size: int) -> None:
    """The header names exactly this object and exactly ``size`` bytes follow it."""
    if len(head) < HEADER.size + len(kb) or data_bytes != size:
        what = "longer than its object" if data_bytes > size else "truncated"
        raise SharedMissError(f"shared-tier file of {key!r} is {what}", None)
    magic, fmt, key_len, fsize, fsum, fversion, _epoch = HEADER.unpack_from(head)
    if magic != MAGIC or fmt != FORMAT or key_len != len(kb) or fsize != size or (
            fsum != csum) or fversion != version or bytes(head[HEADER.size:]) != kb:
        raise SharedMissError(f"shared-tier file of {key!r} has a header for another "
                              "object (torn or reused)", None)


def read_header(path: str | Path) -> tuple[str, int, int, int] | None:
    """``(key, version, size, checksum)`` from a file's header, ``None`` when it has no
    valid one (the purge sweep's view: it never reads object bytes)."""
    try:
        fd = _open(path, "")
    except SharedMissError:
        return None
    try:
        head = os.pread(fd, HEADER.size + 4096 * 4, 0)
    finally:
        os.close(fd)
    if len(head) < HEADER.size:
        return None
    magic, fmt, key_len, size, csum, version, _epoch = HEADER.unpack_from(head)
    if magic != MAGIC or fmt != FORMAT or len(head) < HEADER.size + key_len:
        return None
    try:
        key = head[HEADER.size:HEADER.size + key_len].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    return key, version, size, csum
