"""Files kvctl keeps for itself, safe against other local users.

A directory under a world-writable place (``/tmp/kvctl-<uid>``, an SSD tier's node
directory) may have been made first by someone else, or be a symlink to their files.
:func:`private_dir` accepts only a real directory owned by this user that nobody else can
write (and makes it ``0700``); :func:`create_private` opens a new file with ``O_EXCL`` and
``O_NOFOLLOW`` under an unguessable name, so no symlink planted at a predictable name is
ever followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from kvctl.errors import UsageError


class UnsafePathError(UsageError):
    """A path kvctl would trust belongs to someone else or can be changed by others."""


def private_dir(path: Path, *, what: str) -> Path:
    """``path`` as a directory only this user can change, created ``0700`` if missing.

    Raises:
        UnsafePathError: it is a symlink or not a directory, owned by another user, or
            writable by group or others.
        OSError: it cannot be created (no parent, read-only file system).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not {os.getuid()}"
    elif info.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is not None:
        raise UnsafePathError(f"{what} {path} {problem}: refusing to use it",
                              "remove it (another user may have made it) or point kvctl "
                              "elsewhere; kvctl creates it itself with mode 700")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def create_private(directory: Path, prefix: str) -> tuple[int, Path]:
    """A new file ``0600`` in ``directory`` under an unguessable name: ``(fd, path)``."""
    while True:
        path = directory / f".{prefix}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        return fd, path


def write_private_atomically(path: Path, parts: list[bytes | memoryview], *,
                             fsync: bool, replace: bool = True) -> None:
    """Write ``parts`` to ``path`` as a ``0600`` file: a temporary name in the same
    directory (:func:`create_private`), optionally ``fsync``, then ``rename`` over
    ``path``, so a reader sees the whole file or none (where rename is atomic). The
    temporary file is removed when anything fails. ``replace=False``: never over a file
    already at ``path`` (a hard link, then the temporary name removed; where the file
    system has no hard links, a rename unless ``path`` exists).

    Raises:
        FileExistsError: ``replace=False`` and ``path`` exists.
        OSError: the file system failed (``ENOSPC``, ``EDQUOT``, ``EIO``...).
    """
    fd, tmp = create_private(path.parent, path.name)
    try:
        for part in parts:
            view = memoryview(part)
            while view.nbytes:
                view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        if replace:
            tmp.replace(path)
        else:
            _link_new(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _link_new(tmp: Path, path: Path) -> None:
    """Give ``tmp`` the name ``path`` unless a file has it (then ``FileExistsError``)."""
    try:
        os.link(tmp, path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        if os.path.lexists(path):  # no hard links here: the best a rename can do
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        tmp.replace(path)
        return
    tmp.unlink()
