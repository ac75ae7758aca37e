"""What a master's shared tier is configured with, and how hosts map its path."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvctl.errors import UsageError

if TYPE_CHECKING:
    from kvctl.store.settings import StoreSettings

#: A file :func:`open_tier` leaves in the tier's root: a node makes a subdirectory (``xx/``,
#: ``pk/``) only where it finds it, so the empty mount point an unmounted distributed file
#: system leaves behind takes no copies that no other host sees.
TIER_MARKER = ".kvctl-tier"
#: ``write-back``: an object is copied to the shared tier when DRAM evicts it;
#: ``write-through``: also soon after each put (a node task, never on the put's path).
SHARED_POLICIES = ("write-back", "write-through")


@dataclasses.dataclass(frozen=True)
class SharedTierConfig:
    """A shared tier: a directory every node and client sees (a distributed file system).

    Attributes:
        root: the directory, as the master sees it (hosts that mount it elsewhere map it,
            :func:`map_path`).
        policy: ``write-back`` or ``write-through`` (see :data:`SHARED_POLICIES`).
        capacity_bytes: most bytes of files the tier holds (least recently used evicted
            past it).
        max_files: most files the tier holds (least recently used evicted past it).
        orphan_grace_s: a file the index does not name is purged only once it is this
            old, seconds (a write whose report is still on its way is not an orphan).
        sweep_interval_s: seconds between the starts of two purge sweeps.
        sweep_batch: directory entries one housekeeping pass examines (the sweep is
            bounded: a large tier is swept over many passes).
        full_retry_s: after a write failed for lack of space, seconds before the next
            write is tried.
        max_queued_writes: write-through copies queued or running per node at most (past
            it a put's copy is skipped, counted, and made on eviction instead): a node does
            its tasks between heartbeats, so this bounds how long one round of them takes.
        max_queued_bytes: the same bound in bytes.
        fsync: fsync each file before its rename.
        pack_below: objects smaller than this many bytes are written several to a file
            (:mod:`~kvctl.store.sharedtier.packs`); 0: each to its own.
        pack_max_bytes: most bytes of one pack file.
        pack_max_entries: most objects in one pack file.
    """

    root: Path
    policy: str = "write-back"
    capacity_bytes: int = 1 << 40
    max_files: int = 10_000_000
    orphan_grace_s: float = 60.0
    sweep_interval_s: float = 30.0
    sweep_batch: int = 256
    full_retry_s: float = 5.0
    max_queued_writes: int = 32
    max_queued_bytes: int = 64 << 20
    fsync: bool = True
    pack_below: int = 0
    pack_max_bytes: int = 8 << 20
    pack_max_entries: int = 64

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> SharedTierConfig | None:
        """The shared tier the store settings name (checked), or ``None``."""
        if settings.shared_tier is None:
            return None
        config = cls(settings.shared_tier.expanduser().absolute(),
                     policy=settings.shared_tier_policy,
                     capacity_bytes=settings.shared_tier_capacity,
                     max_files=settings.shared_tier_files,
                     orphan_grace_s=settings.shared_tier_orphan_grace,
                     sweep_interval_s=settings.shared_tier_sweep_interval,
                     pack_below=settings.shared_tier_pack_below)
        config.check()
        return config

    def check(self) -> None:
        """Raise :class:`UsageError` naming the first bad setting."""
        if self.policy not in SHARED_POLICIES:
            raise UsageError(f"unknown shared-tier policy {self.policy!r}",
                             f"use one of {', '.join(SHARED_POLICIES)}")
        if self.capacity_bytes <= 0 or self.max_files <= 0:
            raise UsageError("shared-tier capacity and file limit must be positive",
                             "give --shared-tier-capacity a size such as 1TiB")
        if self.pack_below < 0 or not 0 < self.pack_max_entries <= 4096 or not (
                self.pack_below <= self.pack_max_bytes <= 1 << 24):
            raise UsageError("shared-tier packing limits out of range",
                             "give --shared-tier-pack-below a size up to 8MiB, or 0 (off)")
        if not self.root.is_absolute():
            raise UsageError(f"shared tier {self.root} is not an absolute path",
                             "give the mount point, e.g. /mnt/3fs/kvctl")


def parse_map(spec: str) -> tuple[tuple[str, str], ...]:
    """``MASTER_DIR=LOCAL_DIR[,...]`` as pairs (empty: none).

    Raises:
        UsageError: an item without ``=`` or a relative path.
    """
    pairs: list[tuple[str, str]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        master, sep, local = item.partition("=")
        if not sep or not master.startswith("/") or not local.startswith("/"):
            raise UsageError(f"bad shared-tier path map {item!r}",
                             "write MASTER_DIR=LOCAL_DIR, e.g. /mnt/3fs/kv=/data/3fs/kv")
        pairs.append((master.rstrip("/") or "/", local.rstrip("/") or "/"))
    return tuple(pairs)


def map_path(path: str, pairs: tuple[tuple[str, str], ...]) -> Path:
    """``path`` (as the master names it) where this host sees it."""
    for master, local in pairs:
        if path == master or path.startswith(master + "/"):
            return Path(local + path[len(master):])
    return Path(path)


def open_tier(root: Path) -> bool:
    """Create ``root`` if missing (with its :data:`TIER_MARKER`) and check that this host
    can write it; ``True`` when the marker was there already (``False``: this call made
    it, so ``root`` was new, or is a bare mount point: see
    :meth:`~kvctl.store.sharedtier.mixin.SharedTierMixin._shared_restored`).

    Raises:
        UsageError: not a directory this user owns alone, or not writable.
    """
    from kvctl.fsafe import UnsafePathError, create_private, private_dir

    try:
        private_dir(root, what="shared tier directory")
        fd, probe = create_private(root, "kvctl-probe")
        os.close(fd)
        probe.unlink()
        had = os.path.lexists(root / TIER_MARKER)
        os.close(os.open(root / TIER_MARKER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    except UnsafePathError:
        raise
    except OSError as exc:
        raise UsageError(f"shared tier {root} is not writable: {exc.strerror or exc}",
                         "pass a writable --shared-tier directory (mounted on every "
                         "node and client host)") from exc
    return had
