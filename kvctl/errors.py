"""The one exception root of kvctl.

Every error the library raises on purpose is a :class:`KvctlError` carrying a *cause*
(what went wrong, naming the input or source) and a *hint* (how to fix it). The command
line maps them to ``Error: <cause>`` / ``Hint: <hint>`` and to an exit code:

====  ==========================================================
0     success
1     a check failed (doctor finding, benchmark under threshold)
2     bad usage, bad input or bad configuration
3     a required component is unavailable (driver, package, server)
4     an unexpected internal error (a bug: rerun with KVCTL_DEBUG=1)
====  ==========================================================
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes shared by every kvctl command."""

    OK = 0
    CHECK_FAILED = 1
    USAGE = 2
    UNAVAILABLE = 3
    INTERNAL = 4


class KvctlError(Exception):
    """Root of every error kvctl raises on purpose.

    Args:
        cause: one sentence naming what is wrong and where (file, key, device, peer).
        hint: one sentence saying how to fix it, or ``None`` when there is nothing to add.
    """

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, cause: str, hint: str | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.hint = hint

    def __str__(self) -> str:
        return self.cause


class UsageError(KvctlError):
    """Bad arguments or bad input data (sizes, files, snapshots, manifests)."""

    exit_code = ExitCode.USAGE


class ConfigError(KvctlError):
    """A configuration value (file, environment or flag) is unknown or invalid."""

    exit_code = ExitCode.USAGE


class UnavailableError(KvctlError):
    """A required component (driver, package, device, server) is not usable here."""

    exit_code = ExitCode.UNAVAILABLE


class CheckFailedError(KvctlError):
    """A check ran and its verdict is negative (doctor error, threshold missed)."""

    exit_code = ExitCode.CHECK_FAILED


class NotFoundError(KvctlError):
    """The thing asked for does not exist (segment, key, device). Distinct from failure."""

    exit_code = ExitCode.CHECK_FAILED


class TransferError(KvctlError):
    """Base of transfer-engine failures that are not usage errors."""


class AuthError(TransferError):
    """The target refused the connection's authentication (wrong or missing token)."""
