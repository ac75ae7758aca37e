"""Runbook files, check results and the step registry.

A runbook is YAML::

    name: single-host
    description: what this validates
    steps:
      - check: topo-doctor          # a registered step kind
        name: host wiring           # optional display name
        required: true              # optional: fail (not skip) when it cannot run here
        fail_on: error              # step parameters, validated by the step's dataclass
      - check: bench-transfer
        transports: [shm, tcp]

Unknown step kinds, unknown parameters and bad values are errors naming the file and the step.

String values may name environment variables, so one runbook serves every cluster:
``${NAME}`` (an error naming the file, the step and the variable when it is unset or empty),
``${NAME:-default}`` (the default when unset or empty) and ``$$`` (a literal ``$``)::

    - check: bench-transfer
      peer: ${BENCH_TARGET}
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from kvctl.config import from_mapping, load_section
from kvctl.errors import ConfigError
from kvctl.yamlfile import load_yaml

P = TypeVar("P")


class Verdict(enum.StrEnum):
    """Outcome of one check."""

    PASS = "pass"  # noqa: S105 - a verdict, not a password
    FAIL = "fail"
    SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One row of the verdict table.

    Attributes:
        check: what was checked (step name, plus the configuration for sweeps).
        verdict: pass, fail or skip (a skipped check names why in ``measured``).
        measured: the measured value with its unit, for people.
        threshold: what it was held to, for people (empty when the check is pass/fail only).
        hint: how to fix a failure, or why a check was skipped.
        details: machine-readable facts for the JSON report.
        duration_s: wall time of the step that produced it, in seconds.
    """

    check: str
    verdict: Verdict
    measured: str = ""
    threshold: str = ""
    hint: str | None = None
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Artifact:
    """Something a step measured beyond its verdict rows, for reports (``--report``).

    Attributes:
        step: the step's name.
        kind: ``bench-rows`` (bench ResultRows), ``topology`` (a topo Topology) or
            ``topo-findings`` (topo doctor Findings).
        value: the object itself (not JSON: the HTML report renders it).
    """

    step: str
    kind: str
    value: Any


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What every step may use: a scratch directory, a progress callback, the kvctl config
    file in force (``--config``/``KVCTL_CONFIG``) for settings such as the token, and a place
    to leave :class:`Artifact` values for reports (:meth:`attach`)."""

    workdir: Path
    progress: Callable[[str], None] = lambda _msg: None
    config_file: Path | None = None
    attached: list[tuple[str, Any]] = dataclasses.field(default_factory=list)

    def attach(self, kind: str, value: Any) -> None:
        """Keep ``value`` (of artifact ``kind``) for the report of this run."""
        self.attached.append((kind, value))

    def settings(self, cls: type[P]) -> P:
        """Settings section ``cls`` resolved like a command's: defaults < config < env."""
        return load_section(cls, config_file=self.config_file)


@dataclasses.dataclass(frozen=True)
class StepKind(Generic[P]):
    """A registered kind of check: its parameter dataclass and the function running it."""

    name: str
    summary: str
    params: type[P]
    run: Callable[[P, RunContext], list[CheckResult]]


_STEPS: dict[str, StepKind[Any]] = {}


def register_step(
    name: str, params: type[P], summary: str
) -> Callable[[Callable[[P, RunContext], list[CheckResult]]],
              Callable[[P, RunContext], list[CheckResult]]]:
    """Decorator registering ``fn(params, ctx) -> [CheckResult]`` as step kind ``name``."""

    def decorate(
        fn: Callable[[P, RunContext], list[CheckResult]],
    ) -> Callable[[P, RunContext], list[CheckResult]]:
        _STEPS[name] = StepKind(name, summary, params, fn)
        return fn

    return decorate


def step_kinds() -> dict[str, StepKind[Any]]:
    """Every registered step kind by name."""
    from kvctl.runbook import steps, steps_keys_watch  # noqa: F401 - register the built-in kinds

    return dict(_STEPS)


@dataclasses.dataclass(frozen=True)
class Step:
    """One configured step of a runbook.

    ``required``: a check that cannot run at all (a component or server unavailable) fails
    the runbook instead of being skipped.
    """

    kind: StepKind[Any]
    name: str
    params: Any
    required: bool = False


