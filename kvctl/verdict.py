"""Verdict documents' check entries, shared by the library and the command line.

A verdict (a runbook, ``verify-keys watch``'s checks, ``cluster runbook``) lists its checks
as entries made by :func:`check_entry`; the CLI renders them and prints them as JSON.
"""

from __future__ import annotations

from typing import Any

#: The statuses of one entry of a verdict's ``checks`` list: ``warn`` did not fail the
#: verdict but deserves a look; ``skip`` could not run here (its entry says why).
CHECK_STATUSES = ("pass", "warn", "fail", "skip")


def check_entry(name: str, status: str, **fields: Any) -> dict[str, Any]:
    """One entry of a verdict document's ``checks``: what was checked, its status (one of
    :data:`CHECK_STATUSES`), then the check's own fields. A verdict document also carries
    ``ok``: true when no check failed.

    Raises:
        ValueError: ``status`` is not one of :data:`CHECK_STATUSES`.
    """
    if status not in CHECK_STATUSES:
        raise ValueError(f"check status {status!r} is not one of {', '.join(CHECK_STATUSES)}")
    return {"name": name, "status": status, **fields}
