"""A deposed elected master deletes no shared-tier file: etcd fences its state writes, not
its unlinks, and the files belong to the new leader (a leader SIGSTOPped past its lease
and resumed purged every file written after the takeover as orphans of its stale index)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.sharedtier import writer
from kvctl.store.sharedtier.fileformat import file_name, write_object
from tests.store.test_shared_tier import MiB, SharedCluster, _evict


def _plant(root: Path, key: str, version: int) -> Path:
    data = os.urandom(4096)
    path = root / file_name(key, version)
    write_object(path, key, version, memoryview(data), checksum(data), "00" * 8)
    old = time.time() - 120
    os.utime(path, (old, old))
    return path


def test_a_deposed_master_neither_purges_nor_deletes_tier_files(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    c = SharedCluster(root, orphan_grace_s=30.0, sweep_interval_s=0.0)
    why: list[str | None] = ["deposed: another master claimed the lead"]
    c.server.lead_while(lambda: why[0])
    try:
        # Files this master's index does not name (the new leader's), and one whose
        # delete it had queued (a record its unsent journal write had dropped).
        theirs = [_plant(root, f"new-leader-{i}", 1000 + i) for i in range(5)]
        queued = _plant(root, "dropped", 7)
        st = c.server.core._shared
        assert st is not None
        with c.server.core._lock:
            st.unlink_later(str(queued), 0.0)
        for _ in range(50):
            c.server.core.tick()
        assert all(p.exists() for p in theirs)
        assert queued.exists()

        why[0] = None  # leading: the same sweep and the queued delete go ahead
        deadline = time.monotonic() + 10
        while (queued.exists() or any(p.exists() for p in theirs)) \
                and time.monotonic() < deadline:
            c.server.core.tick()
            time.sleep(0.01)
        assert not queued.exists()
        assert not any(p.exists() for p in theirs)
    finally:
        c.close()


def test_a_file_whose_write_report_is_late_is_no_orphan(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node renames, then its report takes longer than the orphan grace (a slow
    heartbeat, a takeover): the sweep must not delete the file the report then records
    (seen after an etcd stall and a takeover: the new leader named 4 missing files)."""
    real = writer.write_object

    def slow(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        if args[1] == "late":
            time.sleep(1.0)  # renamed: the file is on disk, its report is late

    monkeypatch.setattr(writer, "write_object", slow)
    root = tmp_path / "dfs"
    c = SharedCluster(root, orphan_grace_s=0.0, sweep_interval_s=0.0)
    try:
        c.node()
        with StoreClient(c.address) as client:
            value = os.urandom(MiB)
            client.put("late", value)
            _evict(client, "late")  # write-back; the sweep ran meanwhile, every tick
            assert (root / file_name("late", client.stat("late").version)).exists()
            assert client.get("late") == value
    finally:
        c.close()
