"""``kvctl store`` commands against an in-process store, and bad input."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.store.embedded import EmbeddedStore, resolve_master
from kvctl.store.settings import StoreSettings
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    settings = StoreSettings(listen="127.0.0.1:0", capacity=48 << 20, ssd=tmp_path / "ssd")
    with EmbeddedStore(settings) as s:
        yield s


def test_put_get_ls_stat_rm_status(kvctl: Kvctl, store: EmbeddedStore, tmp_path: Path) -> None:
    m = ["--master", store.address]
    src = tmp_path / "in.bin"
    data = os.urandom(300_000)
    src.write_bytes(data)
    r = kvctl("store", "put", "blocks/a", str(src), *m, "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["size_bytes"] == len(data)

    dst = tmp_path / "out.bin"
    r = kvctl("store", "get", "blocks/a", "-o", str(dst), *m)
    assert r.exit_code == 0, r.stderr
    assert dst.read_bytes() == data

    assert kvctl("store", "put", "blocks/b", str(src), *m).exit_code == 0
    assert kvctl("store", "put", "other", str(src), *m).exit_code == 0
    r = kvctl("store", "ls", "blocks/", *m, "--json")
    assert [o["key"] for o in r.json()["objects"]] == ["blocks/a", "blocks/b"]
    r = kvctl("store", "ls", "blocks/", *m)
    assert r.exit_code == 0
    assert "blocks/b" in r.stdout

    r = kvctl("store", "stat", "blocks/a", *m, "--json")
    info = r.json()
    assert info["size_bytes"] == len(data)
    assert info["tier"] in ("dram", "dram+ssd")

    r = kvctl("store", "status", *m, "--json")
    doc = r.json()
    assert doc["kind"] == "store.status"
    assert doc["objects"] == 3
    assert doc["nodes"][0]["ssd_policy"] == "write-through"
    assert "nodes" in kvctl("store", "status", *m).stdout

    assert kvctl("store", "rm", "blocks/a", *m).exit_code == 0
    r = kvctl("store", "rm", "blocks/a", *m)
    assert r.exit_code == 1
    assert "Error: key 'blocks/a' is not in the store" in r.stderr
    r = kvctl("store", "get", "blocks/a", "-o", str(dst), *m)
    assert r.exit_code == 1
    assert "Hint:" in r.stderr
    r = kvctl("store", "stat", "missing", *m)
    assert r.exit_code == 1


@pytest.mark.parametrize(("args", "needle"), [
    (["store", "put", "k", "/no/such/file"], "cannot read /no/such/file"),
    (["store", "put", "k", "-", "--backend", "redis"], "unknown backend"),
    (["store", "get", "k", "--json"], "--json prints metadata"),
    (["store", "ls", "--limit", "-1"], "--limit -1 is negative"),
    (["store", "serve", "--capacity", "12XB"], "unknown unit"),
    (["store", "get", "k", "--backend", "mooncake"], "needs --master"),
    (["store", "ls", "--master", "127.0.0.1:notaport"], "bad port"),
])
def test_bad_input_exits_2(kvctl: Kvctl, args: list[str], needle: str) -> None:
    r = kvctl(*args)
    assert r.exit_code == 2, r.stderr
    assert "Error:" in r.stderr
    assert "Hint:" in r.stderr
    assert needle in r.stderr


def test_unreachable_master_exits_3(kvctl: Kvctl) -> None:
    from tests.fixtures.servers import free_port

    r = kvctl("store", "status", "--master", f"127.0.0.1:{free_port()}")
    assert r.exit_code == 3
    assert "cannot reach the store master" in r.stderr
    assert "kvctl store serve" in r.stderr


def test_client_commands_find_the_embedded_store(
        kvctl: Kvctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    settings = StoreSettings(listen="127.0.0.1:0", capacity=8 << 20)
    assert resolve_master(settings) == "127.0.0.1:50051"
    with EmbeddedStore(settings, write_discovery=True) as s:
        assert resolve_master(StoreSettings()) == s.address
        src = tmp_path / "v"
        src.write_bytes(b"hello")
        assert kvctl("store", "put", "k", str(src)).exit_code == 0
        r = kvctl("store", "stat", "k", "--json")
        assert r.exit_code == 0
        assert r.json()["size_bytes"] == 5
    assert not (tmp_path / "kvctl" / "store.json").exists()


def test_smoke_embedded_json(kvctl: Kvctl) -> None:
    r = kvctl("store", "smoke", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["ok"] is True
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status == {"single": "pass", "batch": "pass", "concurrent": "pass",
                      "exists-remove": "pass", "ssd-persist": "pass", "failover": "pass",
                      "eviction": "pass", "ssd-read": "pass", "shared-tier": "pass"}


def test_smoke_against_master_reports_skips(kvctl: Kvctl, store: EmbeddedStore) -> None:
    r = kvctl("store", "smoke", "--master", store.address)
    assert r.exit_code == 0, r.stderr
    assert "failover" in r.stdout
    assert "skip" in r.stdout
