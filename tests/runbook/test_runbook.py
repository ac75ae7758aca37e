from pathlib import Path

import pytest

from kvctl.errors import ConfigError
from kvctl.runbook.model import Verdict, load_runbook, parse_runbook
from kvctl.runbook.runner import builtin_runbook, run_runbook

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "book.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("steps: []\n", "non-empty list"),
        ("- check: topo-doctor\n", "must be a mapping"),
        ("steps:\n  - check: nosuch\n", "unknown check 'nosuch'"),
        ("steps:\n  - name: x\n", "'check' key"),
        ("steps:\n  - check: topo-doctor\n    fail_onn: error\n", "unknown key 'fail_onn'"),
        ("steps:\n  - check: sim-pool\n    sessions: many\n", "sessions"),
        ("stepz:\n  - check: topo-doctor\n", "unknown top-level"),
        ("steps: [\n", "not valid YAML"),
    ],
)
def test_bad_runbooks_name_file_and_step(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_runbook(path)
    assert needle in info.value.cause
    assert str(path) in info.value.cause
    assert info.value.hint


def test_unknown_check_hint_lists_known_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_runbook(write(tmp_path, "steps:\n  - check: nosuch\n"))
    assert "topo-doctor" in (info.value.hint or "")


def test_failing_check_fails_the_runbook_and_later_steps_still_run(tmp_path: Path) -> None:
    manifests = [str(REPO / "examples/keys/host-a.json"), str(REPO / "examples/keys/host-c.json")]
    book = parse_runbook({"steps": [
        {"check": "verify-keys", "name": "cross-host keys", "manifests": manifests},
        {"check": "verify-keys", "name": "self"},
    ]}, "test")
    report = run_runbook(book)
    assert not report.passed
    verdicts = {r.check: r.verdict for r in report.results}
    assert verdicts["cross-host keys: instances agree"] is Verdict.FAIL
    assert verdicts["self: self-check kvctl:sha256"] is Verdict.PASS
    failed = next(r for r in report.results if r.verdict is Verdict.FAIL)
    assert "PYTHONHASHSEED" in (failed.hint or "")


def test_matching_manifests_pass() -> None:
    manifests = [str(REPO / "examples/keys/host-a.json"), str(REPO / "examples/keys/host-b.json")]
    report = run_runbook(parse_runbook(
        {"steps": [{"check": "verify-keys", "manifests": manifests}]}, "test"))
    assert report.passed, report.results


def test_step_errors_become_failed_rows_not_crashes(tmp_path: Path) -> None:
    book = parse_runbook({"steps": [
        {"check": "topo-doctor", "snapshot": str(tmp_path / "missing.tar.gz")},
        {"check": "topo-doctor", "fail_on": "catastrophic"},
    ]}, "test")
    report = run_runbook(book)
    assert [r.verdict for r in report.results] == [Verdict.FAIL, Verdict.FAIL]
    assert all(r.hint for r in report.results)


def test_required_component_missing_fails_optional_skips() -> None:
    report = run_runbook(parse_runbook(
        {"steps": [{"check": "doctor-env", "require": ["cuda"]}]}, "test"))
    by_name = {r.check.split(": ")[-1]: r for r in report.results}
    assert by_name["cuda"].verdict is Verdict.FAIL  # no CUDA on test machines
    assert by_name["mooncake"].verdict is Verdict.PASS  # installed by scripts/setup
    assert not report.passed


def test_builtin_matches_the_documented_example() -> None:
    example = load_runbook(REPO / "examples/runbooks/single-host.yaml")
    builtin = builtin_runbook()
    assert [(s.kind.name, s.name, s.params) for s in example.steps] == [
        (s.kind.name, s.name, s.params) for s in builtin.steps]


def test_every_example_runbook_parses() -> None:
    books = sorted((REPO / "examples/runbooks").glob("*.yaml"))
    assert books
    # Cluster addresses come from ${VAR}s (examples/runbooks/README.md lists them).
    env = {"BENCH_TARGET": "127.0.0.1:7400", "MOONCAKE_MASTER": "127.0.0.1:50051"}
    for path in books:
        assert load_runbook(path, env).steps


def test_cli_list_checks(kvctl) -> None:
    result = kvctl("runbook", "--list-checks", "--json")
    assert result.exit_code == 0
    doc = result.json()
    kinds = {k["name"]: k["summary"] for k in doc["kinds"]}
    assert {"topo-doctor", "verify-keys", "sim-pool", "doctor-env"} <= set(kinds)
    assert doc["checks"] == kinds  # schema 1's name, a deprecated alias


def test_cli_failing_runbook_exits_1_with_json_report(kvctl, tmp_path: Path) -> None:
    path = write(tmp_path, "name: t\nsteps:\n  - check: doctor-env\n    require: [cuda]\n")
    result = kvctl("runbook", str(path), "--json")
    assert result.exit_code == 1
    doc = result.json()
    assert doc["kind"] == "runbook.report"
    assert doc["ok"] is doc["passed"] is False
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["doctor-env: cuda"] == "fail"
    assert {"name", "status", "measured", "threshold", "hint"} <= set(doc["checks"][0])
    assert {"check", "verdict", "measured", "threshold", "hint"} <= set(doc["results"][0])
    assert "Error:" in result.stderr


def test_cli_bad_runbook_exits_2(kvctl, tmp_path: Path) -> None:
    result = kvctl("runbook", str(write(tmp_path, "steps:\n  - check: nosuch\n")))
    assert result.exit_code == 2
    assert "Hint:" in result.stderr


def test_steps_see_the_config_file_in_force(tmp_path: Path) -> None:
    from kvctl.config import CommonSettings
    from kvctl.runbook.model import RunContext

    cfg = tmp_path / "kvctl.yaml"
    cfg.write_text("common:\n  token: from-file\n")
    assert RunContext(tmp_path, config_file=cfg).settings(CommonSettings).token == "from-file"
    assert RunContext(tmp_path).settings(CommonSettings).token is None
