"""Start-up, help layout and shell completion of the command line itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvctl.cli
from kvctl.help.polish import placeholder, reflow


def _python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, env={**os.environ, **(env or {})})
    return proc.stdout


_IMPORTED = ("import sys\nfrom kvctl.cli import main\n"
             "code = main({args!r})\n"
             "print('MODULES', sorted(m for m in sys.modules if m.startswith('kvctl.commands.')"
             " and m != 'kvctl.commands._common'))\n")


def test_root_help_imports_no_command_module() -> None:
    out = _python(_IMPORTED.format(args=["--help"]))
    assert "MODULES []" in out
    for name in kvctl.cli.FAMILIES:
        assert name in out  # every family is still listed


def test_a_command_imports_only_its_own_family() -> None:
    out = _python(_IMPORTED.format(args=["plan", "--help"]))
    assert "MODULES ['kvctl.commands.plan']" in out


@pytest.mark.parametrize("name", sorted(kvctl.cli.FAMILIES))
def test_family_summary_is_the_first_paragraph_of_its_own_help(name: str) -> None:
    command = kvctl.cli.load_family(name)
    first = (command.help or "").split("\n\n")[0].strip()
    assert kvctl.cli.FAMILIES[name].summary == first


def test_the_lazy_tree_and_the_full_app_have_the_same_commands() -> None:
    import typer

    eager = typer.main.get_command(kvctl.cli.app)
    lazy = kvctl.cli.command_tree()
    assert list(lazy.commands) == list(eager.commands)  # type: ignore[attr-defined]


def _complete(words: str) -> list[str]:
    out = _python("from kvctl.cli import main; main()",
                  env={"_KVCTL_COMPLETE": "complete_bash", "COMP_WORDS": words,
                       "COMP_CWORD": str(len(words.split(" ")) - 1)})
    return out.split()


def test_completion_offers_values_for_vocabulary_options() -> None:
    assert _complete("kvctl bench transfer --transport ") == ["shm", "tcp", "rdma", "auto"]
    # the last item of a comma list, never one already given
    assert _complete("kvctl bench transfer --transport shm,") == [
        "shm,tcp", "shm,rdma", "shm,auto"]
    assert _complete("kvctl bench transfer --role i") == ["initiator"]
    assert "vllm:sha256_cbor" in _complete("kvctl verify-keys emit --profile vllm")
    assert _complete("kvctl store status --backend ") == ["kvctl", "mooncake"]


def test_completion_of_a_family_name_imports_nothing_heavy() -> None:
    assert _complete("kvctl ben") == ["bench"]


def test_reflow_joins_prose_and_keeps_examples_and_lists() -> None:
    text = ("One sentence broken\nin two.\n\n"
            "Example:\n\n    kvctl a\n    kvctl b\n\n"
            "- first item\n  continued\n- second")
    assert reflow(text) == ("One sentence broken in two.\n\n"
                            "Example:\n\n    kvctl a\n    kvctl b\n\n"
                            "- first item continued\n- second")


def test_placeholders_are_unix_style() -> None:
    command = kvctl.cli.load_family("bench").commands["transfer"]  # type: ignore[attr-defined]
    shown = {opt: placeholder(p) for p in command.params for opt in p.opts}
    assert shown["--json"] == ""
    assert shown["--threads"] == "INTEGER"
    assert shown["--engine"] == "TEXT"
