"""Every ``kvctl ...`` command the docs, examples and hints show is accepted by the parser.

Commands come from README.md, docs/*.md, examples/**/*.md, examples/runbooks/*.sh and
*.yaml comments, the help topics, and the string literals of kvctl/ (hints, examples in
help texts). Each is parsed against the real command tree, the way :func:`kvctl.cli.main`
sees it (global flags placed by :func:`kvctl.argv.normalise`), and never run: it must
resolve to a command, use only options that command has, give each option a value, and
give typed options (numbers, choices) a value of their type. Values in the docs' own
placeholder style (``FILE``, ``HOST:PORT``, ``...``, ``$VAR``) are accepted as any value;
paths need not exist. Shell syntax is taken apart first: ``\\`` continuations, ``$ ``
prompts, comments, ``A=b`` prefixes, ``&&``/``;``/``|``/``&`` lists, redirections;
lines with command substitution are skipped.

Run ``python -m tests.test_doc_commands`` for the list of rejected commands.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from kvctl.argv import normalise
from kvctl.cli import app

REPO = Path(__file__).resolve().parents[1]

#: Doc commands the parser rejects today ("file: command" → why). The docs belong to their
#: authors: a fix there makes the entry XPASS (strict), and then it leaves this list.
KNOWN_REJECTED: dict[str, str] = {}

_SHELL_OPS = {"|", "||", "&&", ";", "&", ";;"}
_REDIRECT = re.compile(r"(?<=\s)\d*(?:>>?|<)&?\s*[^\s|;&]+")  # > f, >> f, 2>&1, < f
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PLACEHOLDER = re.compile(
    r"^(\.\.\.|.*\.\.\..*|<[^>]+>|\$.*|[A-Z][A-Z0-9_]*(?:[:.,/-][A-Za-z0-9_]+)*)$")


def _click_exception() -> type[Exception]:
    # Parser errors derive from this class; reach it through Typer's public export.
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == "ClickException":
            return cls
    return typer.BadParameter  # pragma: no cover


ClickException = _click_exception()


@dataclasses.dataclass(frozen=True)
class DocCommand:
    where: str  # path:line
    text: str  # as written, after joining continuations
    args: tuple[str, ...]  # after "kvctl"

    @property
    def command(self) -> str:
        return shlex.join(["kvctl", *self.args])

    @property
    def key(self) -> str:
        """``file: command``, the form of :data:`KNOWN_REJECTED` (no line: lines move)."""
        return f"{self.where.rpartition(':')[0]}: {self.command}"


# ------------------------------------------------------------------ shell → argv


def split_commands(line: str) -> Iterator[list[str]]:
    """The argv (after ``kvctl``) of each kvctl command in one shell line."""
    line = line.strip().removeprefix("$ ")
    if "$(" in line or "`" in line:
        return  # command substitution: not worth a shell here
    # Synopses: [--opt V] optional, a|b (no spaces: a pipe has them) and (A | B) choices.
    line = re.sub(r"(?<=\S)\|[^\s)\]]+", "", line)
    if re.search(r"[\[(]", line):
        line = line.replace("[", "").replace("]", "")
        line = re.sub(r"\(([^()|]*)\|[^()]*\)", r"\1", line)
    line = re.sub(r"<([A-Za-z][\w.-]*)>", lambda m: m[1].upper(), line)  # <name>: NAME
    line = _REDIRECT.sub("", line)
    for part in re.split(r"\s{2,}(?=kvctl\s)", line):  # synopses set two side by side
        yield from _shell_list(part)


def _shell_list(line: str) -> Iterator[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a command line
        return
    words: list[str] = []
    for token in [*tokens, ";"]:
        if token in _SHELL_OPS:
            argv = _kvctl_argv(words)
            if argv is not None:
                yield argv
            words = []
        else:
            words.append(token)


def _kvctl_argv(words: list[str]) -> list[str] | None:
    while words and (_ASSIGNMENT.match(words[0]) or words[0] in ("exec", "time", "sudo")):
        words = words[1:]
    if not words or not (words[0] == "kvctl" or words[0].endswith("/kvctl")):
        return None
    return [word for word in words[1:] if word != "$@"]  # $@: "more arguments" in a script


# ------------------------------------------------------------------ where commands are


def _continued(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, line) with ``\\`` continuations joined."""
    pending, start = "", 0
    for number, line in enumerate(lines, 1):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


