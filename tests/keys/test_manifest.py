"""Manifests: emit/write/read round trip and malformed inputs (exit 2, file and place)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.keys.chain import SeedFields
from kvctl.keys.manifest import emit, read_manifest, write_manifest
from kvctl.keys.profiles import KeyConfig
from kvctl.keys.prompts import LoraRef, Prompt, read_prompts
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]


def _prompts() -> list[Prompt]:
    return [Prompt("a", tuple(range(40))),
            Prompt("b", tuple(range(100, 164)), LoraRef("sql", "/l/sql"), "salt-1", "ek")]


def test_manifest_round_trip(tmp_path: Path) -> None:
    config = KeyConfig(profile="vllm:sha256_cbor", block_size=16,
                       fields=SeedFields(model="m", revision="r", extra=(("x", "1"),)),
                       pythonhashseed="7", tp_rank=2)
    manifest = emit(config, _prompts())
    path = tmp_path / "m.json"
    write_manifest(manifest, path)
    back = read_manifest(path)
    assert back.config == manifest.config
    assert back.prompts == manifest.prompts
    assert (back.seed, back.fingerprint) == (manifest.seed, manifest.fingerprint)
    assert back.source == str(path)
    assert [len(p.keys) for p in back.prompts] == [2, 4]
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 1
    assert doc["kind"] == "kvctl.keys.manifest"


def _write_valid(tmp_path: Path) -> Path:
    path = tmp_path / "good.json"
    write_manifest(emit(KeyConfig(), _prompts()), path)
    return path


def _mutations() -> list[tuple[str, Callable[[dict], None], str]]:
    def drop_config_model(d: dict) -> None:
        del d["config"]["model"]

    def bad_key_type(d: dict) -> None:
        d["prompts"][1]["keys"][2] = 5

    def future_schema(d: dict) -> None:
        d["schema_version"] = 99

    def wrong_kind(d: dict) -> None:
        d["kind"] = "something.else"

    def fewer_keys(d: dict) -> None:
        d["prompts"][0]["keys"].pop()

    def duplicate_id(d: dict) -> None:
        d["prompts"][1]["id"] = "a"

    return [
        ("missing field", drop_config_model, "config: missing field 'model'"),
        ("key not a string", bad_key_type, "prompts[1].keys[2]: is not a string"),
        ("future schema", future_schema, "schema_version 99"),
        ("wrong kind", wrong_kind, "kind"),
        ("fewer keys than blocks", fewer_keys, "prompts[0]"),
        ("duplicate prompt", duplicate_id, "duplicate prompt id"),
    ]


@pytest.mark.parametrize(("label", "mutate", "where"), _mutations(),
                         ids=[m[0] for m in _mutations()])
def test_malformed_manifest_exits_2_naming_file_and_place(
        tmp_path: Path, kvctl: Kvctl, label: str, mutate: Callable[[dict], None],
        where: str) -> None:
    good = _write_valid(tmp_path)
    doc = json.loads(good.read_text())
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = kvctl("verify-keys", "compare", str(good), str(bad))
    assert r.exit_code == 2, label
    assert f"Error: manifest {bad}" in r.stderr
    assert where in r.stderr
    assert "Hint:" in r.stderr


def test_truncated_manifest_names_line(tmp_path: Path, kvctl: Kvctl) -> None:
    good = _write_valid(tmp_path)
    bad = tmp_path / "cut.json"
    bad.write_text(good.read_text()[:300])
    r = kvctl("verify-keys", "compare", str(good), str(bad))
    assert r.exit_code == 2
    assert f"manifest {bad}: not valid JSON at line" in r.stderr


@pytest.mark.parametrize(("content", "line", "what"), [
    ('{"id": "a", "tokens": [1, 2]}\n{"id": "b", "tokens": [1, -4]}\n', 2, "token 1"),
    ('{"id": "a", "tokens": [1, 2]}\n\n{"id": "b", "tokens": [1, 2\n', 3, "not valid JSON"),
    ('{"id": "a", "tokens": [1]}\n{"id": "a", "tokens": [2]}\n', 2, "already used on line 1"),
    ('{"id": "a"}\n', 1, "neither 'tokens' nor 'text'"),
    ('{"id": "a", "tokens": [1], "lora": "x"}\n', 1, "'lora' must be an object"),
    ('{"id": "a", "tokens": [1], "salt": "x"}\n', 1, "unknown field(s) salt"),
    ('[1, 2, 3]\n', 1, "expected a JSON object"),
    ('{"id": "a", "text": "hello"}\n', 1, "needs a tokenizer"),
])
def test_malformed_prompts_exit_2_naming_file_and_line(tmp_path: Path, kvctl: Kvctl,
                                                       content: str, line: int,
                                                       what: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    r = kvctl("verify-keys", "emit", "--prompts", str(path), "-o", str(tmp_path / "o.json"))
    assert r.exit_code == 2
    assert f"Error: prompts file {path}, line {line}: " in r.stderr
    assert what in r.stderr
    assert not (tmp_path / "o.json").exists()


def test_empty_and_missing_prompts_files(tmp_path: Path) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(UsageError, match="holds no prompts"):
        read_prompts(empty)
    with pytest.raises(UsageError, match="cannot read prompts file"):
        read_prompts(tmp_path / "absent.jsonl")
