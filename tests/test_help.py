"""``kvctl help``: man-style topic pages shipped as package data, and shell completion."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import typer

from kvctl.cli import app
from kvctl.config import known_sections
from kvctl.help import ALIASES, all_topics, get_topic, topic_names
from tests.fixtures.cli import CliResult

REPO = Path(__file__).resolve().parents[1]
TOPICS_DIR = REPO / "kvctl" / "help" / "topics"
REQUIRED = {"topo", "bench", "store", "keys", "sim", "plan", "runbook", "metadata", "segment",
            "config", "exit-codes", "security"}
#: Command families whose help topic has another name.
FAMILY_TOPIC = {"verify-keys": "keys"}

Kvctl = Callable[..., CliResult]


def root_commands() -> dict[str, object]:
    return dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_lists_every_topic_with_its_summary(kvctl: Kvctl) -> None:
    r = kvctl("help")
    assert r.exit_code == 0, r.stderr
    for topic in all_topics():
        assert re.search(rf"^\s*{re.escape(topic.name)}\s+{re.escape(topic.summary[:40])}",
                         r.stdout, re.MULTILINE), topic.name
    doc = kvctl("help", "--json").json()
    assert doc["kind"] == "help.topics"
    assert {t["name"] for t in doc["topics"]} == set(topic_names())
    assert set(topic_names()) >= REQUIRED
    assert all(t["summary"] for t in doc["topics"])


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_each_topic_renders_as_a_page(kvctl: Kvctl, name: str) -> None:
    r = kvctl("help", name)
    assert r.exit_code == 0, r.stderr
    page = get_topic(name)
    assert page.summary in " ".join(r.stdout.split())  # the title, however it was wrapped
    assert "## " not in r.stdout  # rendered, not the markdown source
    assert max(len(line.rstrip()) for line in r.stdout.splitlines()) <= 100
    doc = kvctl("help", name, "--json").json()
    assert doc["kind"] == "help.topic"
    assert doc["markdown"] == (TOPICS_DIR / f"{name}.md").read_text()


def test_aliases_and_case_lead_to_the_topic(kvctl: Kvctl) -> None:
    assert get_topic("verify-keys").name == "keys"
    assert get_topic("EXIT").name == "exit-codes"
    for alias, target in ALIASES.items():
        assert target in topic_names(), alias
    assert kvctl("help", "verify-keys", "--json").json()["name"] == "keys"


def test_unknown_topic_exits_2_listing_the_topics(kvctl: Kvctl) -> None:
    r = kvctl("help", "nosuch")
    assert r.exit_code == 2
    assert r.stdout == ""
    assert "Error: no help topic 'nosuch'" in r.stderr
    hint = next(line for line in r.stderr.splitlines() if line.startswith("Hint: "))
    for name in topic_names():
        assert name in hint
    r = kvctl("help", "storr")
    assert r.exit_code == 2
    assert "did you mean 'store'?" in r.stderr


def test_every_command_family_has_a_topic_naming_all_its_commands() -> None:
    for family, command in root_commands().items():
        if family == "help":
            continue
        topic = get_topic(FAMILY_TOPIC.get(family, family))
        for sub in getattr(command, "commands", {}):
            assert f"kvctl {family} {sub}" in topic.markdown, \
                f"kvctl help {topic.name} does not show 'kvctl {family} {sub}'"


def test_config_topic_names_every_section() -> None:
    text = get_topic("config").markdown
    # Sections kvctl itself registers (tests register their own, e.g. test_config's demo).
    for section, cls in known_sections().items():
        if cls.__module__.startswith("kvctl."):
            assert f"`{section}`" in text, section


def test_topic_pages_ship_as_package_data() -> None:
    """What an installed kvctl gets: the pyproject globs match every topic file."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kvctl.help"]
    shipped = {p.relative_to(REPO / "kvctl" / "help").as_posix()
               for p in (REPO / "kvctl" / "help").rglob("*")
               if any(fnmatch.fnmatch(p.relative_to(REPO / "kvctl" / "help").as_posix(), pat)
                      for pat in patterns)}
    on_disk = {f"topics/{p.name}" for p in TOPICS_DIR.glob("*.md")}
    assert on_disk
    assert shipped == on_disk
    assert set(topic_names()) == {Path(p).stem for p in on_disk}


def test_docs_index_links_every_topic() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    for name in topic_names():
        assert f"../kvctl/help/topics/{name}.md" in index, name


# -- shell completion (Typer's own) -------------------------------------------------------


def _kvctl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """kvctl as a shell runs it: Typer's completion options end the process themselves."""
    return subprocess.run([sys.executable, "-m", "kvctl", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_show_completion_prints_the_script_for_the_calling_shell() -> None:
    # Typer detects the shell from the parent process (shellingham), so run it from bash.
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    script = f"{shlex.quote(sys.executable)} -m kvctl --show-completion; exit $?"
    done = subprocess.run([bash, "-c", script], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "complete -o default -F _kvctl_completion kvctl" in done.stdout
    assert "_KVCTL_COMPLETE=complete_bash" in done.stdout


def _complete(words: str) -> list[str]:
    cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
    done = _kvctl(_KVCTL_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=cword)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_completion_completes_commands_options_and_topics() -> None:
    assert _complete("kvctl run") == ["runbook"]
    assert "--role" in _complete("kvctl bench transfer --ro")
    assert _complete("kvctl help exit") == ["exit", "exit-code", "exit-codes"]


def test_completion_places_global_options_typed_mid_command() -> None:
    """``--config``/``-v`` after the family name used to leave the completer in the family
    (only ``--help`` offered); completion now reads the line as the command parses it."""
    plain = _complete("kvctl store status --")
    assert "--master" in plain
    assert _complete("kvctl store --config /dev/null status --") == plain
    assert _complete("kvctl store -v status --") == plain
    assert "status" in _complete("kvctl store --config /dev/null st")
    zsh = _kvctl(_KVCTL_COMPLETE="complete_zsh",
                 _TYPER_COMPLETE_ARGS="kvctl store -q status --")
    assert zsh.returncode == 0, zsh.stderr
    assert '"--master"' in zsh.stdout
    # Mid-typing (--config still waiting for its value, an open quote): no crash.
    assert _kvctl(_KVCTL_COMPLETE="complete_bash", COMP_WORDS="kvctl store --config",
                  COMP_CWORD="3").returncode == 0
    assert _kvctl(_KVCTL_COMPLETE="complete_bash", COMP_WORDS="kvctl store 'st",
                  COMP_CWORD="2").returncode == 0


def test_pages_mention_only_commands_that_exist() -> None:
    commands = root_commands()
    for topic in all_topics():
        fenced = re.findall(r"^```[a-z]*\n(.*?)^```", topic.markdown, re.MULTILINE | re.DOTALL)
        inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", topic.markdown,
                                                    flags=re.MULTILINE | re.DOTALL))
        code = "\n".join(fenced + inline)
        assert "kvctl " in code, topic.name
        for family, sub in re.findall(r"\bkvctl ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", code):
            assert family in commands, f"{topic.name}: 'kvctl {family}' is not a command"
            group = getattr(commands[family], "commands", None)
            if group and sub:
                assert sub in group, f"{topic.name}: 'kvctl {family} {sub}' is not a command"


@pytest.mark.parametrize("page", ["index.md", "operator-guide.md"])
def test_docs_links_resolve(page: str) -> None:
    text = (REPO / "docs" / page).read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    for link in links:
        if not link.startswith("http"):
            assert (REPO / "docs" / link).exists(), f"{page}: broken link {link}"