_SPAN = re.compile(r"(?<!`)`(kvctl [^`]+)`(?!`)")
_STARTS = re.compile(r"^\s*(?:\$ )?(?:[A-Za-z_][A-Za-z0-9_]*=\S+\s+)*(?:\S*/)?kvctl\s")


def markdown_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Command lines of a markdown file: in code blocks (only ``$ `` lines where a block
    uses prompts, the rest being output) and in inline code spans."""
    lines = path.read_text(encoding="utf-8").splitlines()
    block: list[tuple[int, str]] | None = None
    for number, line in _continued(lines):
        if line.lstrip().startswith("```"):
            if block is not None:
                prompts = any(text.lstrip().startswith("$ ") for _, text in block)
                for at, text in block:
                    if _STARTS.match(text) and (not prompts or text.lstrip().startswith("$ ")):
                        yield at, text
                block = None
            else:
                block = []
            continue
        if block is not None:
            block.append((number, line))
            continue
        if line.startswith("    ") and _STARTS.match(line):  # an indented code block
            yield number, line
        for span in _SPAN.findall(line):
            yield number, span


def script_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Commands of a shell script, and those its comments (and a YAML file's) show."""
    for number, line in _continued(path.read_text(encoding="utf-8").splitlines()):
        text = line.strip()
        if text.startswith("#"):
            text = text.lstrip("#").strip()
            yield from ((number, quoted) for quoted in re.findall(r"'(kvctl [^']+)'", text))
            yield from ((number, span) for span in _SPAN.findall(text))
        if _STARTS.match(text) or text.startswith("exec kvctl "):
            yield number, text


_IN_STRING = [
    re.compile(r"'(kvctl [^']+)'"),  # hints quote the command to run
    _SPAN,
    re.compile(r"Example:\s*(kvctl [^\n]+)"),  # help texts
    re.compile(r"(?m)^ {4,}(kvctl [^\n]+)$"),  # an indented example in a help text
    re.compile(r"\b(?:by|run|rerun|try)\s+(kvctl [a-z][^,;'()\n]*)"),  # unquoted in prose
    re.compile(r"^(kvctl [a-z][^:\n]*)$"),  # a hint that is a command line and nothing else
]
#: Strings that name kvctl but are no command: titles and process names.
_NOT_COMMANDS = {"name", "title"}


def _names_no_command(node: ast.AST) -> bool:
    """``title=...``, ``name=...`` or ``title = ...``: a label, even when it reads kvctl."""
    if isinstance(node, ast.keyword):
        return node.arg in _NOT_COMMANDS
    return isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id in _NOT_COMMANDS for t in node.targets)


