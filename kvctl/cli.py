"""Root of the command line: global options, command families, errors → exit codes.

Every command module exposes a Typer sub-app (or a function) listed in :data:`FAMILIES`;
a module is imported only when its command runs, so start-up and shell completion stay
fast. Errors raised by the library are :class:`~kvctl.errors.KvctlError`;
:func:`main` turns them into ``Error:``/``Hint:`` lines and an exit code. Tracebacks are
shown only with ``KVCTL_DEBUG=1``.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from kvctl import __version__
from kvctl.argv import normalise
from kvctl.commands._common import GlobalOptions
from kvctl.config import read_config_file
from kvctl.errors import ExitCode, KvctlError, UnavailableError, UsageError
from kvctl.help.polish import polish
from kvctl.output import print_error, safe_log_lines

_HELP = """kvctl: check the KV-cache fabric of disaggregated LLM inference.

Which NIC serves which GPU, whether the fabric moves bytes at line rate, whether the cache
returns what it was given, and whether every instance names KV blocks the same way.

Example:

    kvctl topo doctor
"""


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kvctl {__version__}\n")
        raise typer.Exit(0)


def _root(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="YAML config file (also KVCTL_CONFIG).",
                     show_default=False),
    ] = None,
    verbose: Annotated[
        int, typer.Option("--verbose", "-v", count=True, help="More detail (repeatable).")
    ] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only results and errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    level = logging.WARNING
    if verbose == 1:
        level = logging.INFO
    elif verbose > 1:
        level = logging.DEBUG
    if quiet:
        level = logging.ERROR
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    safe_log_lines(logging.getLogger())  # a foreign key or host name cannot drive the terminal
    ctx.obj = options = GlobalOptions(config=config, verbose=verbose, quiet=quiet)
    # A broken config file fails every command, also those that read no setting from it.
    config_file = options.config_file()
    if config_file is not None:
        read_config_file(config_file)


@dataclasses.dataclass(frozen=True)
class Family:
    """A top-level command, imported only when it is used (or its help is shown)."""

    module: str
    attr: str
    #: The first line of its help, for ``kvctl --help`` and ``kvctl <Tab>`` without importing
    #: the module (tests/test_cli.py checks it matches the module's own help).
    summary: str


#: Every top-level command, in the order ``kvctl --help`` lists them.
FAMILIES: dict[str, Family] = {
    "runbook": Family("kvctl.commands.runbook", "runbook",
                      "Validate a host, a fabric and a cache in one run; exit 1 if any check "
                      "failed."),
    "agent": Family("kvctl.commands.agent", "agent",
                    "Register this host in the cluster and serve the jobs kvctl cluster posts."),
    "help": Family("kvctl.commands.help", "help_command",
                   "Read a manual page: what a command family or concept is for, its commands, "
                   "options, environment, exit status and examples. 'kvctl help' lists the "
                   "topics."),
    "topo": Family("kvctl.commands.topo", "app",
                   "GPU-NIC PCIe affinity: which NIC serves which GPU, and what is "
                   "misconfigured."),
    "metadata": Family("kvctl.commands.metadata", "app",
                       "kvctl's metadata server, and what is published in a metadata service."),
    "sim": Family("kvctl.commands.sim", "app", "Simulators: what a shared KV pool saves."),
    "plan": Family("kvctl.commands.plan", "app", "Planners: back-of-the-envelope answers."),
    "verify-keys": Family("kvctl.commands.verify_keys", "app",
                          "Check that every instance names KV blocks with the same keys."),
    "segment": Family("kvctl.commands.segment", "app",
                      "Transfer-engine segments: register and serve, list, show, remove."),
    "store": Family("kvctl.commands.store", "app",
                    "The embedded KV store: serve it, put/get objects, validate it."),
    "doctor": Family("kvctl.commands.doctor", "app",
                     "Environment checks: drivers, devices, engines, servers."),
    "bench": Family("kvctl.commands.bench", "app",
                    "Benchmarks: fabric throughput, latency and integrity."),
    "cluster": Family("kvctl.commands.cluster", "app",
                      "The whole cluster through its agents: hosts, fabric matrix, runbook."),
}


def _attach(app: typer.Typer, name: str) -> None:
    """Import family ``name`` and add it to ``app``: a sub-app, or a single command."""
    family = FAMILIES[name]
    target = getattr(importlib.import_module(family.module), family.attr)
    if isinstance(target, typer.Typer):
        app.add_typer(target, name=name)
    else:
        app.command(name)(target)


def _family_app(name: str) -> typer.Typer:
    """A root holding family ``name`` alone, so it builds exactly as under the full root."""
    holder = typer.Typer(add_completion=False)
    _attach(holder, name)
    holder.callback()(lambda: None)  # keeps the holder a group even with one command
    return holder


def load_family(name: str) -> Any:
    """The built (click) command of family ``name``, help polished."""
    command = typer.main.get_command(_family_app(name)).commands[name]  # type: ignore[attr-defined]
    return polish(command, name)


class _Families(MutableMapping[str, Any]):
    """The root's command table: names known up front, each command built on first use.

    While the root prints its own help (or completes a command name), entries are stand-ins
    carrying only the summary, so ``kvctl --help`` imports no command module.
    """

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}
        self.listing = False

    def __getitem__(self, name: str) -> Any:
        if name not in FAMILIES:
            raise KeyError(name)
        if name in self._built:
            return self._built[name]
        if self.listing:
            return TyperCommand(name=name, help=FAMILIES[name].summary, callback=None)
        self._built[name] = command = load_family(name)
        return command

    def __setitem__(self, name: str, command: Any) -> None:
        raise TypeError("kvctl's families are listed in kvctl.cli.FAMILIES")

    def __delitem__(self, name: str) -> None:
        raise TypeError("kvctl's families are listed in kvctl.cli.FAMILIES")

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


class _Root(TyperGroup):
    """The root group, with :class:`_Families` as its command table."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _Families()

    def _listing(self, run: Callable[[], Any]) -> Any:
        families = self.commands
        assert isinstance(families, _Families)
        families.listing = True
        try:
            return run()
        finally:
            families.listing = False

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing(lambda: super(_Root, self).format_help(ctx, formatter))

    def shell_complete(self, ctx: Any, incomplete: str) -> Any:
        return self._listing(lambda: super(_Root, self).shell_complete(ctx, incomplete))

    def _main_shell_completion(self, ctx_args: Any, prog_name: str,
                               complete_var: str | None = None) -> None:
        # Tab completion reads the command line from the environment, not from main()'s
        # args: place global options there too (kvctl store --config F status --<Tab>).
        from kvctl.argv import normalise_completion

        normalise_completion(self, os.environ)
        super()._main_shell_completion(ctx_args, prog_name, complete_var)


