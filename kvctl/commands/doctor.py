"""``kvctl doctor``: is this environment able to run what kvctl drives?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options
from kvctl.config import CommonSettings
from kvctl.doctor.env import ComponentStatus, Status, default_checks, run_checks
from kvctl.errors import UnavailableError

app = typer.Typer(help="Environment checks: drivers, devices, engines, servers.\n\n"
                  "Example: kvctl doctor env",
                  no_args_is_help=True)

_STYLE = {Status.OK: "green", Status.UNAVAILABLE: "yellow", Status.ERROR: "red"}


@app.command("env")
def env(
    ctx: typer.Context,
    metadata: Annotated[
        list[str] | None,
        typer.Option("--metadata", "-m", help="Metadata/etcd/Redis URL to probe (repeatable); "
                     "default: the configured common.metadata when it is a server."),
    ] = None,
    require: Annotated[
        list[str] | None,
        typer.Option("--require", help="Component that must be usable (repeatable): exit 3 if "
                     "not. Names: nvml, rdma, cuda, mooncake, nixl, or a URL's scheme."),
    ] = None,
    shared_tier: Annotated[
        list[Path] | None,
        typer.Option("--shared-tier", help="A store shared-tier directory to check "
                     "(repeatable): rename atomicity, cross-host visibility through probe "
                     "files, free space, mount type."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Which optional parts are present and usable: NVML and driver, pyverbs and RDMA devices,
    CUDA, the Mooncake and NIXL packages, metadata servers, store shared tiers. Each missing
    part has a hint.

    Example: kvctl doctor env --metadata etcd://127.0.0.1:2379 --require mooncake
    Example: kvctl doctor env --shared-tier /mnt/3fs/kvctl --require shared-tier-rename
    """
    opts = global_options(ctx)
    out = opts.output(json_mode=json_out)
    urls = list(metadata or [])
    if not urls:
        configured = opts.settings(CommonSettings).metadata
        if not configured.startswith("memory://"):
            urls.append(configured)
    results = run_checks(default_checks(urls, shared_tier or ()))
    by_name = {r.name: r for r in results}
    required = list(dict.fromkeys(require or []))
    checks = [{"name": name, "status": "pass" if name in by_name and by_name[name].status
               is Status.OK else "fail", "detail": _required_detail(name, by_name)}
              for name in required]
    if json_out:
        out.emit_json("doctor.env", {"ok": all(c["status"] == "pass" for c in checks),
                                     "checks": checks, "components": results})
    else:
        table = Table(title="kvctl doctor env")
        for column in ("component", "status", "detail", "hint"):
            table.add_column(column, overflow="fold")
        for r in results:
            style = _STYLE[r.status]
            table.add_row(r.name, f"[{style}]{r.status.value}[/{style}]", r.detail, r.hint or "")
        out.print(table)
    for name in required:
        found = by_name.get(name)
        if found is None:
            raise UnavailableError(f"--require {name}: no such component was checked",
                                   f"known: {', '.join(by_name)}")
        if found.status is not Status.OK:
            raise UnavailableError(f"required component {name} is "
                                   f"{_STATE_WORDS[found.status]}: {found.detail}", found.hint)


#: How a component that is not usable is described in the error of ``--require``.
_STATE_WORDS = {Status.UNAVAILABLE: "not available", Status.ERROR: "failing"}


def _required_detail(name: str, by_name: dict[str, ComponentStatus]) -> str:
    found = by_name.get(name)
    if found is None:
        return "no such component was checked"
    if found.status is Status.OK:
        return found.detail
    return f"{_STATE_WORDS[found.status]}: {found.detail}"
