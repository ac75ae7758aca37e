"""Segments: named, registered ranges of memory made of one or more buffers.

A segment's address space is the concatenation of its buffers: buffer *i* covers
``[offset_i, offset_i + length_i)``. A request must fall entirely inside one buffer.

Kinds of backing store:

- ``shm``: host DRAM in a ``/dev/shm`` file mapped ``MAP_SHARED``, so another process on the
  same host can map the same pages (the ``shm`` transport does exactly that).
- ``file``: a file on local disk, read and written with positional I/O (``os.preadv`` into
  memoryviews, ``os.pwrite`` from them); peers on the same host open the same path.
- ``gpu``: CUDA memory through torch (imported lazily); TCP stages through pinned memory.
- ``host``: a caller-owned writable buffer (``bytearray``, ``mmap``, numpy array) wrapped with
  :func:`wrap_memory`; only this process can map it, so it is served over TCP.

:class:`SegmentInfo` is what gets published in the metadata service; :class:`LocalSegment`
is the registered object with its buffers.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import hashlib
import hmac
import importlib
import json
import logging
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.net import auth
from kvctl.transfer import shmfiles
from kvctl.transfer.errors import BusyError, OutOfRangeError

_log = logging.getLogger("kvctl.transfer")

SEGMENT_KINDS = ("shm", "file", "gpu", "host")
SHM_DIR = Path("/dev/shm")
#: Map with page tables filled up front: no page faults on the data path.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Version of the published segment descriptor.
DESCRIPTOR_VERSION = 1


def host_id() -> str:
    """This host's identity: hostname plus kernel boot id, so peers can tell same-host."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    return f"{socket.gethostname()}/{boot}"


def parse_location(text: str) -> str:
    """Validate a buffer location: ``cpu:N``, ``cuda:N`` or ``file``."""
    kind, sep, index = text.partition(":")
    if text == "file" or (sep and kind in ("cpu", "cuda") and index.isascii() and index.isdigit()):
        return text
    raise UsageError(f"buffer location {text!r} is not valid", "write cpu:N, cuda:N or file")


def validate_name(name: str) -> str:
    """Segment and engine names: 1-128 printable characters, no '/' or whitespace."""
    if not name or len(name) > 128 or "/" in name or not name.isprintable() or " " in name:
        raise UsageError(
            f"name {name!r} is not a valid segment name",
            "use 1-128 letters, digits, '-', '_', '.' or ':' (no '/' or spaces)",
        )
    return name


# ---------------------------------------------------------------------------- buffers


class LocalBuffer:
    """One buffer of a locally registered (or locally mapped) segment.

    Attributes:
        offset: start of the buffer in its segment's address space, bytes.
        length: size in bytes.
        location: ``cpu:N``, ``cuda:N`` or ``file``.
        view: a writable byte memoryview when the memory is directly addressable (shm,
            host); ``None`` for files and GPU memory, which use :meth:`read_into` and
            :meth:`write_from`.
    """

    def __init__(self, offset: int, length: int, location: str) -> None:
        self.offset = offset
        self.length = length
        self.location = location
        self.view: memoryview | None = None

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Copy ``len(dest)`` bytes from buffer-relative ``offset`` into ``dest``."""
        if self.view is None:  # pragma: no cover - subclasses without views override
            raise NotImplementedError
        dest[:] = self.view[offset : offset + dest.nbytes]

    def write_from(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the buffer at buffer-relative ``offset``."""
        if self.view is None:  # pragma: no cover - subclasses without views override
            raise NotImplementedError
        self.view[offset : offset + src.nbytes] = src

    def close(self) -> None:
        """Release the buffer's mapping or descriptor (idempotent)."""