def _new_root(cls: type[TyperGroup] = TyperGroup) -> typer.Typer:
    app = typer.Typer(
        name="kvctl",
        help=_HELP,
        cls=cls,
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    return app


def build_app() -> typer.Typer:
    """The whole command tree as one Typer app, every module imported (for tests and tools).

    ``kvctl`` itself runs :func:`command_tree`, which imports only the command it runs.
    """
    app = _new_root()
    for name in FAMILIES:
        _attach(app, name)
    return app


@functools.cache
def command_tree() -> Any:
    """The root command as the parser runs it: families load on first use."""
    return polish(typer.main.get_command(_new_root(_Root)))


def __getattr__(name: str) -> Any:
    # ``kvctl.cli.app`` (the eager tree) is built on first access only: importing kvctl.cli
    # for ``main`` must not import every command module.
    if name == "app":
        globals()["app"] = app = build_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _usage_error_type() -> type[Exception]:
    # Typer's BadParameter derives from its usage-error class; find it through the public
    # export instead of importing click or Typer's private modules.
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == "ClickException":
            return cls
    return typer.BadParameter  # pragma: no cover


_ClickException = _usage_error_type()


def main(argv: list[str] | None = None) -> int:
    """Run kvctl with ``argv`` (``sys.argv[1:]`` when ``None``) and return the exit code."""
    args = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("KVCTL_DEBUG", "") not in ("", "0")
    try:
        # One command tree serves both: placing global options and parsing.
        tree = command_tree()
        result = tree.main(args=normalise(tree, args), prog_name="kvctl",
                           standalone_mode=False)
    except KvctlError as err:
        if debug:
            traceback.print_exc()
        print_error(err)
        return int(err.exit_code)
    except _ClickException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # help was printed: nothing went wrong
            return int(ExitCode.OK)
        message = err.format_message()  # type: ignore[attr-defined]
        ctx = getattr(err, "ctx", None)
        command = ctx.command_path if ctx is not None else "kvctl"
        print_error(UsageError(message, f"see '{command} --help' for usage and an example"))
        return int(ExitCode.USAGE)
    except typer.Abort:
        sys.stderr.write("Aborted.\n")
        return 130
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, OSError) and exc.errno in _NO_ROOM:  # a full disk is no bug
            print_error(UnavailableError(f"cannot write: {exc.strerror}",
                                         "make room where the output goes (stdout, -o)"))
            return int(ExitCode.UNAVAILABLE)
        print_error(
            KvctlError(
                f"unexpected {type(exc).__name__}: {exc}",
                "this is a bug in kvctl: rerun with KVCTL_DEBUG=1 and report the traceback",
            )
        )
        return int(ExitCode.INTERNAL)
    return result if isinstance(result, int) else 0


#: OSErrors that mean the disk (or quota) is full, not that kvctl is wrong.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
