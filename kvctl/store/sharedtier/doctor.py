"""What ``kvctl doctor env --shared-tier DIR`` checks about a shared tier's file system.

The tier needs (docs/store.md, "Shared tier"): ``rename`` within a directory that replaces
its target atomically (a reader sees the old file or the new one, never a missing or
partial one), close-to-open consistency across hosts (a file renamed into place on one
host opens with all its bytes on another), working ``fsync``, and room. From one host the
doctor can check:

- ``shared-tier-rename``: rename over an existing file, many times, while a reader opens
  and reads it; every read must be a whole old or new file.
- ``shared-tier-visibility``: this host's probe file is written (and kept, under
  ``DIR/.kvctl-doctor/``), and the probes other hosts left there are read back and
  verified: run the doctor on two hosts and the second sees the first.
- ``shared-tier-space``: free bytes and files (``statvfs``).
- ``shared-tier-mount``: the mount type and options (``/proc/self/mountinfo``): a network
  or distributed file system is what the tier is for; a local one (judged by its type name
  alone) is seen by this host only, unless other hosts' probes were read here: then hosts
  share this machine's kernel (namespaces, containers), and the row says so instead of
  contradicting the visibility row; NFS's ``nocto`` breaks close-to-open consistency.
- ``shared-tier``: the directory itself, first: whether it exists and which hosts are known
  to share it. A missing directory is an error row, and nothing else is checked.

A missing directory, like every other component, leaves the exit status at 0: ``doctor
env`` reports what this host has (the mount may come later, or this host may not need the
tier); ``--require shared-tier`` makes it fatal (exit 3). The row says so.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvctl.doctor.env import ComponentStatus, Status
from kvctl.fsafe import write_private_atomically

#: File systems a shared tier is meant for (others are seen by one host only, or unknown).
DISTRIBUTED = ("nfs", "nfs4", "ceph", "fuse.ceph", "fuse.ceph-fuse", "fuse.hf3fs", "hf3fs",
               "lustre", "gpfs", "beegfs", "glusterfs", "fuse.glusterfs", "fuse.juicefs",
               "cifs", "smb3", "9p", "virtiofs", "fuse.s3fs", "fuse.gcsfuse")
LOCAL = ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "ext3", "ext2", "f2fs")
#: Less room than this is an error.
MIN_FREE_BYTES = 1 << 30
PROBE_DIR = ".kvctl-doctor"


def checks(root: Path, *, mountinfo: Path = Path("/proc/self/mountinfo"),
           rename_rounds: int = 200) -> list[ComponentStatus]:
    """Every shared-tier check of ``root``: the directory (a missing one is a single error
    row), its mount, space, rename and visibility."""
    if not root.is_dir():
        return [ComponentStatus(
            "shared-tier", Status.ERROR,
            f"{root} is not a directory, so nothing else of it was checked; the exit status "
            "stays 0 all the same: doctor env reports what this host has (as for an "
            "unreachable --metadata), and --require shared-tier makes this fatal (exit 3)",
            "mount the distributed file system and create the directory (the master "
            "creates it if its parent exists)")]
    visibility, others = _visibility(root)
    if others:
        summary = (f"{root}: a directory, shared with {', '.join(others)} (their probes "
                   "were read and verified here)")
    else:
        summary = (f"{root}: a directory; no other host's probe here yet, so not known to "
                   "be shared")
    return [ComponentStatus("shared-tier", Status.OK, summary),
            check_mount(root, mountinfo, shared_with=others), check_space(root),
            check_rename(root, rename_rounds), visibility]


def check_rename(root: Path, rounds: int = 200) -> ComponentStatus:
    """Rename over an existing file ``rounds`` times while another thread reads it."""
    name = "shared-tier-rename"
    target = root / f".kvctl-rename-probe-{secrets.token_hex(4)}"
    versions = [bytes([i]) * 65536 for i in range(4)]
    bad: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set() and len(bad) < 5:
            try:
                with target.open("rb") as f:
                    data = f.read()
            except FileNotFoundError:
                bad.append("the file was missing during a rename")
                continue
            if data not in versions:
                bad.append(f"a read saw {len(data)} bytes, not one whole version")
    try:
        write_private_atomically(target, [versions[0]], fsync=False)
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        started = time.perf_counter()
        for i in range(1, rounds + 1):
            write_private_atomically(target, [versions[i % 4]], fsync=False)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join(timeout=5)
    except OSError as exc:
        stop.set()
        return ComponentStatus(name, Status.ERROR, f"rename over a file in {root} failed: "
                               f"{exc.strerror or exc}", "the shared tier needs rename that "
                               "replaces its target (POSIX rename)")
    finally:
        with contextlib.suppress(OSError):
            target.unlink()
    if bad:
        return ComponentStatus(name, Status.ERROR, f"rename is not atomic here: {bad[0]}",
                               "use a file system whose rename replaces its target "
                               "atomically (NFS, CephFS, 3FS do)")
    return ComponentStatus(name, Status.OK, f"{rounds} renames over a file being read: every "
                           f"read saw a whole file ({elapsed / rounds * 1e3:.2f} ms per "
                           "write + rename)")


def check_visibility(root: Path) -> ComponentStatus:
    """Write this host's probe; verify the probes other hosts left."""
    return _visibility(root)[0]


