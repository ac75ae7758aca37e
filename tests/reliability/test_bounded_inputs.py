"""Inputs people hand kvctl are bounded: a YAML alias bomb, a huge or deep document."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvctl.errors import ConfigError
from kvctl.yamlfile import MAX_ALIASES, MAX_DEPTH, load_yaml

BOMB = "\n".join(['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
                  *(f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9)
                    + "]" for i in range(8)),
                  "topo:\n  root: *i"]) + "\n"


def test_alias_bomb_is_refused_without_expanding() -> None:
    with pytest.raises(ConfigError) as info:
        load_yaml(BOMB, "bomb.yaml")
    assert f"more than {MAX_ALIASES} aliases" in info.value.cause
    assert "bomb.yaml" in info.value.cause


def test_a_few_aliases_still_work() -> None:
    doc = load_yaml("base: &b {x: 1}\none: *b\ntwo: *b\n", "ok.yaml")
    assert doc["one"] == doc["two"] == {"x": 1}


def test_deep_nesting_and_huge_documents_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_yaml("[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5), "deep.yaml")
    assert "nested deeper" in info.value.cause
    with pytest.raises(ConfigError) as info:
        load_yaml("x: " + "y" * (2 << 20), "big.yaml")
    assert "limit" in info.value.cause


@pytest.mark.parametrize("where", ["config", "runbook"])
def test_alias_bomb_through_the_cli_exits_2_at_once(tmp_path: Path, where: str) -> None:
    path = tmp_path / "bomb.yaml"
    if where == "config":
        path.write_text(BOMB)
        argv = ["--config", str(path), "doctor", "env"]
    else:
        path.write_text(BOMB.replace("topo:\n  root: *i", "steps: *i"))
        argv = ["runbook", str(path)]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvctl", *argv], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 20
    assert "aliases" in done.stderr
    assert "Hint:" in done.stderr
