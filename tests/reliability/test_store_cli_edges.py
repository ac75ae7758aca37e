"""Store CLI edges from the adversarial pass (issue 15.15): each fails on the old code."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]


@pytest.fixture
def store() -> Iterator[str]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=64 << 20)) as running:
        yield running.address


def test_a_listing_too_big_for_one_frame_is_truncated_not_an_error(store: str) -> None:
    keys = [f"long/{i:05d}/" + "x" * 3000 for i in range(2100)]
    with StoreClient(store) as client:
        for start in range(0, len(keys), 100):
            client.batch_put([(k, b"v") for k in keys[start:start + 100]])
        objects, truncated = client.list("long/", limit=2000)
        assert truncated
        assert 900 < len(objects) < 2000
        assert [o.key for o in objects] == keys[:len(objects)]
        assert len(client.batch_get(keys[:1100])) == 1100  # split, per-key results


def test_ls_with_long_keys_prints_a_truncated_listing(kvctl: Kvctl, store: str) -> None:
    with StoreClient(store) as client:
        client.batch_put([(f"l/{i:04d}" + "y" * 3500, b"v") for i in range(1500)])
    r = kvctl("store", "ls", "l/", "--limit", "2000", "--master", store, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["truncated"] is True


def test_non_utf8_key_is_a_usage_error(store: str) -> None:
    bad = os.fsencode("k") + b"\xff"
    done = subprocess.run([sys.executable, "-m", "kvctl", "store", "put", bad, "/etc/hostname",
                           "--master", store], capture_output=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert b"not valid UTF-8" in done.stderr
    assert b"Hint:" in done.stderr


def test_put_from_an_endless_source_stops_at_the_bound(kvctl: Kvctl, store: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.commands import store as store_cmd

    monkeypatch.setattr(store_cmd, "MAX_PUT_BYTES", 1 << 20)
    r = kvctl("store", "put", "zero", "/dev/zero", "--master", store)
    assert r.exit_code == 2, r.stderr
    assert "holds more than 1 MiB" in r.stderr


def test_get_over_an_existing_file_that_cannot_be_written_keeps_it(
        kvctl: Kvctl, store: str, tmp_path: Path) -> None:
    with StoreClient(store) as client:
        client.put("obj", b"new bytes" * 1000)
    target = tmp_path / "out.bin"
    target.write_bytes(b"old contents")
    tmp_path.chmod(0o500)  # the directory takes no new file: as good as a full disk here
    try:
        r = kvctl("store", "get", "obj", "-o", str(target), "--master", store)
    finally:
        tmp_path.chmod(0o700)
    if os.geteuid() == 0:  # root writes anyway; check the rename path instead
        assert r.exit_code == 0
        assert target.read_bytes() == b"new bytes" * 1000
        assert not list(tmp_path.glob(".out.bin.*"))
    else:
        assert r.exit_code == 2
        assert target.read_bytes() == b"old contents"


def test_get_on_a_full_disk_leaves_the_old_file(kvctl: Kvctl, store: str, tmp_path: Path
                                                ) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {done.stderr.decode().strip()}")
    try:
        with StoreClient(store) as client:
            client.put("big", os.urandom(200 << 10))
        target = mount / "out.bin"
        target.write_bytes(b"o" * (100 << 10))
        r = kvctl("store", "get", "big", "-o", str(target), "--master", store)
        assert r.exit_code == 2, r.stderr
        assert "unchanged" in r.stderr
        assert target.read_bytes() == b"o" * (100 << 10)
        assert [p.name for p in mount.iterdir()] == ["out.bin"]
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, check=False)
