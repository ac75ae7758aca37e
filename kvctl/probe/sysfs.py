"""A sysfs reader rooted at any directory, resolving symlinks inside that root.

Paths given to :class:`SysfsReader` are *logical*: absolute paths as the kernel spells them
(``/sys/bus/pci/devices/0000:18:00.0/vendor``). The reader maps them under its root, follows
symlinks component by component and reinterprets every link target inside the root, so a
tree recorded from another host (links absolute like ``/sys/devices/...`` or relative like
``../../../devices/...``) reads exactly like the live ``/``, and no link can escape the root.

A :class:`SysfsRecorder` attached to the reader keeps every file, symlink and directory the
reader touched; :mod:`kvctl.topo.snapshot` writes exactly those into a snapshot.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from pathlib import Path, PurePosixPath

from kvctl.errors import KvctlError

_log = logging.getLogger("kvctl.probe.sysfs")

#: Most symlinks followed while resolving one path (the kernel's own limit is 40).
MAX_LINK_HOPS = 40


class SysfsError(KvctlError):
    """A sysfs file exists but could not be read (permission, I/O error, link loop)."""


@dataclasses.dataclass
class SysfsRecorder:
    """What a reader touched: file contents, symlink targets and listed directories.

    Keys are logical canonical paths (``/sys/devices/...``); a link's key is where the link
    itself lives (its parent already resolved), its value the target exactly as read.
    """

    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    links: dict[str, str] = dataclasses.field(default_factory=dict)
    dirs: set[str] = dataclasses.field(default_factory=set)


class SysfsReader:
    """Read a sysfs tree under ``root`` (``/`` for the live host).

    Args:
        root: directory that plays the role of ``/``.
        recorder: when given, every file, link and directory read is recorded there.
    """

    def __init__(self, root: Path | str = "/", *, recorder: SysfsRecorder | None = None) -> None:
        self.root = Path(root)
        self.recorder = recorder

    def __repr__(self) -> str:
        return f"SysfsReader(root={str(self.root)!r})"

    @property
    def is_live(self) -> bool:
        """Whether this reader reads the running host (root ``/``)."""
        return self.root.resolve() == Path("/")

    def real(self, logical: PurePosixPath | str) -> Path:
        """The path on this machine that holds logical path ``logical`` (no link resolution)."""
        rel = PurePosixPath(logical).relative_to("/")
        return self.root.joinpath(*rel.parts)

    def resolve(self, path: PurePosixPath | str) -> PurePosixPath:
        """The canonical logical path of ``path``: every symlink followed inside the root.

        Missing components are kept as written (like ``realpath -m``).

        Raises:
            SysfsError: more than :data:`MAX_LINK_HOPS` links (a loop).
        """
        logical = PurePosixPath(path)
        if not logical.is_absolute():
            raise ValueError(f"sysfs paths are absolute, got {path!r}")
        pending = list(logical.parts[1:])
        done: list[str] = []
        hops = 0
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if done:
                    done.pop()
                continue
            candidate = PurePosixPath("/", *done, name)
            real = self.real(candidate)
            if real.is_symlink():
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise SysfsError(
                        f"symlink loop while resolving {path} under {self.root}",
                        "the recorded tree is damaged: record it again with kvctl topo snapshot",
                    )
                target = str(real.readlink())
                if self.recorder is not None:
                    self.recorder.links[str(candidate)] = target
                target_path = PurePosixPath(target)
                if target_path.is_absolute():
                    done = []
                    pending = list(target_path.parts[1:]) + pending
                else:
                    pending = list(target_path.parts) + pending
            else:
                done.append(name)
        return PurePosixPath("/", *done)

    def exists(self, path: PurePosixPath | str) -> bool:
        """Whether ``path`` (after resolution) exists."""
        return self.real(self.resolve(path)).exists()

    def is_dir(self, path: PurePosixPath | str) -> bool:
        """Whether ``path`` is a directory (recorded as one when it is)."""
        canonical = self.resolve(path)
        if self.real(canonical).is_dir():
            if self.recorder is not None:
                self.recorder.dirs.add(str(canonical))
            return True
        return False

    def is_link(self, path: PurePosixPath | str) -> bool:
        """Whether the last component of ``path`` is a symlink (its parent resolved)."""
        logical = PurePosixPath(path)
        parent = self.resolve(logical.parent)
        return self.real(parent / logical.name).is_symlink()

    def link_target(self, path: PurePosixPath | str) -> PurePosixPath | None:
        """Canonical target of the symlink ``path``, or ``None`` when ``path`` is no link."""
        if not self.is_link(path):
            return None
        return self.resolve(path)

    def listdir(self, path: PurePosixPath | str) -> list[str] | None:
        """Sorted entry names of directory ``path``, or ``None`` when it does not exist."""
        canonical = self.resolve(path)
        real = self.real(canonical)
        try:
            names = sorted(p.name for p in real.iterdir())
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        except OSError as exc:
            raise SysfsError(
                f"cannot list {canonical} under {self.root}: {exc.strerror or exc}",
                "run as a user that can read sysfs",
            ) from exc
        if self.recorder is not None:
            self.recorder.dirs.add(str(canonical))
        return names

    def read(self, path: PurePosixPath | str) -> str | None:
        """Text of file ``path`` with surrounding whitespace stripped; ``None`` when absent.

        Raises:
            SysfsError: the file exists but reading failed (permission, ``EINVAL`` from a
                kernel attribute that has no value, I/O error).
        """
        canonical = self.resolve(path)
        real = self.real(canonical)
        try:
            data = real.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            what = errno.errorcode.get(exc.errno or 0, "error")
            raise SysfsError(
                f"cannot read {canonical} under {self.root}: {what}",
                "run as a user that can read sysfs",
            ) from exc
        if self.recorder is not None:
            self.recorder.files[str(canonical)] = data
        return data.decode("utf-8", errors="replace").strip()

    def read_optional(self, path: PurePosixPath | str) -> str | None:
        """Like :meth:`read`, but a file that exists and cannot be read is also ``None``.

        For kernel attributes that legitimately fail to read (a down port's ``speed``, an
        unused GID's type): the failure is logged at debug level.
        """
        try:
            return self.read(path)
        except SysfsError as err:
            _log.debug("%s", err.cause)
            return None

    def read_int(self, path: PurePosixPath | str, *, base: int = 10) -> int | None:
        """Integer in file ``path`` (``base`` 16 accepts ``0x`` prefixes); ``None`` when
        absent, unreadable or not a number."""
        text = self.read_optional(path)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            _log.debug("%s: %r is not an integer", path, text)
            return None
