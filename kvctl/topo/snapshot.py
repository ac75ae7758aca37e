"""Record what topo reads into a ``.tar.gz``, and replay it anywhere.

:func:`write_snapshot` runs the sysfs scan with a recorder attached, so the archive holds
exactly the files, symlinks and directories topo read (nothing redacted, nothing extra),
plus NVML's and verbs' answers as JSON in ``kvctl-snapshot.json``. Symlink targets are
stored relative to the link (absolute ones are rewritten inside the tree), so the archive
extracts under tarfile's ``data`` filter.

:func:`open_snapshot` checks an archive before extracting it (only regular files,
directories and relative in-tree symlinks under ``sys/``; bounded size and count), extracts
it with the ``data`` filter into a temporary directory, and hands back sources that replay
it. A damaged or foreign archive is a :class:`~kvctl.errors.UsageError` (exit 2).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import logging
import posixpath
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Self

from kvctl import __version__
from kvctl.errors import UsageError
from kvctl.probe.host import scan_sysfs
from kvctl.probe.nvml import NvmlBackend, RecordedNvml, nvml_from_dict, nvml_to_dict
from kvctl.probe.sysfs import SysfsReader, SysfsRecorder
from kvctl.probe.verbs import RecordedVerbs, VerbsBackend, verbs_from_dict, verbs_to_dict

_log = logging.getLogger("kvctl.topo.snapshot")

FORMAT = "kvctl-topo-snapshot"
FORMAT_VERSION = 1
META_NAME = "kvctl-snapshot.json"
#: Limits on what an archive may hold before anything is extracted.
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 256 << 20
_HINT = "record it again with: kvctl topo snapshot OUT.tar.gz"


@dataclasses.dataclass(frozen=True)
class SnapshotSummary:
    """What a snapshot holds: counts of files, symlinks and directories, and its size."""

    path: Path
    files: int
    links: int
    dirs: int
    size_bytes: int


def _relative_target(link: str, target: str) -> str:
    """``target`` of the link at logical path ``link``, made relative and kept in the tree."""
    parent = posixpath.dirname(link)
    if target.startswith("/"):
        return posixpath.relpath(posixpath.normpath(target), parent)
    # a relative target climbing past the root resolves at the root (as the reader does)
    resolved = PurePosixPath("/")
    for part in PurePosixPath(parent, target).parts[1:]:
        if part == "..":
            resolved = resolved.parent
        elif part not in ("", "."):
            resolved = resolved / part
    return posixpath.relpath(str(resolved), parent)


def write_snapshot(
    out: Path, reader_root: Path, nvml: NvmlBackend, verbs: VerbsBackend
) -> SnapshotSummary:
    """Record the sysfs files topo reads under ``reader_root`` plus NVML/verbs answers.

    Raises:
        UsageError: ``out`` cannot be written.
    """
    recorder = SysfsRecorder()
    scan_sysfs(SysfsReader(reader_root, recorder=recorder))
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kvctl_version": __version__,
        "created_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nvml": nvml_to_dict(nvml.query()),
        "verbs": verbs_to_dict(verbs.query()),
    }
    dirs: set[str] = set(recorder.dirs)
    for path in [*recorder.files, *recorder.links, *recorder.dirs]:
        parent = PurePosixPath(path).parent
        while str(parent) != "/":
            dirs.add(str(parent))
            parent = parent.parent
    dirs -= set(recorder.links)
    tmp = out.with_name(out.name + ".partial")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            _add_bytes(tar, META_NAME, json.dumps(meta, indent=2).encode(), 0o644)
            for d in sorted(dirs):
                info = tarfile.TarInfo(d.lstrip("/"))
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            for path, data in sorted(recorder.files.items()):
                _add_bytes(tar, path.lstrip("/"), data, 0o444)
            for path, target in sorted(recorder.links.items()):
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type = tarfile.SYMTYPE
                info.linkname = _relative_target(path, target)
                tar.addfile(info)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write snapshot {out}: {exc.strerror or exc}",
                         "choose a writable path for OUT.tar.gz") from exc
    return SnapshotSummary(out, len(recorder.files), len(recorder.links), len(dirs),
                           out.stat().st_size)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


@dataclasses.dataclass
class SnapshotSources:
    """The sources a snapshot replays, and the temporary tree they read. Close when done."""

    root: Path
    reader: SysfsReader
    nvml: RecordedNvml
    verbs: RecordedVerbs
    meta: dict[str, Any]

    def close(self) -> None:
        """Remove the extracted tree. Safe to call twice."""
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _check_member(path: Path, member: tarfile.TarInfo) -> None:
    name = member.name
    norm = posixpath.normpath(name)
    bad = (
        name.startswith("/")
        or norm.startswith("..")
        or (norm not in (META_NAME, "sys") and not norm.startswith("sys/"))
    )
    if bad:
        raise UsageError(f"snapshot {path} has an unexpected member {name!r}", _HINT)
    if not (member.isfile() or member.isdir() or member.issym()):
        raise UsageError(
            f"snapshot {path}: member {name!r} is not a file, directory or symlink", _HINT
        )
    if member.issym():
        target = posixpath.normpath(posixpath.join(posixpath.dirname(norm), member.linkname))
        if member.linkname.startswith("/") or target.startswith(".."):
            raise UsageError(
                f"snapshot {path}: symlink {name!r} points outside the tree "
                f"({member.linkname!r})", _HINT)


def open_snapshot(path: Path) -> SnapshotSources:
    """Check and extract snapshot ``path``; return sources that replay it.

    Raises:
        UsageError: the file is missing, not a gzip'd tar, damaged, holds unexpected
            members, or its ``kvctl-snapshot.json`` is not a kvctl topo snapshot.
    """
    if not path.is_file():
        raise UsageError(f"snapshot {path} does not exist", "give the file written by "
                         "kvctl topo snapshot OUT.tar.gz")
    root = Path(tempfile.mkdtemp(prefix="kvctl-topo-"))
    try:
        meta = _extract(path, root)
        nvml = RecordedNvml(nvml_from_dict(meta["nvml"]))
        verbs = RecordedVerbs(verbs_from_dict(meta["verbs"]))
    except UsageError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    except (KeyError, TypeError, ValueError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise UsageError(f"snapshot {path}: {META_NAME} is damaged ({exc})", _HINT) from exc
    return SnapshotSources(root, SysfsReader(root), nvml, verbs, meta)


def _extract(path: Path, root: Path) -> dict[str, Any]:
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = []
            total = 0
            for member in tar:
                _check_member(path, member)
                members.append(member)
                total += member.size
                if len(members) > MAX_MEMBERS or total > MAX_TOTAL_BYTES:
                    raise UsageError(
                        f"snapshot {path} is larger than a topo snapshot can be "
                        f"({MAX_MEMBERS} members, {MAX_TOTAL_BYTES >> 20} MiB)", _HINT)
            tar.extractall(root, members=members, filter="data")
    except UsageError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise UsageError(
            f"snapshot {path} is not a readable kvctl topo snapshot ({type(exc).__name__}: "
            f"{exc})", _HINT) from exc
    meta_path = root / META_NAME
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"snapshot {path} has no {META_NAME}", _HINT) from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"snapshot {path}: {META_NAME} is not JSON ({exc})", _HINT) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(f"snapshot {path} is not a {FORMAT}", _HINT)
    if meta.get("version") != FORMAT_VERSION:
        raise UsageError(
            f"snapshot {path} has format version {meta.get('version')!r}; this kvctl reads "
            f"{FORMAT_VERSION}", "use the kvctl version that wrote it, or record it again")
    root.chmod(0o700)
    return meta