def _visibility(root: Path) -> tuple[ComponentStatus, list[str]]:
    """:func:`check_visibility`, and the hosts whose probes were read back whole here."""
    name = "shared-tier-visibility"
    probes = root / PROBE_DIR
    host = socket.gethostname()
    body = f"{host} {time.time():.0f} {secrets.token_hex(8)}\n".encode()
    stamp = xxhash.xxh3_64_hexdigest(body).encode()
    try:
        probes.mkdir(mode=0o700, exist_ok=True)
        write_private_atomically(probes / f"{host}.probe", [stamp, b" ", body], fsync=True)
    except OSError as exc:
        return ComponentStatus(name, Status.ERROR, f"cannot write a probe in {probes}: "
                               f"{exc.strerror or exc}", "the tier must be writable here"), []
    seen: list[str] = []
    hosts: list[str] = []
    broken: list[str] = []
    for path in sorted(probes.glob("*.probe")):
        if path.stem == host:
            continue
        try:
            raw = path.read_bytes()
        except OSError:
            broken.append(path.stem)
            continue
        digest, _, rest = raw.partition(b" ")
        if xxhash.xxh3_64_hexdigest(rest).encode() != digest:
            broken.append(path.stem)
            continue
        age = time.time() - float(rest.split()[1])
        seen.append(f"{path.stem} ({age / 60:.0f} min ago)")
        hosts.append(path.stem)
    if broken:
        return ComponentStatus(name, Status.ERROR, "probe files of " + ", ".join(broken)
                               + " read back torn or unreadable from this host",
                               "check the mount's consistency options (close-to-open; no "
                               "client write-back cache that exposes a renamed file early)"
                               ), hosts
    if not seen:
        return ComponentStatus(name, Status.OK, f"probe written as {host}; no other host's "
                               "probe here yet", f"run 'kvctl doctor env --shared-tier {root}' "
                               "on another host: it must list this one"), hosts
    return ComponentStatus(name, Status.OK, f"probe written as {host}; read and verified the "
                           "probes of " + ", ".join(seen)), hosts


def check_space(root: Path) -> ComponentStatus:
    name = "shared-tier-space"
    try:
        vfs = os.statvfs(root)
    except OSError as exc:
        return ComponentStatus(name, Status.ERROR, f"statvfs {root}: {exc.strerror or exc}",
                               "check the mount")
    free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    files = f", {vfs.f_favail:,} more files" if vfs.f_files else ""
    detail = f"{free / 2**30:,.1f} GiB free of {total / 2**30:,.1f} GiB{files}"
    if free < MIN_FREE_BYTES:
        return ComponentStatus(name, Status.ERROR, detail, "free space or size the tier "
                               "smaller (--shared-tier-capacity)")
    return ComponentStatus(name, Status.OK, detail + "; size --shared-tier-capacity below it")


def mount_of(root: Path, mountinfo: Path) -> tuple[str, str, str] | None:
    """``(mount point, fstype, options)`` of the mount holding ``root``."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(root)
    best: tuple[str, str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, tail[0], f"{fields[5]},{tail[2]}")
    return best


def check_mount(root: Path, mountinfo: Path, *, shared_with: Sequence[str] = ()
                ) -> ComponentStatus:
    """The mount type and options of ``root``. The type is judged by its name in
    ``mountinfo`` alone; ``shared_with`` (the hosts whose probes were read here, see
    :func:`check_visibility`) overrules "local": their probes got here, so the directory is
    shared, whatever its type (hosts on one kernel: namespaces, containers, bind mounts)."""
    name = "shared-tier-mount"
    found = mount_of(root, mountinfo)
    if found is None:
        return ComponentStatus(name, Status.UNAVAILABLE, f"no mount found for {root}",
                               "is /proc mounted?")
    point, fstype, options = found
    where = f"{fstype} at {point}"
    if fstype.startswith("nfs") and "nocto" in options.split(","):
        return ComponentStatus(name, Status.ERROR, f"{where} mounted with nocto",
                               "remount without nocto: the shared tier relies on NFS's "
                               "close-to-open consistency")
    if fstype in DISTRIBUTED:
        return ComponentStatus(name, Status.OK, f"{where} (a network or distributed file "
                               "system)")
    judged = f"by its type (the only sign read, from {mountinfo})"
    if fstype in LOCAL and shared_with:
        return ComponentStatus(name, Status.OK, f"{where}: a local file system {judged}, "
                               f"yet shared: the probes of {', '.join(shared_with)} "
                               "were read here, so those hosts share this machine's kernel "
                               "(namespaces, containers or a bind mount)",
                               "nodes on other machines need a distributed file system "
                               "(3FS, CephFS, NFS) at the same path everywhere")
    if fstype in LOCAL:
        return ComponentStatus(name, Status.OK, f"{where}: a local file system {judged}: "
                               "seen by this host only (fine for one host or tests); no "
                               "other host's probe was read here",
                               "for nodes on several hosts mount a distributed file system "
                               "(3FS, CephFS, NFS) at the same path everywhere")
    seen = f"; shared with {', '.join(shared_with)} (their probes read here)" if (
        shared_with) else ""
    return ComponentStatus(name, Status.OK, f"{where} (unknown type: check the requirements "
                           f"in docs/store.md){seen}")