class MemoryBuffer(LocalBuffer):
    """A directly addressable buffer over a memoryview (an mmap slice or caller memory)."""

    def __init__(self, offset: int, view: memoryview, location: str,
                 owner: mmap.mmap | None = None) -> None:
        super().__init__(offset, view.nbytes, location)
        self.view = view
        self._owner = owner
        self._anchor: ctypes.c_char | None = None
        self._address = 0

    @property
    def address(self) -> int:
        """Virtual address of the buffer's first byte (for memmove and RDMA registration)."""
        if not self._address:
            if self.view is None:
                raise ValueError("buffer is closed")
            self._anchor = ctypes.c_char.from_buffer(self.view)  # pins the mapping
            self._address = ctypes.addressof(self._anchor)
        return self._address

    def close(self) -> None:
        self._anchor = None  # drop our export before releasing the view
        self._address = 0
        if self.view is not None:
            self.view.release()
            self.view = None
        if self._owner is not None:
            try:
                self._owner.close()
            except BufferError:
                # A caller still holds a view into it; the pages go when that view goes.
                _log.debug("mapping still exported at close; left to the garbage collector")
            self._owner = None


class FileBuffer(LocalBuffer):
    """A range of a file accessed with positional I/O (no shared file position, no locks)."""

    def __init__(self, offset: int, length: int, fd: int, file_offset: int,
                 own_fd: bool) -> None:
        super().__init__(offset, length, "file")
        self._fd = fd
        self._file_offset = file_offset
        self._own_fd = own_fd

    def read_into(self, offset: int, dest: memoryview) -> None:
        done = 0
        want = dest.nbytes
        while done < want:
            n = os.preadv(self._fd, [dest[done:]], self._file_offset + offset + done)
            if n == 0:  # reading past the end of a sparse/short file yields zeros
                dest[done:] = bytes(want - done)
                return
            done += n

    def write_from(self, offset: int, src: memoryview) -> None:
        done = 0
        while done < src.nbytes:
            done += os.pwrite(self._fd, src[done:], self._file_offset + offset + done)

    def close(self) -> None:
        if self._own_fd and self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


def _torch() -> Any:
    """torch, imported lazily (only GPU segments need it)."""
    return importlib.import_module("torch")


class GpuBuffer(LocalBuffer):
    """CUDA memory held by a torch tensor; host I/O stages through a pinned tensor.

    Attributes:
        device_index: the CUDA ordinal (as torch numbers devices, under
            ``CUDA_VISIBLE_DEVICES``).
    """

    def __init__(self, offset: int, tensor: Any, device_index: int) -> None:
        super().__init__(offset, int(tensor.numel()), f"cuda:{device_index}")
        self.device_index = device_index
        self._tensor = tensor
        self._lock = threading.Lock()
        self._staging: Any = None

    @property
    def device_pointer(self) -> int:
        """CUDA device address of the buffer's first byte (what a dma-buf export or a
        peermem memory registration takes).

        Raises:
            ValueError: the buffer is closed.
        """
        if self._tensor is None:
            raise ValueError("buffer is closed")
        return int(self._tensor.data_ptr())

    def _stage(self, nbytes: int) -> Any:
        torch = _torch()

        if self._staging is None or int(self._staging.numel()) < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes]

    def read_into(self, offset: int, dest: memoryview) -> None:
        torch = _torch()

        with self._lock:
            stage = self._stage(dest.nbytes)
            stage.copy_(self._tensor[offset : offset + dest.nbytes])
            torch.frombuffer(dest, dtype=torch.uint8).copy_(stage)

    def write_from(self, offset: int, src: memoryview) -> None:
        torch = _torch()

        with self._lock:
            stage = self._stage(src.nbytes)
            stage.copy_(torch.frombuffer(src, dtype=torch.uint8))
            self._tensor[offset : offset + src.nbytes].copy_(stage)

    def close(self) -> None:
        self._tensor = None
        self._staging = None


# ---------------------------------------------------------------------------- descriptors


@dataclasses.dataclass(frozen=True)
class BufferInfo:
    """A published buffer: where it sits in the segment and how a same-host peer maps it.

    Attributes:
        offset: start in the segment's address space, bytes.
        length: size, bytes.
        location: ``cpu:N``, ``cuda:N`` or ``file``.
        path: the ``/dev/shm`` or disk file backing it (``None`` when not mappable).
        file_offset: where the buffer starts inside ``path``, bytes.
    """

    offset: int
    length: int
    location: str
    path: str | None = None
    file_offset: int = 0


