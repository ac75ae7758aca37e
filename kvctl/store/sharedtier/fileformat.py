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
#: the header's fields a reader checks against the index (all but the writer's epoch)
_CHECKED = struct.Struct("<4sBxHQQQ")
MAGIC = b"KVST"
FORMAT = 1
SUFFIX = ".kvs"
#: ``<32 hex>-<version hex>.kvs``
NAME_RE = re.compile(r"^([0-9a-f]{32})-([0-9a-f]{1,16})\.kvs$")
#: errno names the master counts separately (the rest count as ``other``).
COUNTED_ERRNOS = ("ENOSPC", "EDQUOT", "ESTALE", "EIO")
#: how readers open tier files, and (one item) with ``O_NOATIME``, until the first ``EPERM``
#: (a file this user neither owns nor may touch the times of)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_NOATIME = getattr(os, "O_NOATIME", 0)
_READ_FLAGS = [_OPEN_FLAGS | _NOATIME]


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
                 epoch: str, *, fsync: bool = True, marker: str = "") -> None:
    """Write ``data`` as ``key``'s file at ``path``: temporary name, fsync, rename
    (``marker``: a subdirectory is made only in a root holding a file of that name).

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
        _make_subdir(path, marker)
        write_private_atomically(path, [head, data], fsync=fsync)


def _make_subdir(path: Path, marker: str) -> None:
    """Create ``path``'s directory (``xx/`` or ``pk/``) in the tier root, never the root
    itself: a root gone (a distributed file system unmounted, its directory removed), or
    one without ``marker`` (the empty mount point it left), is an error (``ENOENT``), not a
    local directory that silently takes the copies.

    Raises:
        OSError: the root or its marker is missing (``ENOENT``), or the file system failed.
    """
    root = path.parent.parent
    if marker and not os.path.lexists(root / marker):
        raise FileNotFoundError(errno.ENOENT, "not the shared tier (its marker file "
                                f"{marker} is missing: not mounted?)", str(root))
    path.parent.mkdir(mode=0o700, exist_ok=True)


def read_object(path: str | Path, key: str, version: int, csum: int, size: int,
                dest: memoryview | None = None) -> bytes | None:
    """The verified bytes of ``key``'s file at ``path`` (a single-object file): a new
    ``bytes``, or with ``dest`` (exactly ``size`` bytes) ``None`` once they are in it.

    The system calls of a bare read: ``open``, one ``preadv`` of the header into scratch,
    the bytes straight into ``dest`` and one byte past them into scratch (a longer file is
    not this object), ``close``; for ``bytes`` a ``pread`` of the header and one of the
    bytes and one past them, so the result is the object itself, not a slice copied out of
    a larger read. No ``fstat``: a FIFO, directory or tty fails the read (``ESPIPE``,
    ``EISDIR``) and any other non-regular file the header check. The header is compared
    against the index's key, size, checksum and version, and the bytes against the checksum.

    Raises:
        SharedMissError: missing, not a regular file, torn, truncated, longer, another
            object or format, or the bytes fail the checksum.
    """
    kb = key.encode("utf-8", "surrogatepass")
    hsize = HEADER.size + len(kb)
    head = bytearray(hsize)
    try:
        fd = os.open(path, _READ_FLAGS[0])
    except OSError as exc:
        fd = _reopen(path, key, exc)
    try:
        if dest is None:
            got = os.preadv(fd, [head], 0)
            data = os.pread(fd, size + 1, hsize) if got == hsize else b""
            if got == hsize and len(data) < size:  # a short read (a signal, some FUSE)
                data += _pread_rest(fd, size + 1 - len(data), hsize + len(data))
            got += len(data)
        else:
            views: list[bytearray | memoryview] = [head, dest, bytearray(1)]
            got = os.preadv(fd, views, 0)
            if got < hsize + size:  # a short read: the rest, or the end (torn under us)
                got = _preadv_all(fd, [memoryview(v) for v in views], 0)
    except OSError as exc:
        raise SharedMissError(f"shared-tier file of {key!r} cannot be read: "
                              f"{errno_name(exc)}", None) from None
    finally:
        os.close(fd)
    if got != hsize + size:
        what = "longer than its object" if got > hsize + size else "truncated"
        raise SharedMissError(f"shared-tier file of {key!r} is {what}", None)
    _check_record("file", key, head, kb, version, csum, size,
                  data if dest is None else dest)
    return data if dest is None else None


def _check_record(what: str, key: str, head: bytes | bytearray, kb: bytes, version: int,
                  csum: int, size: int, body: bytes | bytearray | memoryview) -> None:
    """A record's header against the index's key, size, checksum and version, and its
    bytes against the checksum (``what``: ``file`` or ``pack record``, for the error).

    Raises:
        SharedMissError: a header for another object, or bytes that fail the checksum.
    """
    if not head.startswith(_CHECKED.pack(MAGIC, FORMAT, len(kb), size, csum, version)) or (
            not head.endswith(kb)):
        raise SharedMissError(f"shared-tier {what} of {key!r} has a header for another "
                              "object (torn or reused)", None)
    if checksum(body) != csum:
        raise SharedMissError(f"shared-tier {what} of {key!r} fails its checksum", None)


def read_into(path: str | Path, key: str, version: int, csum: int, dest: memoryview) -> None:
    """Fill ``dest`` (exactly the object's size) from ``key``'s file, verified
    (:func:`read_object`).

    Raises:
        SharedMissError: as :func:`read_object`.
    """
    read_object(path, key, version, csum, dest.nbytes, dest)


def read_bytes(path: str | Path, key: str, version: int, csum: int, size: int) -> bytes:
    """The verified bytes of ``key``'s file (``size`` bytes) in a new ``bytes``
    (:func:`read_object`).

    Raises:
        SharedMissError: as :func:`read_object`.
    """
    data = read_object(path, key, version, csum, size)
    assert data is not None
    return data


def _open(path: str | Path, key: str) -> int:
    """A descriptor of ``path``, regular file or not (a link planted at the name is a miss:
    ``O_NOFOLLOW``; ``O_NONBLOCK`` so that opening a FIFO cannot hang; ``O_NOATIME`` where
    this user may, so a read writes no inode back to the file system)."""
    try:
        return os.open(path, _READ_FLAGS[0])
    except OSError as exc:
        return _reopen(path, key, exc)


def _reopen(path: str | Path, key: str, exc: OSError) -> int:
    """After an open of ``path`` failed with ``exc``: again without ``O_NOATIME`` when that
    was what was refused (``EPERM``: a file of another user), else a miss."""
    # Whatever _READ_FLAGS says now: another reading thread may have cleared it since
    # this thread's open, which still asked for O_NOATIME (a real EPERM costs one more try).
    if exc.errno == errno.EPERM and _NOATIME:
        _READ_FLAGS[0] = _OPEN_FLAGS
        try:
            return os.open(path, _OPEN_FLAGS)
        except OSError as again:
            exc = again
    raise SharedMissError(f"shared-tier file of {key!r} cannot be opened: "
                          f"{errno_name(exc)}", "it was evicted or purged") from None


def _preadv_all(fd: int, views: list[memoryview], at: int) -> int:
    """Read into ``views`` in turn from byte ``at`` until they are full or the file ends;
    bytes read."""
    want = sum(v.nbytes for v in views)
    got = 0
    while got < want:
        skip, bufs = got, []
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            bufs.append(v[skip:])
            skip = 0
        n = os.preadv(fd, bufs, at + got)
        if n == 0:
            break
        got += n
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


def read_header(path: str | Path) -> tuple[str, int, int, int] | None:
    """``(key, version, size, checksum)`` from a file's header, ``None`` when it has no
    valid one (the purge sweep's view: it never reads object bytes)."""
    try:
        fd = _open(path, "")
    except SharedMissError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, HEADER.size + 4096 * 4, 0)
    except OSError:
        return None
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


# ---- pack files: several small objects in one file (one fsync, one rename, one name)
#
# A pack is named by the id the master gives it, in a directory of its own beside the
# ``xx/`` ones (``pk`` is no hex prefix)::
#
#     ROOT/pk/<pack id, hex>.kvp
#
# and holds records each exactly in the single-file layout above (header, key, bytes), at
# the offsets the master chose (multiples of :data:`PACK_ALIGN`; the gaps are zeros), then
# a trailer that makes the pack self-describing: the records' offsets (u64 each), magic
# ``KVPK`` and their count (u32). A reader reads one record at the offset the index gives
# and checks it as it checks a single file; the trailer is for tools and the sweep.

PACK_DIR = "pk"
PACK_SUFFIX = ".kvp"
PACK_MAGIC = b"KVPK"
PACK_TAIL = struct.Struct("<4sI")
#: offsets of records in a pack are multiples of this
PACK_ALIGN = 4096
#: most records a pack's trailer may list (--shared-tier-pack-entries is at most 4096)
PACK_MAX_COUNT = 4096
#: ``<pack id hex>.kvp``
PACK_NAME_RE = re.compile(r"^([0-9a-f]{1,16})\.kvp$")


def pack_name(pack_id: int) -> str:
    """Relative path of pack ``pack_id`` (``pk/<id hex>.kvp``)."""
    return f"{PACK_DIR}/{pack_id:x}{PACK_SUFFIX}"


def entry_span(key: str, size: int) -> int:
    """Bytes a ``size``-byte object's record takes in a pack, its padding included."""
    return -(-file_bytes(key, size) // PACK_ALIGN) * PACK_ALIGN


def pack_bytes(end: int, entries: int) -> int:
    """Size of a pack whose records end at ``end`` (its trailer included)."""
    return end + 8 * entries + PACK_TAIL.size


def write_pack(path: Path, entries: list[tuple[str, int, int, int, memoryview]], epoch: str,
               *, fsync: bool = True, marker: str = "") -> None:
    """Write a pack at ``path``: each ``(key, version, checksum, at, data)`` as a record at
    byte ``at`` (increasing, :data:`PACK_ALIGN` multiples), then the trailer; temporary
    name, fsync, rename, as :func:`write_object`.

    Raises:
        OSError: the file system failed; the temporary file is removed.
    """
    tag = bytes.fromhex(epoch[:16].ljust(16, "0"))
    parts: list[bytes | memoryview] = []
    end = 0
    for key, version, csum, at, data in entries:
        if at < end:
            raise ValueError(f"pack record of {key!r} at {at} overlaps the one before")
        if at > end:
            parts.append(bytes(at - end))
        kb = key.encode("utf-8", "surrogatepass")
        parts.append(HEADER.pack(MAGIC, FORMAT, len(kb), data.nbytes, csum, version, tag) + kb)
        parts.append(data)
        end = at + HEADER.size + len(kb) + data.nbytes
    parts.append(struct.pack(f"<{len(entries)}Q", *(e[3] for e in entries))
                 + PACK_TAIL.pack(PACK_MAGIC, len(entries)))
    # never over a pack already there: an id is given again after a master restart (past
    # the ids its state names), and a node still writing the last run's pack of that id
    # would rename it over the new one the index names
    try:
        write_private_atomically(path, parts, fsync=fsync, replace=False)
    except FileNotFoundError:  # the first pack
        _make_subdir(path, marker)
        write_private_atomically(path, parts, fsync=fsync, replace=False)


def read_entry(path: str | Path, at: int, key: str, version: int, csum: int, size: int,
               dest: memoryview | None = None) -> bytes | None:
    """The verified bytes of ``key``'s record at byte ``at`` of the pack at ``path``, as
    :func:`read_object` reads a single file (a new ``bytes``, or ``None`` once in ``dest``);
    what follows the record is the pack's, not checked.

    Raises:
        SharedMissError: missing, cut short, another object's record (or none) at ``at``,
            or the bytes fail the checksum.
    """
    fd = open_pack(path, key)
    try:
        return read_record(fd, at, key, version, csum, size, dest)
    finally:
        os.close(fd)


def open_pack(path: str | Path, key: str) -> int:
    """A descriptor of the pack at ``path`` for :func:`read_record` (``key``: the object
    a failure names).

    Raises:
        SharedMissError: it cannot be opened (missing, a link).
    """
    return _open(path, key)


def read_record(fd: int, at: int, key: str, version: int, csum: int, size: int,
                dest: memoryview | None = None) -> bytes | None:
    """:func:`read_entry` from an open pack (a batch reads several records of one pack
    with one ``open``).

    Raises:
        SharedMissError: as :func:`read_entry`.
    """
    kb = key.encode("utf-8", "surrogatepass")
    hsize = HEADER.size + len(kb)
    try:
        if dest is None:
            head: bytes | bytearray = os.pread(fd, hsize, at)
            data = os.pread(fd, size, at + hsize) if len(head) == hsize else b""
            if len(head) == hsize and len(data) < size:  # a short read, or the end
                data += _pread_rest(fd, size - len(data), at + hsize + len(data))
            got = len(head) + len(data)
        else:
            head = bytearray(hsize)
            views = [memoryview(head), dest]
            got = os.preadv(fd, views, at)
            if got < hsize + size:  # a short read: the rest, or the end (cut under us)
                got = _preadv_all(fd, views, at)
    except OSError as exc:
        raise SharedMissError(f"shared-tier pack record of {key!r} cannot be read: "
                              f"{errno_name(exc)}", None) from None
    if got != hsize + size:
        raise SharedMissError(f"shared-tier pack record of {key!r} is truncated", None)
    _check_record("pack record", key, head, kb, version, csum, size,
                  data if dest is None else dest)
    return data if dest is None else None


def read_pack_offsets(path: str | Path) -> list[int] | None:
    """The record offsets a pack's trailer lists, ``None`` without a valid trailer."""
    try:
        fd = _open(path, "")
    except SharedMissError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < PACK_TAIL.size:
            return None
        magic, count = PACK_TAIL.unpack(os.pread(fd, PACK_TAIL.size,
                                                 info.st_size - PACK_TAIL.size))
        start = info.st_size - PACK_TAIL.size - 8 * count
        if magic != PACK_MAGIC or start < 0 or count > PACK_MAX_COUNT:
            return None  # (a sparse file's trailer could ask for a read of 32 GiB)
        raw = os.pread(fd, 8 * count, start)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != 8 * count:
        return None
    return list(struct.unpack(f"<{count}Q", raw))