@dataclasses.dataclass(frozen=True)
class Runbook:
    """A named sequence of steps."""

    name: str
    description: str
    steps: tuple[Step, ...]


_REFERENCE = re.compile(
    r"\$(?:\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}|(?P<dollar>\$)"
    r"|(?P<bad>\{[^}]*\}?))")


def substitute_env(data: Any, source: str, env: Mapping[str, str] | None = None) -> Any:
    """``data`` with ``${NAME}``, ``${NAME:-default}`` and ``$$`` replaced in every string.

    Only values are substituted (never keys), after YAML parsing, so a variable cannot change
    the document's structure.

    Raises:
        ConfigError: a variable without a default is unset or empty, or a reference is
            malformed; the message names ``source``, the step and the key.
    """
    environ = os.environ if env is None else env

    def walk(node: Any, where: str) -> Any:
        # where: 'description', 'step 2, peer', 'step 1, manifests item 3'
        if isinstance(node, str):
            return _REFERENCE.sub(lambda m: expand(m, where), node)
        if isinstance(node, list):
            label = "step" if where == "steps" else f"{where} item"
            return [walk(item, f"{label} {i}") for i, item in enumerate(node, start=1)]
        if isinstance(node, dict):
            return {key: walk(value, f"{where}, {key}" if where else str(key))
                    for key, value in node.items()}
        return node

    def expand(match: re.Match[str], where: str) -> str:
        if match.group("dollar"):
            return "$"
        name = match.group("name")
        if name is None:
            raise ConfigError(f"{source}: {where}: malformed variable reference "
                              f"{match.group(0)!r}",
                              "write ${NAME} or ${NAME:-default} (and $$ for a literal $)")
        value = environ.get(name, "")
        if value:
            return value
        default = match.group("default")
        if default is not None:
            return default
        raise ConfigError(f"{source}: {where}: environment variable {name} is not set",
                          f"export {name}=... before running the runbook, or write "
                          f"${{{name}:-default}} in it")

    return walk(data, "")


def parse_runbook(data: Any, source: str, env: Mapping[str, str] | None = None) -> Runbook:
    """Validate a runbook document (already parsed YAML) from ``source``.

    ``${NAME}`` references are filled from ``env`` (``os.environ`` when ``None``); see
    :func:`substitute_env`.
    """
    kinds = step_kinds()
    data = substitute_env(data, source, env)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a runbook must be a mapping with 'steps'",
                          "see examples/runbooks/single-host.yaml")
    unknown = set(data) - {"name", "description", "steps"}
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(sorted(unknown))}",
                          "a runbook has name, description and steps")
    raw_steps = data.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ConfigError(f"{source}: 'steps' must be a non-empty list",
                          "add steps like '- check: topo-doctor'")
    steps: list[Step] = []
    for index, raw in enumerate(raw_steps, start=1):
        where = f"{source}: step {index}"
        if not isinstance(raw, dict) or "check" not in raw:
            raise ConfigError(f"{where} must be a mapping with a 'check' key",
                              f"known checks: {', '.join(sorted(kinds))}")
        body = dict(raw)
        kind_name = str(body.pop("check"))
        kind = kinds.get(kind_name)
        if kind is None:
            raise ConfigError(f"{where}: unknown check {kind_name!r}",
                              f"known checks: {', '.join(sorted(kinds))}")
        name = str(body.pop("name", kind_name))
        required = body.pop("required", False)
        if not isinstance(required, bool):
            raise ConfigError(f"{where} ({kind_name}): required must be true or false, "
                              f"not {required!r}",
                              "required: true makes an unavailable check fail, not skip")
        params = from_mapping(kind.params, body, f"{where} ({kind_name})")
        steps.append(Step(kind, name, params, required))
    return Runbook(str(data.get("name", Path(source).stem)), str(data.get("description", "")),
                   tuple(steps))


def load_runbook(path: Path, env: Mapping[str, str] | None = None) -> Runbook:
    """Read and validate a runbook YAML file (``${NAME}`` filled from ``env``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read runbook {path}: {exc.strerror or exc}",
                          "check the path; examples live in examples/runbooks/") from exc
    return parse_runbook(load_yaml(text, str(path), what="runbook"), str(path), env)
