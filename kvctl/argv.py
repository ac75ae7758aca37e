"""Global options anywhere on the command line, as users type them.

The parser knows ``-v``/``-q``/``--config`` only on the root (before the command) and
``--json`` only on each command (after it). :func:`normalise` moves the first kind to the
front and the second after the command, walking the real command tree so that option
values and everything after ``--`` stay where they are, and an option a command defines
itself keeps that command's meaning.
"""

from __future__ import annotations

from typing import Any

from kvctl.errors import UsageError

#: Root options that may also follow the command.
GLOBAL_OPTIONS = frozenset({"-v", "--verbose", "-q", "--quiet", "-c", "--config"})


def _option(cmd: Any, name: str) -> Any | None:
    """The option of ``cmd`` spelled ``name`` (``--x``, ``--no-x``, ``-x``), if any."""
    for param in cmd.params:
        if param.param_type_name == "option" and name in (*param.opts, *param.secondary_opts):
            return param
    return None


def _takes_value(param: Any) -> bool:
    return not (param.is_flag or param.count)


def _extent(cmd: Any, arg: str) -> int:
    """How many following tokens the option ``arg`` of ``cmd`` consumes as its value."""
    if arg.startswith("--"):
        param = _option(cmd, arg.partition("=")[0])
        return param.nargs if param is not None and _takes_value(param) and "=" not in arg else 0
    for at in range(1, len(arg)):  # -x, -xVALUE or a cluster of short flags -xyz
        param = _option(cmd, "-" + arg[at])
        if param is not None and _takes_value(param):
            return param.nargs if at == len(arg) - 1 else 0
    return 0


def _is_global(root: Any, cmd: Any, arg: str) -> bool:
    """Whether ``arg`` (``-vv``, ``--config=F``) is made of root options ``cmd`` lacks."""
    if arg.startswith("--"):
        names = [arg.partition("=")[0]]
    elif (first := _option(root, arg[:2])) is not None and _takes_value(first):
        names = [arg[:2]]  # -cFILE
    else:
        names = ["-" + char for char in arg[1:]]
    return all(name in GLOBAL_OPTIONS and _option(cmd, name) is None for name in names)


def normalise(root: Any, args: list[str]) -> list[str]:
    """``args`` with global options before the command path and ``--json`` after it.

    ``root`` is the command tree (``typer.main.get_command(app)``). Tokens the walk cannot
    place (an unknown command, a ``--json`` the command lacks) stay put for the parser to
    reject as usual.
    """
    cmd, path_start, leaf_at = root, None, None
    moved: list[int] = []  # indices of global options (and values) after the command path
    json_at: list[int] = []  # indices of --json before the command that owns it
    i = 0
    while i < len(args) and args[i] != "--":
        arg = args[i]
        if arg.startswith("-") and arg != "-":
            if cmd is not root and _is_global(root, cmd, arg):
                width = 1 + _extent(root, arg)
                if i + width > len(args) or "--" in args[i + 1:i + width]:
                    # Moved to the front without it, it would take the command as its value.
                    raise UsageError(f"option '{arg}' requires a value",
                                     f"give it one: {arg} FILE (see 'kvctl --help')")
                moved.extend(range(i, min(i + width, len(args))))
            else:
                width = 1 + _extent(cmd, arg)
                if arg == "--json" and _option(cmd, arg) is None:
                    json_at.append(i)
            i += width
            continue
        commands = getattr(cmd, "commands", None)
        if commands and arg not in commands:
            break  # not a command of this group: the parser says so
        if commands:
            cmd, leaf_at = commands[arg], i
            path_start = i if path_start is None else path_start
        i += 1
    if leaf_at is None or _option(cmd, "--json") is None:
        json_at = []
    out: list[str] = []
    for index, arg in enumerate(args):
        if index == path_start:
            out.extend(args[at] for at in moved)
        if index not in moved and index not in json_at:
            out.append(arg)
        if index == leaf_at:
            out.extend("--json" for _ in json_at)
    return out


def normalise_completion(root: Any, environ: dict[str, str] | Any) -> None:
    """The words a shell's Tab completion hands kvctl (in ``environ``), with global options
    placed as :func:`normalise` places them, so ``kvctl store --config F status --<Tab>``
    completes ``status``'s options as the command would parse them. Only the words before
    the one being completed move; words the walk cannot place stay as they are.

    Bash passes ``COMP_WORDS`` (all words) and ``COMP_CWORD`` (the index of the one being
    completed); zsh, fish and PowerShell pass ``_TYPER_COMPLETE_ARGS`` (the line so far) and,
    fish and PowerShell, ``_TYPER_COMPLETE_WORD_TO_COMPLETE``.
    """
    import shlex

    def placed(before: list[str]) -> list[str]:
        try:
            return normalise(root, before)
        except UsageError:  # e.g. --config still waiting for its value: leave it
            return before

    try:
        if "COMP_WORDS" in environ and "COMP_CWORD" in environ:
            words = shlex.split(environ["COMP_WORDS"])
            cword = int(environ["COMP_CWORD"])
            if not 1 <= cword <= len(words):
                return
            before = placed(words[1:cword])
            environ["COMP_WORDS"] = shlex.join([words[0], *before, *words[cword:]])
            environ["COMP_CWORD"] = str(1 + len(before))
            return
        line = environ.get("_TYPER_COMPLETE_ARGS")
        if not line:
            return
        words = shlex.split(line)
        if "_TYPER_COMPLETE_WORD_TO_COMPLETE" in environ:
            tail = 1 if environ["_TYPER_COMPLETE_WORD_TO_COMPLETE"] else 0
        else:
            tail = 0 if line.endswith(" ") else 1
        if len(words) <= tail:
            return
        cut = len(words) - tail
        before = placed(words[1:cut])
        environ["_TYPER_COMPLETE_ARGS"] = shlex.join([words[0], *before, *words[cut:]]) + (
            " " if line.endswith(" ") else "")
    except ValueError:  # unbalanced quotes mid-typing: complete from the words as they are
        return
