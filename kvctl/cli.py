"""Root of the command line: global options, command families, errors → exit codes.

Every command module exposes a Typer sub-app (or a function) registered in
:func:`build_app`. Errors raised by the library are :class:`~kvctl.errors.KvctlError`;
:func:`main` turns them into ``Error:``/``Hint:`` lines and an exit code. Tracebacks are
shown only with ``KVCTL_DEBUG=1``.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from kvctl import __version__
from kvctl.argv import normalise
from kvctl.commands._common import GlobalOptions
from kvctl.config import read_config_file
from kvctl.errors import ExitCode, KvctlError, UsageError
from kvctl.output import print_error

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
    ctx.obj = options = GlobalOptions(config=config, verbose=verbose, quiet=quiet)
    # A broken config file fails every command, also those that read no setting from it.
    config_file = options.config_file()
    if config_file is not None:
        read_config_file(config_file)


def build_app() -> typer.Typer:
    """Assemble the root app from the command modules."""
    app = typer.Typer(
        name="kvctl",
        help=_HELP,
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    _register_commands(app)
    return app


def _register_commands(app: typer.Typer) -> None:
    # One line per command family; each module owns its sub-app.
    from kvctl.commands import metadata, plan, sim, topo

    app.add_typer(topo.app, name="topo")
    app.add_typer(metadata.app, name="metadata")
    app.add_typer(sim.app, name="sim")
    app.add_typer(plan.app, name="plan")
    from kvctl.commands import verify_keys

    app.add_typer(verify_keys.app, name="verify-keys")
    from kvctl.commands import segment

    app.add_typer(segment.app, name="segment")
    from kvctl.commands import store

    app.add_typer(store.app, name="store")
    from kvctl.commands import doctor

    app.add_typer(doctor.app, name="doctor")
    from kvctl.commands import runbook

    app.command("runbook")(runbook.runbook)
    from kvctl.commands import bench

    app.add_typer(bench.app, name="bench")
    from kvctl.commands import agent, cluster

    app.add_typer(cluster.app, name="cluster")
    app.command("agent")(agent.agent)
    from kvctl.commands import help as help_topics

    app.command("help")(help_topics.help_command)


app = build_app()


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
        tree = typer.main.get_command(app)
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
        print_error(
            KvctlError(
                f"unexpected {type(exc).__name__}: {exc}",
                "this is a bug in kvctl: rerun with KVCTL_DEBUG=1 and report the traceback",
            )
        )
        return int(ExitCode.INTERNAL)
    return result if isinstance(result, int) else 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
