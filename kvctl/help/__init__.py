"""Help, all of it but the command: the topic pages here, the help text of every command in
:mod:`kvctl.help.polish`; :mod:`kvctl.commands.help` is ``kvctl help`` itself (it renders).

Help topics: man-style pages for ``kvctl help TOPIC``, shipped as package data.

Each topic is a Markdown file ``kvctl/help/topics/<name>.md`` whose first line is
``# <name> — <one-line summary>``. The pages are the reference an operator reads at the
terminal (synopsis, options, exit status, environment, examples); ``docs/`` holds the longer
design notes and links to them. Pages are read with :mod:`importlib.resources`, so they work
from a checkout, a wheel or a zip alike.
"""

from __future__ import annotations

import dataclasses
import difflib
from importlib import resources

from kvctl.errors import UsageError

#: Other names people type for a topic.
ALIASES = {
    "verify-keys": "keys",
    "exit": "exit-codes",
    "exit-code": "exit-codes",
    "errors": "exit-codes",
    "prometheus": "metrics",
    "auth": "security",
    "token": "security",
    "configuration": "config",
    "completion": "config",
}

_SEPARATOR = " — "


@dataclasses.dataclass(frozen=True)
class Topic:
    """One help page.

    Attributes:
        name: what ``kvctl help NAME`` takes.
        summary: the one-line description from the page's title.
        markdown: the whole page.
    """

    name: str
    summary: str
    markdown: str


def _topics_dir() -> resources.abc.Traversable:
    return resources.files("kvctl.help").joinpath("topics")


def topic_names() -> list[str]:
    """Every topic, sorted."""
    return sorted(entry.name.removesuffix(".md") for entry in _topics_dir().iterdir()
                  if entry.name.endswith(".md"))


def _parse(name: str, markdown: str) -> Topic:
    title = markdown.splitlines()[0] if markdown else ""
    head, sep, summary = title.removeprefix("# ").partition(_SEPARATOR)
    if not title.startswith("# ") or not sep or head.strip() != name:
        raise UsageError(f"help topic {name} is malformed: its first line must be "
                         f"'# {name}{_SEPARATOR}<summary>'",
                         "reinstall kvctl; if it persists this is a bug in kvctl")
    return Topic(name, summary.strip(), markdown)


def get_topic(name: str) -> Topic:
    """The page for ``name`` (or one of its :data:`ALIASES`).

    Raises:
        UsageError: no such topic; the hint lists the topics and the closest match.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    names = topic_names()
    if key not in names:
        close = difflib.get_close_matches(key, names + sorted(ALIASES), n=1)
        guess = f"did you mean '{ALIASES.get(close[0], close[0])}'? " if close else ""
        raise UsageError(f"no help topic {name!r}",
                         f"{guess}topics: {', '.join(names)} (kvctl help lists them)")
    text = _topics_dir().joinpath(f"{key}.md").read_text(encoding="utf-8")
    return _parse(key, text)


def complete_topic(incomplete: str) -> list[str]:
    """The topic names and aliases that start with ``incomplete``, sorted (for completion)."""
    return [name for name in sorted({*topic_names(), *ALIASES}) if name.startswith(incomplete)]


def all_topics() -> list[Topic]:
    """Every topic with its summary, sorted by name."""
    return [get_topic(name) for name in topic_names()]
