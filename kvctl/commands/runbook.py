"""``kvctl runbook``: run a sequence of checks and print one verdict table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvctl.commands._common import JsonOpt, global_options
from kvctl.errors import CheckFailedError
from kvctl.runbook.model import Verdict, load_runbook, step_kinds
from kvctl.runbook.report_html import check_report_path, write_report
from kvctl.runbook.runner import builtin_runbook, run_runbook
from kvctl.verdict import check_entry
from kvctl.wording import plural

_STYLE = {Verdict.PASS: "green", Verdict.FAIL: "bold red", Verdict.SKIP: "yellow"}


def runbook(
    ctx: typer.Context,
    file: Annotated[
        Path | None,
        typer.Argument(help="Runbook YAML; without it, the built-in single-host runbook.",
                       show_default=False),
    ] = None,
    list_checks: Annotated[
        bool, typer.Option("--list-checks", help="List the check kinds a runbook can use.")
    ] = False,
    report_file: Annotated[
        Path | None,
        typer.Option("--report", help="Also write one self-contained HTML file (verdicts, "
                     "bench plot, topo matrix, doctor findings) to forward.",
                     show_default=False),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Validate a host, a fabric and a cache in one run; exit 1 if any check failed.

    Prints one verdict table: every check with its measured value, threshold and hint.

    With no file it runs the built-in single-host runbook on embedded defaults: topo doctor,
    a short verified transfer sweep, a store smoke, a key self-check and a shared-pool
    simulation summary. More runbooks live in examples/runbooks/.

    Example: kvctl runbook examples/runbooks/single-host.yaml --json > report.json

    Example: kvctl runbook --report report.html
    """
    opts = global_options(ctx)
    out = opts.output(json_mode=json_out)
    if list_checks:
        kinds = step_kinds()
        if json_out:
            # checks: schema 1's name, a deprecated alias ("checks" is a verdict's list now).
            out.emit_json("runbook.check-kinds", {
                "kinds": [{"name": k, "summary": v.summary} for k, v in sorted(kinds.items())],
                "checks": {k: v.summary for k, v in kinds.items()}})
        else:
            table = Table(title="runbook checks")
            table.add_column("check")
            table.add_column("what it validates")
            for name, kind in sorted(kinds.items()):
                table.add_row(name, kind.summary)
            out.print(table)
        return
    book = load_runbook(file) if file is not None else builtin_runbook()
    if report_file is not None:
        check_report_path(report_file)  # before a run of a minute, not after it
    with out.progress(f"runbook {book.name}", total=len(book.steps)) as bar:
        def progress(message: str) -> None:
            if message.endswith(": running"):
                bar.update(bar.task_ids[0], description=message)
                return
            if message.endswith(": done"):  # the count moves as each step finishes
                bar.advance(bar.task_ids[0])
                return
            out.debug(message)

        report = run_runbook(book, progress=progress, config_file=opts.config_file())
    if json_out:
        checks = [check_entry(r.check, r.verdict.value, measured=r.measured,
                              threshold=r.threshold, hint=r.hint, details=r.details,
                              duration_s=r.duration_s) for r in report.results]
        # passed and results: schema 1's names, kept as deprecated aliases (docs/json.md).
        out.emit_json("runbook.report", {"runbook": report.name, "ok": report.passed,
                                         "duration_s": report.duration_s, "checks": checks,
                                         "passed": report.passed, "results": report.results})
    else:
        table = Table(title=f"runbook {report.name}: "
                      f"{'PASSED' if report.passed else 'FAILED'} in {report.duration_s:.1f} s")
        for column in ("check", "result", "measured", "threshold", "hint"):
            table.add_column(column, overflow="fold")
        for r in report.results:
            style = _STYLE[r.verdict]
            table.add_row(r.check, f"[{style}]{r.verdict.value}[/{style}]", r.measured,
                          r.threshold, r.hint or "")
        out.print(table)
    if report_file is not None:
        out.info(f"Report written to {write_report(report, report_file)}")
    if not report.passed:
        failed = [r.check for r in report.results if r.verdict is Verdict.FAIL]
        raise CheckFailedError(f"{plural(len(failed), 'check')} failed: {', '.join(failed)}",
                               "see the hint column of each failed check")
