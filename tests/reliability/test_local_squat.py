"""Another local user cannot plant kvctl's discovery directory or SSD files (issue 15.8/9)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvctl.fsafe import UnsafePathError, private_dir
from kvctl.store import embedded
from kvctl.store.settings import DEFAULT_MASTER, StoreSettings
from kvctl.store.ssd import SsdTier

NOBODY = 65534


def _plant(directory: Path, *, mode: int = 0o777, uid: int | None = None) -> None:
    directory.mkdir(parents=True)
    directory.chmod(mode)
    if uid is not None:
        os.chown(directory, uid, uid)


def test_private_dir_creates_0700_and_refuses_what_others_own(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "mine", what="test dir")
    assert made.stat().st_mode & 0o777 == 0o700
    _plant(tmp_path / "open", mode=0o777)
    with pytest.raises(UnsafePathError) as info:
        private_dir(tmp_path / "open", what="test dir")
    assert "writable by others" in info.value.cause
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    with pytest.raises(UnsafePathError):
        private_dir(tmp_path / "link", what="test dir")
    if os.geteuid() == 0:
        _plant(tmp_path / "theirs", mode=0o700, uid=NOBODY)
        with pytest.raises(UnsafePathError) as info:
            private_dir(tmp_path / "theirs", what="test dir")
        assert "owned by uid" in info.value.cause


def test_a_squatted_discovery_directory_is_never_trusted(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    squat = tmp_path / "kvctl"
    _plant(squat, mode=0o777)
    (squat / "store.json").write_text(json.dumps({"master": "203.0.113.9:50051",
                                                  "pid": os.getpid()}))
    monkeypatch.setattr(embedded, "runtime_dir", lambda: squat)
    assert embedded.resolve_master(StoreSettings()) == DEFAULT_MASTER


def test_an_honest_discovery_file_is_used(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "runtime_dir", lambda: tmp_path / "kvctl")
    with embedded.EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=4 << 20),
                                write_discovery=True) as store:
        assert (tmp_path / "kvctl").stat().st_mode & 0o777 == 0o700
        assert embedded.resolve_master(StoreSettings()) == store.address


def test_ssd_tier_refuses_a_planted_node_directory(tmp_path: Path) -> None:
    _plant(tmp_path / "node-a", mode=0o777)
    with pytest.raises(UnsafePathError):
        SsdTier(tmp_path / "node-a")


def test_ssd_writes_never_follow_a_symlink_at_a_predictable_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    tier = SsdTier(tmp_path / "node-b")
    final = tier.path_for("k")
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # every name the old code used
        (final.parent / f".{final.name}.{pid}.tmp").symlink_to(victim)
    data = memoryview(b"x" * 4096)
    from kvctl.store.checksum import checksum

    tier.write("k", 1, data, checksum(data))
    assert victim.read_bytes() == b"precious"
    out = bytearray(4096)
    tier.read_into("k", memoryview(out), checksum(data))
    assert bytes(out) == bytes(data)