def code_lines(path: Path) -> Iterator[tuple[int, str]]:
    """kvctl commands suggested by the string literals of a module (hints, help texts);
    an f-string's fields read as the placeholder VALUE."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in node.values)
        elif _names_no_command(node):
            skip.add(id(node.value))  # type: ignore[attr-defined]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(part.value if isinstance(part, ast.Constant) else "VALUE"
                           for part in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        found: set[str] = set()
        for pattern in _IN_STRING:
            found.update(m.strip().rstrip(".") for m in pattern.findall(text))
        yield from ((node.lineno, command) for command in sorted(found))


def sources() -> Iterator[tuple[Path, Iterator[tuple[int, str]]]]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "examples").rglob("*.md")),
            *sorted((REPO / "kvctl" / "help" / "topics").glob("*.md"))]
    for path in docs:
        yield path, markdown_lines(path)
    for path in sorted((REPO / "examples").rglob("*.sh")) + sorted(
            (REPO / "examples").rglob("*.yaml")):
        yield path, script_lines(path)
    for path in sorted((REPO / "kvctl").rglob("*.py")):
        yield path, code_lines(path)


def doc_commands() -> list[DocCommand]:
    seen: set[tuple[str, tuple[str, ...]]] = set()
    found: list[DocCommand] = []
    for path, lines in sources():
        rel = str(path.relative_to(REPO))
        for number, line in lines:
            for argv in split_commands(line):
                if (rel, tuple(argv)) not in seen:
                    seen.add((rel, tuple(argv)))
                    found.append(DocCommand(f"{rel}:{number}", line.strip(), tuple(argv)))
    return found


# ------------------------------------------------------------------ the parser's verdict


def _value_error(param: Any, ctx: Any, value: Any) -> str | None:
    """Why ``value`` is not of ``param``'s type (Typer's own coercion; paths need not exist)."""
    values = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(one, str) and _PLACEHOLDER.match(one) for one in values):
        return None
    try:
        param.get_runtime_param().coerce(value, param=param, ctx=ctx)
    except ClickException as err:
        return err.format_message()  # type: ignore[attr-defined,no-any-return]
    return None


@functools.cache
def _tree() -> Any:
    return typer.main.get_command(app)


def rejection(args: list[str]) -> str | None:
    """Why the parser rejects ``kvctl ARGS`` (None: accepted), without running anything."""
    tree = _tree()
    args = normalise(tree, args)
    cmd, name, parent = tree, "kvctl", None
    while True:
        ctx = cmd.context_class(cmd, info_name=name, parent=parent, **cmd.context_settings)
        try:
            values, rest, order = cmd.make_parser(ctx).parse_args(list(args))
        except ClickException as err:
            return f"{ctx.command_path}: {err.format_message()}"  # type: ignore[attr-defined]
        for param in order:
            if param.name in values and (error := _value_error(param, ctx, values[param.name])):
                return f"{ctx.command_path}: {error}"
        commands = getattr(cmd, "commands", None)
        if commands is None:
            rest = [arg for arg in rest if arg != "..."]  # "and more": elided arguments
            return f"{ctx.command_path}: unexpected extra arguments {rest}" if rest else None
        if not rest or _PLACEHOLDER.match(rest[0]):
            return None  # a command family (`kvctl store`) or `kvctl COMMAND ...`
        name, *args = rest
        if name not in commands:
            return f"{ctx.command_path}: no such command {name!r}"
        cmd, parent = commands[name], ctx


COMMANDS = doc_commands()


def test_the_docs_show_many_commands() -> None:
    assert len(COMMANDS) > 150
    assert any(c.where.startswith("kvctl/") for c in COMMANDS)  # the hints too
    assert any(c.where.endswith(".sh:8") for c in COMMANDS)  # a joined continuation


def test_the_known_rejections_are_still_in_the_docs() -> None:
    keys = {c.key for c in COMMANDS}
    assert not [known for known in KNOWN_REJECTED if known not in keys]


def _params() -> list[Any]:
    params = []
    for c in COMMANDS:
        marks = []
        if c.key in KNOWN_REJECTED:
            marks.append(pytest.mark.xfail(reason=KNOWN_REJECTED[c.key], strict=True))
        params.append(pytest.param(c, id=f"{c.where} {c.command}", marks=marks))
    return params


@pytest.mark.parametrize("doc", _params())
def test_doc_command_is_accepted(doc: DocCommand) -> None:
    assert rejection(list(doc.args)) is None, (
        f"{doc.where}: {doc.text}\n  parser: {rejection(list(doc.args))}")


@pytest.mark.parametrize(("line", "rejected"), [
    ("kvctl topo --format mooncake", False),
    ("$ kvctl store serve &", False),
    ("kvctl store status -q", False),  # a global flag after the command
    ("kvctl --json sim pool", False),
    ("kvctl topo --frmo x", True),
    ("kvctl store stauts", True),
    ("kvctl bench transfer --engine", True),  # no value
    ("kvctl bench transfer --iterations many", True),  # not a number
    ("kvctl bench transfer --iterations N", False),  # a placeholder
    ("kvctl topo snapshot a.tgz b.tgz", True),
])
def test_the_checker_itself(line: str, rejected: bool) -> None:
    [argv] = split_commands(line)
    assert (rejection(argv) is not None) == rejected, rejection(argv)


def test_shell_syntax_is_taken_apart() -> None:
    line = ("A=1 B=2 kvctl store put k f.bin && kvctl store get k -o o.bin 2>&1 | tee x; "
            "kvctl runbook r.yaml --json > report.json")
    assert list(split_commands(line)) == [
        ["store", "put", "k", "f.bin"], ["store", "get", "k", "-o", "o.bin"],
        ["runbook", "r.yaml", "--json"]]
    assert list(split_commands("kvctl verify-keys [--backend kvctl|mooncake] [--json]")) == [
        ["verify-keys", "--backend", "kvctl", "--json"]]
    assert not list(split_commands("kvctl store get $(kvctl store ls | head -1)"))


if __name__ == "__main__":  # python -m tests.test_doc_commands: the rejected ones
    for c in COMMANDS:
        why = rejection(list(c.args))
        if why is not None:
            known = " (known)" if c.key in KNOWN_REJECTED else ""
            print(f"{c.where}: {c.command}{known}\n    {why}")
