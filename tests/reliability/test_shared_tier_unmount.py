"""A brief unmount of the shared tier (an NFS or 3FS hiccup) loses nothing.

The tier covered by an empty directory for a few seconds: tier-only objects read meanwhile
are misses, their clients report the files bad, and the master's check found each file
"missing" and dropped it from the index: 7 of 7 acknowledged objects became permanent
misses ("its shared-tier file was bad (missing)") although every file came back intact.
A file is missing only from a mounted tier (its root holds the ``.kvctl-tier`` marker, as
the write path already checks): the entries stay, the reads are misses for now, counted
as ``unmounted``, and every object reads back byte for byte once the tier is back. A file
really gone from a mounted tier is still dropped (tests/store/test_shared_tier_reports.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.sharedtier.config import TIER_MARKER
from kvctl.store.sharedtier.fileformat import file_name
from tests.store.conftest import wait_for
from tests.store.test_shared_tier import MiB, SharedCluster, _fill

COUNT = 7


@contextlib.contextmanager
def _renamed_away(root: Path) -> Iterator[None]:
    """The tier's directory renamed away, an empty one in its place (a bare mount point)."""
    away = root.with_name(root.name + ".away")
    root.rename(away)
    root.mkdir(mode=0o700)
    try:
        yield
    finally:
        shutil.rmtree(root)
        away.rename(root)


@contextlib.contextmanager
def _mounted_over(root: Path) -> Iterator[None]:
    """An empty directory bind-mounted over the tier (what an unmount leaves behind)."""
    empty = root.with_name(root.name + ".empty")
    empty.mkdir(mode=0o700)
    out = subprocess.run(["mount", "--bind", str(empty), str(root)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        empty.rmdir()
        pytest.skip(f"cannot bind-mount here: {out.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
        empty.rmdir()


@pytest.mark.parametrize(("cover", "pack_below"), [("renamed", 0), ("bind-mount", 0),
                                                   ("renamed", MiB)],
                         ids=["renamed", "bind-mount", "renamed-packed"])
def test_objects_read_while_the_tier_is_unmounted_come_back(tmp_path: Path, cover: str,
                                                             pack_below: int) -> None:
    if cover == "bind-mount" and (os.geteuid() != 0 or shutil.which("mount") is None):
        pytest.skip("needs root and mount(8) to bind-mount over the tier")
    root = tmp_path / "dfs"
    c = SharedCluster(root, state=str(tmp_path / "state"), pack_below=pack_below)
    try:
        c.node()
        with StoreClient(c.address) as client:
            values = {f"k{i}": os.urandom(MiB // 2) for i in range(COUNT)}
            for key, value in values.items():
                client.put(key, value)
            _fill(client)
            wait_for(lambda: all(client.stat(k).tier == "shared" for k in values),
                     what="write-back of every object")
            assert (root / TIER_MARKER).exists()
            if pack_below:
                st = client.status().shared
                assert st is not None
                assert st.packed_objects >= COUNT  # several to a pack file
            with (_renamed_away if cover == "renamed" else _mounted_over)(root):
                assert not (root / TIER_MARKER).exists()
                for key in values:
                    with pytest.raises(ObjectNotFoundError):
                        client.get(key)  # a miss for now, reported to the master
                wait_for(lambda: client.status().shared.errors.get(  # type: ignore[union-attr]
                    "unmounted", 0) >= COUNT, what="the master's checks of the reports")
                st = client.status().shared
                assert st is not None
                assert st.bad_files == 0
                assert "not mounted" in st.last_error, st.last_error
                for key in values:
                    assert client.stat(key).tier == "shared"  # the entry stays
            # the tier is back: every acknowledged object, byte for byte
            for key, value in values.items():
                assert client.get(key) == value, key
            st = client.status().shared
            assert st is not None
            assert st.bad_files == 0
        for node in c.nodes:
            node.close()
        c.nodes.clear()
        c.restart_master()  # nothing was dropped from the state either
        with StoreClient(c.address) as client:
            for key, value in values.items():
                assert client.get(key) == value, key
    finally:
        c.close()


def test_a_file_gone_from_the_mounted_tier_is_still_dropped(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    c = SharedCluster(root)
    try:
        c.node()
        with StoreClient(c.address) as client:
            client.put("gone", os.urandom(MiB // 2))
            _fill(client)
            wait_for(lambda: client.stat("gone").tier == "shared", what="write-back")
            path = root / file_name("gone", client.stat("gone").version)
            path.unlink()  # gone from the tier itself (its marker is there): bad
            with pytest.raises(ObjectNotFoundError):
                client.get("gone")
            wait_for(lambda: client.status().shared.bad_files == 1,  # type: ignore[union-attr]
                     what="the master's check of the reported file")

            def forgotten() -> bool:
                try:
                    client.stat("gone")
                except ObjectNotFoundError:
                    return True
                return False

            wait_for(forgotten, what="the object dropped (its last copy)")
    finally:
        c.close()


def test_a_master_started_while_the_tier_is_unmounted_refuses(tmp_path: Path) -> None:
    """A master (re)started on the bare mount point must not take it for the tier: it
    made the marker there itself, and every file would have read "missing"."""
    root = tmp_path / "dfs"
    c = SharedCluster(root, state=str(tmp_path / "state"))
    try:
        c.node()
        with StoreClient(c.address) as client:
            value = os.urandom(MiB // 2)
            client.put("k", value)
            _fill(client)
            wait_for(lambda: client.stat("k").tier == "shared", what="write-back")
        for node in c.nodes:
            node.close()
        c.nodes.clear()
        with _renamed_away(root):
            with pytest.raises(UsageError, match="not mounted"):
                c.restart_master()
            assert not (root / TIER_MARKER).exists()  # the bare mount point stays bare
        c.restart_master()
        with StoreClient(c.address) as client:
            assert client.get("k") == value
    finally:
        c.close()
