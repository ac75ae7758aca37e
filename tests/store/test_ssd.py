"""SSD tier: files verified on read; torn or flipped files are misses, never served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvctl.store.checksum import checksum
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.ssd import SsdCorruptError, SsdMissingError, SsdStaleError, SsdTier
from tests.store.conftest import Cluster, wait_for


def test_ssd_file_roundtrip_and_corruption(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path)
    data = os.urandom(100_000)
    tier.write("k/1", 7, memoryview(data), checksum(data))
    out = bytearray(len(data))
    tier.read_into("k/1", memoryview(out), checksum(data))
    assert out == data
    with pytest.raises(SsdStaleError):
        tier.write("k/2", 1, memoryview(data), checksum(data) ^ 1)
    with pytest.raises(SsdMissingError):
        tier.read_into("k/2", memoryview(out), 1)

    path = tier.path_for("k/1")
    raw = bytearray(path.read_bytes())
    raw[-500] ^= 0x01  # one flipped bit in the payload
    path.write_bytes(raw)
    with pytest.raises(SsdCorruptError, match="checksum"):
        tier.read_into("k/1", memoryview(out), checksum(data))
    assert not path.exists()  # a corrupt file is deleted, never retried

    tier.write("k/1", 8, memoryview(data), checksum(data))
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size - 10)  # torn write
    with pytest.raises(SsdCorruptError, match="truncated"):
        tier.read_into("k/1", memoryview(out), checksum(data))


def test_write_through_survives_dram_eviction(cluster: Cluster, tmp_path: Path) -> None:
    node = cluster.add_node("a", 8 << 20, ssd_dir=tmp_path)
    with StoreClient(cluster.address) as client:
        keep = os.urandom(1 << 20)
        client.put("keep", keep)
        wait_for(lambda: client.stat("keep").tier == "dram+ssd", what="persist to SSD")
        assert node.ssd is not None
        assert node.ssd.path_for("keep").exists()
        for i in range(16):  # 16 MiB through 8 MiB of DRAM: "keep" leaves DRAM
            client.put(f"fill-{i}", os.urandom(1 << 20))
        assert client.stat("keep").tier == "ssd"
        assert client.get("keep") == keep  # a get that misses DRAM reads SSD
        assert client.stat("keep").tier == "dram+ssd"
        assert client.status().tiers["ssd"] >= 1


def test_corrupt_ssd_copy_is_a_miss(cluster: Cluster, tmp_path: Path) -> None:
    node = cluster.add_node("a", 8 << 20, ssd_dir=tmp_path)
    assert node.ssd is not None
    with StoreClient(cluster.address) as client:
        for name, damage in (("flip", "flip"), ("torn", "truncate")):
            client.put(name, os.urandom(1 << 20))
            wait_for(lambda n=name: "ssd" in client.stat(n).tier, what="persist")
            path = node.ssd.path_for(name)
            if damage == "flip":
                raw = bytearray(path.read_bytes())
                raw[len(raw) // 2] ^= 0x40
                path.write_bytes(raw)
            else:
                with path.open("r+b") as fh:
                    fh.truncate(path.stat().st_size // 2)
        for i in range(16):
            client.put(f"fill-{i}", os.urandom(1 << 20))
        for name in ("flip", "torn"):
            assert client.stat(name).tier == "ssd"
            with pytest.raises(ObjectNotFoundError) as info:
                client.get(name)
            assert info.value.evicted
            assert not client.exists(name)


def test_write_back_persists_only_on_eviction(cluster: Cluster, tmp_path: Path) -> None:
    node = cluster.add_node("a", 8 << 20, ssd_dir=tmp_path, ssd_policy="write-back")
    assert node.ssd is not None
    with StoreClient(cluster.address) as client:
        first = os.urandom(1 << 20)
        client.put("first", first)
        assert client.stat("first").tier == "dram"
        assert not node.ssd.path_for("first").exists()
        for i in range(12):
            client.put(f"fill-{i}", os.urandom(1 << 20))
        wait_for(lambda: client.stat("first").tier == "ssd", what="write-back eviction")
        assert client.get("first") == first
