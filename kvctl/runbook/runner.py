"""Run a runbook's steps in order and collect one verdict table."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from kvctl.errors import KvctlError, UnavailableError
from kvctl.runbook.model import (
    Artifact,
    CheckResult,
    Runbook,
    RunContext,
    Verdict,
    parse_runbook,
)
from kvctl.yamlfile import load_yaml

_log = logging.getLogger("kvctl.runbook")

BUILTIN = "single-host"


@dataclasses.dataclass(frozen=True)
class RunbookReport:
    """Everything a runbook run found.

    Attributes:
        name: the runbook's name.
        results: one row per check, in run order.
        passed: no check failed (skips do not fail a runbook).
        duration_s: wall time of the whole run, in seconds.
        artifacts: what steps measured beyond their rows (bench rows, topology, findings).
    """

    name: str
    results: tuple[CheckResult, ...]
    passed: bool
    duration_s: float
    artifacts: tuple[Artifact, ...] = ()


def builtin_runbook(name: str = BUILTIN) -> Runbook:
    """A runbook shipped inside the package (``single-host``: embedded defaults, one host)."""
    text = resources.files("kvctl.runbook").joinpath("builtin", f"{name}.yaml").read_text()
    return parse_runbook(load_yaml(text, name, what="built-in runbook"),
                         f"built-in runbook {name}")


def run_runbook(runbook: Runbook, *, progress: Callable[[str], None] | None = None,
                workdir: Path | None = None, config_file: Path | None = None
                ) -> RunbookReport:
    """Run every step. A step raising a kvctl error becomes a failed check (an unavailable
    component a skipped one, with its hint, or a failed one when the step is ``required``);
    no step can stop the ones after it."""
    notify = progress or (lambda _msg: None)
    started = time.perf_counter()
    results: list[CheckResult] = []
    artifacts: list[Artifact] = []
    with tempfile.TemporaryDirectory(prefix="kvctl-runbook-") as tmp:
        ctx = RunContext(workdir=workdir or Path(tmp), progress=notify,
                         config_file=config_file)
        for step in runbook.steps:
            notify(f"{step.name}: running")
            t0 = time.perf_counter()
            try:
                rows = step.kind.run(step.params, ctx)
            except UnavailableError as exc:
                verdict = Verdict.FAIL if step.required else Verdict.SKIP
                rows = [CheckResult("", verdict, f"unavailable: {exc.cause}",
                                    "required" if step.required else "", hint=exc.hint)]
            except KvctlError as exc:
                rows = [CheckResult("", Verdict.FAIL, exc.cause, hint=exc.hint)]
            elapsed = time.perf_counter() - t0
            artifacts += [Artifact(step.name, kind, value) for kind, value in ctx.attached]
            ctx.attached.clear()
            for row in rows:
                name = f"{step.name}: {row.check}" if row.check else step.name
                results.append(dataclasses.replace(row, check=name, duration_s=elapsed))
            _log.info("%s finished in %.1f s", step.name, elapsed)
            notify(f"{step.name}: done")
    passed = all(r.verdict is not Verdict.FAIL for r in results)
    return RunbookReport(runbook.name, tuple(results), passed, time.perf_counter() - started,
                         tuple(artifacts))