class DescriptorAuthError(UsageError):
    """A descriptor in the metadata service is not signed with the token in force."""


def descriptor_mac(token: str, key: str, body: dict[str, Any]) -> str:
    """HMAC-SHA256 (hex) of a descriptor: its metadata key and its JSON without ``sig``."""
    text = json.dumps({k: v for k, v in body.items() if k != "sig"}, sort_keys=True)
    return hmac.new(auth.secret(token), b"kvctl-descriptor/1\0" + key.encode() + b"\0"
                    + text.encode(), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """A segment as published under ``<prefix>segments/<name>``.

    Attributes:
        name: segment name.
        kind: ``shm``, ``file``, ``gpu`` or ``host``.
        engine: name of the engine serving it.
        host: :func:`host_id` of the serving host.
        pid: serving process id (for stale-entry cleanup).
        addresses: ``host:port`` of the target server, one per path the target offers.
        seg_id: id of the segment on that server (used in wire frames).
        transports: transports the target offers (``shm``, ``tcp``, ``rdma``).
        buffers: the segment's buffers, in offset order.
        auth: whether the target requires the shared token.
        rdma: per-buffer RDMA memory-region info (``addr``, ``rkey``) when offered.
    """

    name: str
    kind: str
    engine: str
    host: str
    pid: int
    addresses: tuple[str, ...]
    seg_id: int
    transports: tuple[str, ...]
    buffers: tuple[BufferInfo, ...]
    auth: bool = False
    rdma: tuple[dict[str, Any], ...] = ()

    @property
    def size_bytes(self) -> int:
        """End of the last buffer: the extent of the segment's address space."""
        return max((b.offset + b.length for b in self.buffers), default=0)

    def to_json(self, *, token: str | None = None, key: str = "") -> bytes:
        """Encode for the metadata service; with ``token``, signed for the entry ``key``
        (an HMAC over the key and the rest of the document, see :func:`descriptor_mac`)."""
        body: dict[str, Any] = dataclasses.asdict(self)
        body["version"] = DESCRIPTOR_VERSION
        if token is not None:
            body["sig"] = descriptor_mac(token, key, body)
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, source: str, token: str | None = None) -> SegmentInfo:
        """Decode a published descriptor; with ``token``, only one signed with it for the
        entry ``source`` (a rewrite by anyone without the token is refused).

        Raises:
            UsageError: the entry is not a valid descriptor (naming ``source``).
            DescriptorAuthError: ``token`` is set and the signature is missing or wrong.
        """
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise TypeError("not a JSON object")
            sig = body.pop("sig", None)
            if token is not None and not (isinstance(sig, str) and hmac.compare_digest(
                    sig, descriptor_mac(token, source, body))):
                raise DescriptorAuthError(
                    f"segment descriptor {source} is not signed with this side's token "
                    "(rewritten by someone without it, or published by an engine without "
                    "a token)",
                    "give every engine the same KVCTL_TOKEN; a rewritten entry is put back "
                    "by its engine within a few lease renewals")
            if body.pop("version", None) != DESCRIPTOR_VERSION:
                raise ValueError(f"descriptor version is not {DESCRIPTOR_VERSION}")
            buffers = tuple(BufferInfo(**b) for b in body.pop("buffers"))
            return cls(
                buffers=buffers,
                addresses=tuple(str(a) for a in body.pop("addresses")),
                transports=tuple(str(t) for t in body.pop("transports")),
                rdma=tuple(dict(r) for r in body.pop("rdma", ())),
                **body,
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise UsageError(
                f"metadata entry {source} is not a valid segment descriptor ({exc})",
                "remove the stale entry with 'kvctl segment rm' and register the segment again",
            ) from None


#: A view bytes land in, and the staging that must be copied to its buffer afterwards.
Staged = tuple["LocalBuffer", int, memoryview]


def landing_views(pieces: Iterable[tuple[LocalBuffer, int, int]]
                  ) -> tuple[list[memoryview], list[Staged]]:
    """Where received bytes land for each ``(buffer, buffer-relative offset, length)``:
    the buffer's own memory when it is mapped (no copy), else a scratch view listed in the
    second result, to be written with :meth:`LocalBuffer.write_from` after the receive."""
    views: list[memoryview] = []
    staged: list[Staged] = []
    for buf, rel, length in pieces:
        view = buf.view
        if view is not None:
            views.append(view[rel : rel + length])
        else:
            scratch = memoryview(bytearray(length))
            views.append(scratch)
            staged.append((buf, rel, scratch))
    return views, staged


def find_buffer(offsets: Sequence[int], lengths: Sequence[int], offset: int, length: int,
                *, segment: str) -> tuple[int, int]:
    """Index of the buffer holding ``[offset, offset+length)`` and the buffer-relative offset.

    The check is written so that huge values (``2**64 - 1``) cannot wrap: it compares
    ``offset - start`` against ``buffer_length - length`` with both sides non-negative.

    Raises:
        OutOfRangeError: negative values, or the range is not entirely inside one buffer.
    """
    if offset < 0 or length < 0:
        raise OutOfRangeError(
            f"range offset={offset} length={length} of segment {segment!r} is negative",
            "use non-negative offsets and lengths",
        )
    i = bisect.bisect_right(offsets, offset) - 1
    if i >= 0:
        rel = offset - offsets[i]
        blen = lengths[i]
        if length <= blen and rel <= blen - length:
            return i, rel
    raise OutOfRangeError(
        f"range offset={offset} length={length} is outside every buffer of segment {segment!r}",
        "keep each request inside one registered buffer (see 'kvctl segment show')",
    )


# ---------------------------------------------------------------------------- local segments


class LocalSegment:
    """A segment registered in this process: its buffers and in-flight accounting."""

    def __init__(self, name: str, kind: str, buffers: list[LocalBuffer], *,
                 owned_paths: Sequence[Path] = (), paths: Sequence[str | None] = (),
                 file_offsets: Sequence[int] = ()) -> None:
        self.name = validate_name(name)
        self.kind = kind
        self.buffers = buffers
        self.offsets = [b.offset for b in buffers]
        self.lengths = [b.length for b in buffers]
        self._paths = list(paths) or [None] * len(buffers)
        self._file_offsets = list(file_offsets) or [0] * len(buffers)
        self._owned_paths = list(owned_paths)
        self._inflight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        #: no new transfer may start (set by :meth:`close` and :meth:`retire`)
        self.closed = False
        self._freed = False

    @property
    def size_bytes(self) -> int:
        """Extent of the address space in bytes."""
        return max((o + n for o, n in zip(self.offsets, self.lengths, strict=True)), default=0)

    def buffer_infos(self) -> tuple[BufferInfo, ...]:
        """Descriptors of the buffers, as published."""
        return tuple(
            BufferInfo(b.offset, b.length, b.location, p, fo)
            for b, p, fo in zip(self.buffers, self._paths, self._file_offsets, strict=True)
        )

    def locate(self, offset: int, length: int) -> tuple[LocalBuffer, int]:
        """The buffer holding the range and the buffer-relative offset (see find_buffer)."""
        if len(self.buffers) == 1:  # fast path; same overflow-safe comparison
            size = self.lengths[0]
            if 0 <= length <= size and 0 <= offset <= size - length:
                return self.buffers[0], offset
        i, rel = find_buffer(self.offsets, self.lengths, offset, length, segment=self.name)
        return self.buffers[i], rel

    def acquire(self, count: int = 1) -> None:
        """Count ``count`` transfers as in flight on this segment."""
        with self._lock:
            self._inflight += count

    def release(self, count: int = 1) -> None:
        """Count ``count`` transfers as finished (the last one out of a retired segment
        unmaps it: see :meth:`retire`)."""
        with self._lock:
            self._inflight -= count
            if not self.closed or self._inflight > 0:
                return
            self._idle.notify_all()
            if self._freed:
                return
            self._freed = True
        self._free()

    @property
    def inflight(self) -> int:
        """Transfers currently using this segment."""
        return self._inflight

    def close(self) -> None:
        """Unmap and delete owned backing files.

        Raises:
            BusyError: transfers are in flight on this segment.
        """
        with self._lock:
            if self._inflight > 0:
                raise BusyError(
                    f"segment {self.name!r} has {self._inflight} transfer(s) in flight",
                    "wait for the batches using it to finish, then unregister",
                )
            if self.closed:
                return
            self.closed = True
            self._freed = True
        self._free()

    def retire(self, wait_s: float) -> bool:
        """Close without ever unmapping memory a transfer is using: no new transfer may
        start (``closed`` is set, and whoever acquires checks it), those in flight get up
        to ``wait_s`` seconds to finish, and the memory goes now if they did, else when the
        last of them releases the segment. Idempotent.

        Returns:
            whether the segment is free now (``False``: transfers still hold it).
        """
        with self._lock:
            self.closed = True
            if self._freed:
                return True
            self._idle.wait_for(lambda: self._inflight <= 0, timeout=max(0.0, wait_s))
            if self._freed:  # the last transfer out freed it while we waited
                return True
            if self._inflight > 0:
                return False
            self._freed = True
        self._free()
        return True

    def _free(self) -> None:
        for buf in self.buffers:
            buf.close()
        for path in self._owned_paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _sizes(size_bytes: int | Sequence[int]) -> list[int]:
    sizes = [size_bytes] if isinstance(size_bytes, int) else list(size_bytes)
    if not sizes or any(s <= 0 for s in sizes):
        raise UsageError(f"segment buffer sizes {sizes} must be positive",
                         "give each buffer a size above 0 bytes, e.g. 64MiB")
    return sizes


_swept: set[Path] = set()
_swept_lock = threading.Lock()


def _sweep_once(shm_dir: Path) -> None:
    """Delete dead processes' segment files in ``shm_dir``, once per process and dir."""
    with _swept_lock:
        if shm_dir in _swept:
            return
        _swept.add(shm_dir)
    shmfiles.sweep_dead(shm_dir)


def create_shm_segment(name: str, size_bytes: int | Sequence[int], *,
                       location: str = "cpu:0", shm_dir: Path = SHM_DIR) -> LocalSegment:
    """Host DRAM in one new ``/dev/shm`` file, mapped shared; one buffer per size."""
    validate_name(name)
    sizes = _sizes(size_bytes)
    total = sum(sizes)
    _sweep_once(shm_dir)
    path = shm_dir / f"kvctl-{name.replace(':', '_')}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise UnavailableError(
            f"cannot create shared memory file {path}: {exc.strerror}",
            f"check that {shm_dir} exists and has room (df -h {shm_dir})",
        ) from None
    shmfiles.hold(fd)  # the mapping's duplicate descriptor keeps the lock: see shmfiles
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise UnavailableError(f"cannot map {total} bytes of shared memory: {exc.strerror}",
                               f"free space in {shm_dir} or use a smaller size") from None
    os.close(fd)
    whole = memoryview(mm)
    buffers: list[LocalBuffer] = []
    offset = 0
    for i, size in enumerate(sizes):
        buffers.append(MemoryBuffer(offset, whole[offset : offset + size], location,
                                    owner=mm if i == len(sizes) - 1 else None))
        offset += size
    whole.release()
    seg = LocalSegment(name, "shm", buffers, owned_paths=[path],
                       paths=[str(path)] * len(sizes),
                       file_offsets=[b.offset for b in buffers])
    parse_location(location)
    return seg


