"""kvctl verify-keys end to end: self-check, profiles, emit, compare, PYTHONHASHSEED."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.keys.manifest import config_from_settings, emit, manifest_to_json
from kvctl.keys.prompts import read_prompts
from kvctl.keys.settings import KeysSettings
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PROMPTS = REPO / "examples" / "keys" / "prompts.jsonl"


@pytest.fixture(autouse=True)
def _no_hashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "chat", "tokens": list(range(1, 70))},
        {"id": "lora", "tokens": list(range(5, 50)), "lora": {"name": "sql", "path": "/l"}},
        {"id": "salted", "tokens": list(range(9, 60)), "cache_salt": "tenant-a"},
    ]
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return path


@pytest.mark.parametrize("profile", ["kvctl:sha256", "kvctl:xxh3-128", "vllm:sha256",
                                     "vllm:sha256_cbor", "sglang"])
def test_self_check_passes(kvctl: Kvctl, profile: str) -> None:
    r = kvctl("verify-keys", "--profile", profile, "--tenant-isolation", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = r.json()
    assert doc["kind"] == "keys.selfcheck"
    assert doc["ok"] is True
    names = {c["name"] for c in doc["checks"]}
    assert {"partial blocks have no key", "same prefix, same keys"} <= names
    assert doc["tenant_isolation"]
    assert all(c["passed"] for c in doc["tenant_isolation"])


def test_self_check_table_and_failure_exit(kvctl: Kvctl) -> None:
    ok = kvctl("verify-keys")
    assert ok.exit_code == 0
    assert "a change at token t" in ok.stdout
    # LMCache keys carry no tenant, and vLLM xxhash without PYTHONHASHSEED is per-process.
    assert kvctl("verify-keys", "--profile", "lmcache", "--tenant-isolation").exit_code == 1
    failed = kvctl("verify-keys", "--profile", "vllm:xxhash", "--json")
    assert failed.exit_code == 1
    assert [c["name"] for c in failed.json()["checks"] if not c["passed"]] == [
        "reproducible across processes"]
    pinned = kvctl("verify-keys", "--profile", "vllm:xxhash", env={"PYTHONHASHSEED": "3"})
    assert pinned.exit_code == 0


def test_profiles_listed_and_unknown_profile_lists_them(kvctl: Kvctl) -> None:
    r = kvctl("verify-keys", "profiles", "--json")
    names = {p["name"] for p in r.json()["profiles"]}
    assert {"vllm:sha256", "vllm:sha256_cbor", "vllm:xxhash", "lmcache", "sglang",
            "kvctl:sha256", "kvctl:blake2b", "kvctl:xxh3-128"} <= names
    bad = kvctl("verify-keys", "--profile", "vllm:md5")
    assert bad.exit_code == 2
    assert "unknown key profile 'vllm:md5'" in bad.stderr
    assert "vllm:sha256_cbor" in bad.stderr


def test_emit_then_compare_two_hosts(tmp_path: Path, kvctl: Kvctl) -> None:
    prompts = _prompts(tmp_path)
    a, b, c = (tmp_path / f"host-{n}.json" for n in "abc")
    common = ("--profile", "vllm:sha256_cbor", "--block-size", "16", "--prompts", str(prompts))
    assert kvctl("verify-keys", "emit", *common, "-o", str(a)).exit_code == 0
    assert kvctl("verify-keys", "emit", *common, "-o", str(b)).exit_code == 0
    r = kvctl("verify-keys", "compare", str(a), str(b), "--json")
    assert r.exit_code == 0
    assert r.json()["ok"] is True
    # Host c runs with PYTHONHASHSEED set: every key differs, and compare says why.
    assert kvctl("verify-keys", "emit", *common, "-o", str(c),
                 env={"PYTHONHASHSEED": "0"}).exit_code == 0
    r = kvctl("verify-keys", "compare", str(a), str(c), "--json")
    assert r.exit_code == 1
    results = r.json()["results"]
    assert {x["first_diverging_block"] for x in results} == {0}
    assert all([k["setting"] for k in x["causes"]] == ["pythonhashseed"] for x in results)
    table = kvctl("verify-keys", "compare", str(a), str(c))
    assert table.exit_code == 1
    assert "MISMATCH" in table.stdout


def test_emit_lmcache_needs_model_and_dtype(tmp_path: Path, kvctl: Kvctl) -> None:
    prompts = _prompts(tmp_path)
    r = kvctl("verify-keys", "emit", "--profile", "lmcache", "--prompts", str(prompts))
    assert r.exit_code == 2
    assert "--model and --kv-dtype" in r.stderr
    ok = kvctl("verify-keys", "emit", "--profile", "lmcache", "--block-size", "16",
               "--model", "Qwen/Qwen3-8B", "--kv-dtype", "bfloat16", "--prompts", str(prompts),
               "-o", str(tmp_path / "m.json"), "--json", env={"PYTHONHASHSEED": "0"})
    assert ok.exit_code == 0
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["prompts"][0]["keys"][0].startswith("Qwen/Qwen3-8B@1@0@")


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None
                    or importlib.util.find_spec("transformers") is not None,
                    reason="a tokenizer package is installed here")
def test_text_prompts_without_tokenizer_package_exit_3(tmp_path: Path, kvctl: Kvctl) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "text": "hello"}\n')
    r = kvctl("verify-keys", "emit", "--prompts", str(path), "--tokenizer", "gpt2")
    assert r.exit_code == 3
    assert "Hint: pip install tokenizers" in r.stderr


def _emit_in_subprocess(tmp_path: Path, name: str, profile: str, hashseed: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-c", "import sys; from kvctl.cli import main; sys.exit(main())",
           "verify-keys", "emit", "--profile", profile, "--model", "m", "--kv-dtype", "half",
           "--block-size", "16", "--prompts", str(_prompts(tmp_path)), "-o", str(out)]
    subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True, timeout=60)
    return json.loads(out.read_text())


def _keys(doc: dict) -> list[list[str]]:
    return [p["keys"] for p in doc["prompts"]]


def _emit_here(tmp_path: Path, profile: str, hashseed: str | None) -> dict:
    config = config_from_settings(
        KeysSettings(profile=profile, model="m", kv_dtype="half", block_size=16),
        env={} if hashseed is None else {"PYTHONHASHSEED": hashseed})
    return manifest_to_json(emit(config, read_prompts(_prompts(tmp_path))))


def test_pythonhashseed_in_subprocesses(tmp_path: Path) -> None:
    # kvctl's keys never depend on PYTHONHASHSEED: another interpreter, another seed, same keys.
    other = _emit_in_subprocess(tmp_path, "k", "kvctl:sha256", "123")
    assert _keys(other) == _keys(_emit_here(tmp_path, "kvctl:sha256", None))
    # vLLM sha256 with PYTHONHASHSEED unset uses its fixed default: stable across processes.
    unset = _emit_in_subprocess(tmp_path, "v", "vllm:sha256", None)
    assert unset["seed"]["source"] == "default"
    assert _keys(unset) == _keys(_emit_here(tmp_path, "vllm:sha256", None))
    # Set, vLLM hashes its text: every key changes, and the manifest records the value.
    s1 = _emit_in_subprocess(tmp_path, "s1", "vllm:sha256", "1")
    assert (s1["config"]["pythonhashseed"], s1["seed"]["source"]) == ("1", "PYTHONHASHSEED")
    assert all(x != y for ka, kb in zip(_keys(unset), _keys(s1), strict=True)
               for x, y in zip(ka, kb, strict=True))
    # LMCache's builtin hash: reproducible across interpreters only when the seed is set.
    l5 = _emit_in_subprocess(tmp_path, "l5", "lmcache", "5")
    assert _keys(l5) == _keys(_emit_here(tmp_path, "lmcache", "5"))
    assert _emit_here(tmp_path, "lmcache", None)["seed"]["source"] == "random"
    assert _keys(_emit_here(tmp_path, "lmcache", None)) != _keys(_emit_here(tmp_path, "lmcache",
                                                                           None))


def test_example_prompts_file_is_valid(tmp_path: Path, kvctl: Kvctl) -> None:
    out = tmp_path / "ex.json"
    r = kvctl("verify-keys", "emit", "--prompts", str(EXAMPLE_PROMPTS), "-o", str(out))
    assert r.exit_code == 0, r.stderr
