"""Option types and helpers shared by every command module."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, TypeVar

import typer

from kvctl.config import load_section
from kvctl.errors import UsageError
from kvctl.output import Output

T = TypeVar("T")

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document (with schema_version) on stdout.")
]


@dataclasses.dataclass
class GlobalOptions:
    """What the root callback parsed: ``--config``, ``-v``, ``-q``."""

    config: Path | None = None
    verbose: int = 0
    quiet: bool = False

    def config_file(self) -> Path | None:
        """The config file in force: ``--config``, else ``KVCTL_CONFIG``, else none."""
        if self.config is None and os.environ.get("KVCTL_CONFIG"):
            return Path(os.environ["KVCTL_CONFIG"])
        return self.config

    def settings(self, cls: type[T], **flags: Any) -> T:
        """Resolve settings ``cls``: defaults < --config/KVCTL_CONFIG < KVCTL_* < ``flags``."""
        return load_section(cls, config_file=self.config_file(), flags=flags)

    def output(self, *, json_mode: bool = False) -> Output:
        """An :class:`Output` honouring ``-q``/``-v`` and ``--json``."""
        return Output(quiet=self.quiet, verbose=self.verbose, json_mode=json_mode)


def global_options(ctx: typer.Context) -> GlobalOptions:
    """The global options of this invocation (defaults when a command runs on its own)."""
    root = ctx.find_root()
    obj = root.obj
    if isinstance(obj, GlobalOptions):
        return obj
    return GlobalOptions()


def renamed_flag(opts: GlobalOptions, old: str, old_value: T | None, new: str,
                 new_value: T | None) -> T | None:
    """The value of a flag renamed from ``old`` to ``new``: the old spelling still works for
    one release, with a deprecation warning on stderr.

    Raises:
        UsageError: both spellings are given with different values.
    """
    if old_value is None:
        return new_value
    if new_value is not None and new_value != old_value:
        raise UsageError(f"{old} {old_value} and {new} {new_value} set the same thing",
                         f"give only {new}")
    opts.output().warn(f"{old} is deprecated and will be removed in the next release; "
                       f"use {new}")
    return old_value


@contextmanager
def stop_on_signal() -> Iterator[threading.Event]:
    """SIGINT and SIGTERM set the yielded event until the block ends, then the previous
    handlers return. Enter it before printing an address: whoever reads it may signal at
    once, and a signal before the handlers are in place would kill the server uncleanly."""
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def wait_until(stop: threading.Event) -> None:
    """Block until ``stop`` is set (waking twice a second so signals are handled)."""
    while not stop.wait(0.5):
        pass