def create_file_segment(name: str, path: Path, size_bytes: int | Sequence[int]) -> LocalSegment:
    """A file on local disk (created or extended to the total size); one buffer per size."""
    validate_name(name)
    sizes = _sizes(size_bytes)
    total = sum(sizes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < total:
            os.ftruncate(fd, total)
    except OSError as exc:
        raise UsageError(f"cannot open segment file {path}: {exc.strerror}",
                         "give a writable --path on a local disk") from None
    buffers: list[LocalBuffer] = []
    offset = 0
    for i, size in enumerate(sizes):
        buffers.append(FileBuffer(offset, size, fd, offset, own_fd=i == 0))
        offset += size
    return LocalSegment(name, "file", buffers, paths=[str(path.resolve())] * len(sizes),
                        file_offsets=[b.offset for b in buffers])


def create_gpu_segment(name: str, size_bytes: int | Sequence[int], *,
                       device_index: int = 0) -> LocalSegment:
    """CUDA memory on ``cuda:device_index`` through torch (imported lazily).

    Raises:
        UnavailableError: torch is not installed or has no CUDA device.
    """
    validate_name(name)
    sizes = _sizes(size_bytes)
    try:
        torch = _torch()
    except ImportError:
        raise UnavailableError("GPU segments unavailable: torch is not installed",
                               "pip install torch (a CUDA build) to register GPU memory") from None
    if not torch.cuda.is_available() or device_index >= torch.cuda.device_count():
        raise UnavailableError(f"GPU segments unavailable: no CUDA device cuda:{device_index}",
                               "run on a host with an NVIDIA GPU and a CUDA build of torch")
    buffers: list[LocalBuffer] = []
    offset = 0
    for size in sizes:
        tensor = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{device_index}")
        buffers.append(GpuBuffer(offset, tensor, device_index))
        offset += size
    return LocalSegment(name, "gpu", buffers)


def wrap_memory(name: str, buffers: Sequence[Any], *, location: str = "cpu:0") -> LocalSegment:
    """Register caller-owned writable buffers (bytearray, mmap, numpy array) without copying."""
    validate_name(name)
    parse_location(location)
    out: list[LocalBuffer] = []
    offset = 0
    for obj in buffers:
        view = memoryview(obj)
        if view.readonly:
            raise UsageError(f"buffer {len(out)} of segment {name!r} is read-only",
                             "pass a writable buffer such as a bytearray")
        if not view.c_contiguous:
            raise UsageError(f"buffer {len(out)} of segment {name!r} is not contiguous",
                             "pass a C-contiguous buffer")
        view = view.cast("B")
        if view.nbytes == 0:
            raise UsageError(f"buffer {len(out)} of segment {name!r} is empty",
                             "pass buffers of at least one byte")
        out.append(MemoryBuffer(offset, view, location))
        offset += view.nbytes
    if not out:
        raise UsageError(f"segment {name!r} has no buffers", "pass at least one buffer")
    return LocalSegment(name, "host", out)


def map_remote_buffer(info: BufferInfo, *, segment: str) -> LocalBuffer:
    """Map a same-host peer's buffer (shm file or disk file) into this process.

    Raises:
        TransportUnavailableError: the buffer has no path, or the path cannot be opened.
    """
    from kvctl.transfer.errors import TransportUnavailableError

    if info.path is None:
        raise TransportUnavailableError(
            f"segment {segment!r} buffer at offset {info.offset} is not mappable",
            "use transport 'tcp' for host/gpu segments",
        )
    try:
        fd = os.open(info.path, os.O_RDWR)
    except OSError as exc:
        raise TransportUnavailableError(
            f"cannot open {info.path} of segment {segment!r}: {exc.strerror}",
            "the target may have exited or run as another user; use transport 'tcp'",
        ) from None
    if info.location == "file":
        return FileBuffer(info.offset, info.length, fd, info.file_offset, own_fd=True)
    try:
        page = mmap.ALLOCATIONGRANULARITY
        start = info.file_offset - info.file_offset % page
        mm = mmap.mmap(fd, info.length + info.file_offset - start, mmap.MAP_SHARED | _POPULATE,
                       mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    except (OSError, ValueError) as exc:
        raise TransportUnavailableError(
            f"cannot map {info.path} of segment {segment!r}: {exc}",
            "the target may have shrunk or removed it; use transport 'tcp'",
        ) from None
    finally:
        os.close(fd)
    skip = info.file_offset - start
    return MemoryBuffer(info.offset, memoryview(mm)[skip : skip + info.length], info.location,
                        owner=mm)
