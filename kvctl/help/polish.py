"""Help text and completion as people read them, applied to the built command tree.

It imports neither Typer nor Rich: it takes the (click) command :mod:`kvctl.cli` built and
edits its help strings, placeholders and completers in place, so it is library code the CLI
calls, beside the topic pages (:mod:`kvctl.help`). The ``--profile`` completion reads the key
profiles, which puts :mod:`kvctl.help` on the library's top floor with :mod:`kvctl.keys`.

Typer shows Python types as placeholders (``--json <bool>``, ``--engine <list[str]>``) and
keeps the line breaks of the source's docstrings, so a terminal narrower than the source
breaks sentences in two. :func:`polish` walks a command once it is built and

- reflows prose paragraphs (indented example blocks and list items keep their lines);
- gives every option a placeholder people know: nothing for a flag, ``INTEGER``, ``FLOAT``,
  ``PATH``, ``TEXT``, or the choices themselves;
- attaches value completion to options whose values are a fixed vocabulary
  (:data:`COMPLETIONS`), completing the last item of a comma list.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

#: Values offered for an option, by option name; a command path (``"store status"``) in
#: :data:`COMPLETIONS_BY_COMMAND` takes precedence where one name means different things.
COMPLETIONS: dict[str, Callable[[], Iterable[str]]] = {
    "--transport": lambda: ("shm", "tcp", "rdma", "auto"),
    "--engine": lambda: ("kvctl", "mooncake", "nixl"),
    "--op": lambda: ("read", "write", "both"),
}
COMPLETIONS_BY_COMMAND: dict[tuple[str, str], Callable[[], Iterable[str]]] = {
    ("bench transfer", "--role"): lambda: ("local", "initiator", "target"),
}
#: ``--backend`` means the store's kind on every command that has it.
COMPLETIONS["--backend"] = lambda: ("kvctl", "mooncake")

_LIST_ITEM = re.compile(r"^\s*([-*•]\s|\d+[.)]\s)")


def _key_profiles() -> list[str]:
    from kvctl.keys.profiles import known_profiles

    return list(known_profiles())


def reflow(text: str | None) -> str | None:
    """``text`` with each prose paragraph on one line (paragraphs are split by blank lines).

    A paragraph keeps its line breaks when a line is indented (an example or a table) or
    starts a list item; inside a list, an item's continuation lines join the item.
    """
    if not text:
        return text
    out: list[str] = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.split("\n")
        is_list = bool(_LIST_ITEM.match(lines[0]))
        if not is_list and any(line.startswith((" ", "\t", "\b")) for line in lines):
            out.append(paragraph)  # an example block or a table: as written
            continue
        joined: list[str] = []
        for line in lines:
            if joined and not _LIST_ITEM.match(line):
                joined[-1] = f"{joined[-1].rstrip()} {line.strip()}"
            else:
                joined.append(line.rstrip())
        out.append("\n".join(joined))
    return "\n\n".join(out)


def placeholder(param: Any) -> str:
    """The placeholder for an option's value, as Unix tools spell it."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    desc = getattr(param, "type_descriptor", None)
    if desc is None:
        return "TEXT"
    if desc.is_choice:
        return "[" + "|".join(str(getattr(c, "value", c)) for c in desc.choices or ()) + "]"
    if desc.is_path or desc.is_file:
        return "PATH"
    annotation = desc.annotation
    if desc.is_list:
        annotation = next(iter(typing.get_args(annotation)), str)
    return {int: "INTEGER", float: "FLOAT"}.get(annotation, "TEXT")


COMPLETIONS["--profile"] = _key_profiles


def _completer(values: Callable[[], Iterable[str]]) -> Callable[[Any, Any, str], list[str]]:
    def complete(ctx: Any, param: Any, incomplete: str) -> list[str]:
        head, comma, last = incomplete.rpartition(",")
        prefix = head + comma
        taken = set(head.split(",")) if comma else set()
        return [prefix + value for value in values()
                if value.startswith(last) and value not in taken]

    return complete


def _quiet_help_option(cmd: Any) -> None:
    """``--help`` is a flag: show no placeholder for it either (click builds it on demand)."""
    build = cmd.get_help_option

    def get_help_option(ctx: Any) -> Any:
        option = build(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    cmd.get_help_option = get_help_option


def polish(cmd: Any, path: str = "") -> Any:
    """Apply the rules above to ``cmd`` and, for a group, to the commands it has built."""
    cmd.help = reflow(cmd.help)
    if getattr(cmd, "short_help", None):
        cmd.short_help = reflow(cmd.short_help)
    for param in getattr(cmd, "params", ()):
        if param.param_type_name == "argument":
            # An argument's name is its metavar; only the type column changes.
            shown = placeholder(param)
            param.display_type_rich = lambda ctx, shown=shown: shown
            continue
        if param.param_type_name != "option":
            continue
        if param.metavar is None:
            param.metavar = placeholder(param)
        param.help = reflow(param.help)
        name = next((opt for opt in param.opts if opt.startswith("--")), "")
        values = COMPLETIONS_BY_COMMAND.get((path, name)) or COMPLETIONS.get(name)
        if values is not None and getattr(param, "_custom_shell_complete", None) is None:
            param._custom_shell_complete = _completer(values)
    _quiet_help_option(cmd)
    commands = getattr(cmd, "commands", None)
    if isinstance(commands, dict):
        for name, sub in commands.items():
            polish(sub, f"{path} {name}".strip())
    return cmd
