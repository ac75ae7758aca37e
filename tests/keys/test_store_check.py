"""``kvctl verify-keys --store``: which leading blocks a live store holds, against a real
embedded kvctl store (and a real Mooncake master when it runs here)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvctl.keys.manifest import Manifest, config_from_settings, emit
from kvctl.keys.prompts import read_prompts
from kvctl.keys.settings import KeysSettings
from kvctl.keys.store_check import Verdict, check_store
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from tests.fixtures.cli import CliResult
from tests.fixtures.servers import free_port

Kvctl = Callable[..., CliResult]
BLOCK = 16


@pytest.fixture(autouse=True)
def _no_hashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.fixture
def store() -> Iterator[EmbeddedStore]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=16 << 20)) as s:
        yield s


@pytest.fixture
def client(store: EmbeddedStore) -> Iterator[StoreClient]:
    with StoreClient(store.address, staging_bytes=1 << 20) as c:
        yield c


def _prompts(tmp_path: Path, count: int = 3, blocks: int = 6) -> Path:
    """``count`` prompts of ``blocks`` full blocks plus a partial one, sharing no block."""
    path = tmp_path / "prompts.jsonl"
    n = blocks * BLOCK + 5
    lines = [{"id": f"p{i}", "tokens": [1000 * i + t for t in range(n)]} for i in range(count)]
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return path


def _manifest(path: Path, **settings: object) -> Manifest:
    return emit(config_from_settings(KeysSettings(**settings), env={}), read_prompts(path))  # type: ignore[arg-type]


def _keys(path: Path, prompt: int, **settings: object) -> tuple[str, ...]:
    return _manifest(path, **settings).prompts[prompt].keys


def _put(client: StoreClient, keys: Sequence[str]) -> None:
    assert client.batch_put([(k, b"kv") for k in keys]) == [None] * len(keys)


def _rows(r: CliResult) -> dict[str, dict[str, object]]:
    assert r.exit_code in (0, 1), r.stderr
    doc = r.json()
    assert doc["kind"] == "keys.store-check"
    return {row["prompt"]: row for row in doc["prompts"]}


def test_full_partial_and_missing_prompts(kvctl: Kvctl, store: EmbeddedStore,
                                          client: StoreClient, tmp_path: Path) -> None:
    path = _prompts(tmp_path)
    _put(client, _keys(path, 0))
    p1 = _keys(path, 1)
    _put(client, p1[:2])
    r = kvctl("verify-keys", "--store", store.address, "--prompts", str(path), "--json")
    assert r.exit_code == 0, r.stderr  # no --expect-hit: report only
    doc = r.json()
    assert doc["ok"] is True
    assert doc["keys_checked"] == 18
    assert doc["exists_calls"] == 1  # every prompt's keys in one request
    rows = _rows(r)
    assert rows["p0"] == {"prompt": "p0", "blocks": 6, "held_prefix": 6, "hit_fraction": 1.0,
                          "first_missing_block": None, "first_missing_key": None,
                          "held_after_gap": 0, "verdict": "full", "below_expected": False}
    assert rows["p1"]["held_prefix"] == 2
    assert rows["p1"]["first_missing_block"] == 2
    assert rows["p1"]["first_missing_key"] == p1[2]
    assert rows["p1"]["verdict"] == "partial"
    assert rows["p2"]["held_prefix"] == 0
    assert rows["p2"]["verdict"] == "miss"

    table = kvctl("verify-keys", "--store", store.address, "--prompts", str(path))
    assert table.exit_code == 0
    assert "partial" in table.stdout
    assert "18 keys looked up in 1 request;" in table.stdout


def test_gap_shows_where_the_chain_breaks(kvctl: Kvctl, store: EmbeddedStore,
                                         client: StoreClient, tmp_path: Path) -> None:
    path = _prompts(tmp_path, count=1)
    keys = _keys(path, 0)
    _put(client, [*keys[:2], *keys[3:5]])  # block 2 missing, 3 and 4 held
    r = kvctl("verify-keys", "--store", store.address, "--prompts", str(path), "--json")
    row = _rows(r)["p0"]
    assert (row["held_prefix"], row["first_missing_block"], row["held_after_gap"]) == (2, 2, 2)
    assert row["verdict"] == "broken"
    table = kvctl("verify-keys", "--store", store.address, "--prompts", str(path))
    assert "broken" in table.stdout
    assert "held after a missing one" in table.stdout


def test_keys_written_under_other_settings_are_not_a_hit(
        kvctl: Kvctl, store: EmbeddedStore, client: StoreClient, tmp_path: Path) -> None:
    path = _prompts(tmp_path, count=1)
    # One instance wrote the prompt under tenant-a ...
    _put(client, _keys(path, 0, tenant="tenant-a"))
    # ... another with a different hash (profile).
    _put(client, _keys(path, 0, profile="kvctl:blake2b"))
    base = ("verify-keys", "--store", store.address, "--prompts", str(path), "--json")
    assert _rows(kvctl(*base, "--tenant", "tenant-a"))["p0"]["verdict"] == "full"
    assert _rows(kvctl(*base, "--profile", "kvctl:blake2b"))["p0"]["verdict"] == "full"
    for other in (("--tenant", "tenant-b"), ("--tenant", "tenant-a", "--seed-field", "zone=eu"),
                  ("--tenant", "tenant-a", "--block-size", "32"), ()):
        row = _rows(kvctl(*base, *other))["p0"]
        assert (row["held_prefix"], row["held_after_gap"], row["verdict"]) == (0, 0, "miss"), other


def test_mooncake_key_strings_are_what_is_looked_up(
        kvctl: Kvctl, store: EmbeddedStore, client: StoreClient, tmp_path: Path) -> None:
    path = _prompts(tmp_path, count=1)
    settings = {"profile": "vllm:sha256", "model": "Qwen/Qwen3-8B", "key_format": "mooncake",
                "tp_rank": 1}
    keys = _keys(path, 0, **settings)
    assert all("@tp_rank:1@" in k for k in keys)
    _put(client, keys)
    args = ("verify-keys", "--store", store.address, "--prompts", str(path), "--json",
            "--profile", "vllm:sha256", "--model", "Qwen/Qwen3-8B", "--key-format", "mooncake")
    assert _rows(kvctl(*args, "--tp-rank", "1"))["p0"]["verdict"] == "full"
    assert _rows(kvctl(*args, "--tp-rank", "0"))["p0"]["verdict"] == "miss"
    raw = _rows(kvctl(*args[:-2], "--tp-rank", "1"))["p0"]  # raw keys were never stored
    assert raw["verdict"] == "miss"


def test_expect_hit_sets_the_exit_code(kvctl: Kvctl, store: EmbeddedStore,
                                       client: StoreClient, tmp_path: Path) -> None:
    path = _prompts(tmp_path, count=2)
    _put(client, _keys(path, 0))
    _put(client, _keys(path, 1)[:4])  # 4 of 6 blocks: 0.667
    base = ("verify-keys", "--store", store.address, "--prompts", str(path))
    assert kvctl(*base, "--expect-hit", "0.6").exit_code == 0
    r = kvctl(*base, "--expect-hit", "0.7", "--json")
    assert r.exit_code == 1
    assert r.json()["ok"] is False
    assert {p: row["below_expected"] for p, row in _rows(r).items()} == {"p0": False,
                                                                         "p1": True}
    assert kvctl(*base, "--expect-hit", "1.5").exit_code == 2


def test_batches_span_prompts_and_match_one_by_one(store: EmbeddedStore, client: StoreClient,
                                                   tmp_path: Path) -> None:
    path = _prompts(tmp_path)
    manifest = _manifest(path)
    _put(client, manifest.prompts[0].keys[:5])
    _put(client, manifest.prompts[1].keys[1:])
    calls: list[int] = []

    def counting(keys: Sequence[str]) -> list[bool]:
        calls.append(len(keys))
        return client.batch_exists(keys)

    batched = check_store(manifest, counting, backend="kvctl", store=store.address,
                          max_keys_per_call=5)
    assert calls == [5, 5, 5, 3]  # 18 keys; requests cross prompt boundaries
    single = check_store(manifest, client.batch_exists, backend="kvctl", store=store.address,
                         max_keys_per_call=1)
    assert batched.prompts == single.prompts
    assert [p.verdict for p in batched.prompts] == [Verdict.PARTIAL, Verdict.BROKEN,
                                                    Verdict.MISS]
    assert batched.exists_calls == 4
    assert single.exists_calls == 18


def test_empty_store_address_finds_the_local_store(
        kvctl: Kvctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    path = _prompts(tmp_path, count=1)
    settings = StoreSettings(listen="127.0.0.1:0", capacity=16 << 20)
    with EmbeddedStore(settings, write_discovery=True) as local, \
            StoreClient(local.address, staging_bytes=1 << 20) as c:
        _put(c, _keys(path, 0)[:3])
        r = kvctl("verify-keys", "--store", "", "--prompts", str(path), "--json")
        assert r.exit_code == 0, r.stderr
        assert r.json()["store"] == local.address
        assert _rows(r)["p0"]["held_prefix"] == 3


def test_unreachable_store_exits_3_with_a_hint(kvctl: Kvctl, tmp_path: Path) -> None:
    path = _prompts(tmp_path, count=1)
    r = kvctl("verify-keys", "--store", f"127.0.0.1:{free_port()}", "--prompts", str(path))
    assert r.exit_code == 3
    assert "Error: cannot reach the store master" in r.stderr
    assert "Hint:" in r.stderr
    assert "--store" in r.stderr


def test_bad_input_exits_2(kvctl: Kvctl, store: EmbeddedStore, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": [1, 2]}\n{"id": "b", "tokens": [1,\n')
    r = kvctl("verify-keys", "--store", store.address, "--prompts", str(bad))
    assert r.exit_code == 2
    assert f"prompts file {bad}, line 2" in r.stderr
    r = kvctl("verify-keys", "--store", store.address, "--prompts", str(tmp_path / "none"))
    assert r.exit_code == 2
    assert "cannot read prompts file" in r.stderr
    r = kvctl("verify-keys", "--store", store.address)
    assert r.exit_code == 2
    assert "needs both --store ADDR and --prompts FILE" in r.stderr
    good = _prompts(tmp_path, count=1)
    r = kvctl("verify-keys", "--store", store.address, "--prompts", str(good), "--backend", "x")
    assert r.exit_code == 2
    assert "unknown backend" in r.stderr


@pytest.mark.integration
def test_mooncake_backend(kvctl: Kvctl, tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeMaster, MooncakeStore, MooncakeUnavailableError

    path = _prompts(tmp_path, count=2, blocks=3)
    try:
        master = MooncakeMaster(storage_bytes=64 << 20)
    except MooncakeUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc.cause}")
    with master, MooncakeStore(master.address, global_segment_bytes=0) as mc:
        for key in _keys(path, 0)[:2]:
            mc.put(key, b"kv")
        r = kvctl("verify-keys", "--backend", "mooncake", "--store", master.address,
                  "--prompts", str(path), "--json")
        rows = _rows(r)
        assert r.json()["backend"] == "mooncake"
        assert (rows["p0"]["held_prefix"], rows["p0"]["verdict"]) == (2, "partial")
        assert rows["p1"]["verdict"] == "miss"
