import re
import subprocess
import sys

import pytest
import typer

import kvctl.cli
from kvctl import __version__
from kvctl.errors import UnavailableError
from tests.fixtures.cli import CliResult


def test_version(kvctl) -> None:
    result: CliResult = kvctl("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvctl {__version__}"


def test_no_arguments_prints_help_and_succeeds(kvctl) -> None:
    result = kvctl()
    assert result.exit_code == 0
    assert "Usage" in result.stdout
    assert "Error" not in result.stderr


def test_unknown_option_is_usage_error_with_hint(kvctl) -> None:
    result = kvctl("--no-such-flag")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: No such option")
    assert "Hint: see 'kvctl --help'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_command_is_usage_error(kvctl) -> None:
    result = kvctl("frobnicate")
    assert result.exit_code == 2
    assert "Error:" in result.stderr
    assert "Hint:" in result.stderr


def _app_raising(exc: BaseException) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def boom() -> None:
        raise exc

    @app.command()
    def other() -> None:
        pass

    return app


def _patch_tree(monkeypatch: pytest.MonkeyPatch, app: typer.Typer) -> None:
    monkeypatch.setattr(kvctl_module(), "command_tree", lambda: typer.main.get_command(app))


def test_library_errors_map_to_error_hint_and_exit_code(
    kvctl, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_tree(monkeypatch, _app_raising(
        UnavailableError("NVML unavailable: driver not loaded", "install the NVIDIA driver")))
    result = kvctl("boom")
    assert result.exit_code == 3
    assert result.stderr == (
        "Error: NVML unavailable: driver not loaded\nHint: install the NVIDIA driver\n"
    )


def test_unexpected_errors_hide_the_traceback_unless_debug(
    kvctl, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_tree(monkeypatch, _app_raising(ZeroDivisionError("oops")))
    result = kvctl("boom")
    assert result.exit_code == 4
    assert "Error: unexpected ZeroDivisionError: oops" in result.stderr
    assert "KVCTL_DEBUG=1" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(ZeroDivisionError):
        kvctl("boom", env={"KVCTL_DEBUG": "1"})


def test_bad_config_file_fails_before_work(kvctl, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nosuchsection:\n  a: 1\n")
    result = kvctl("--config", str(bad), "topo", "--json")
    assert result.exit_code == 2
    assert "nosuchsection" in result.stderr
    assert "Hint:" in result.stderr


def test_every_command_has_an_example_in_its_help(kvctl) -> None:
    missing = []
    for path in _command_paths(kvctl_module().app):
        result = kvctl(*path, "--help")
        assert result.exit_code == 0, path
        if "Example" not in result.stdout:
            missing.append(" ".join(path))
        python_types = re.findall(r"<(?:bool|str|int|float|path|list\[\w+\])>", result.stdout)
        assert not python_types, (path, python_types)
    assert not missing, f"commands without an example in --help: {missing}"


def test_console_script_runs_as_a_process() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvctl", "--version"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0
    assert __version__ in proc.stdout


def kvctl_module():
    return kvctl.cli


def _command_paths(app: typer.Typer, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for info in app.registered_commands:
        name = info.name or (info.callback.__name__.replace("_", "-") if info.callback else "")
        paths.append((*prefix, name))
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub is None or group.name is None:
            continue
        paths.append((*prefix, group.name))
        paths.extend(_command_paths(sub, (*prefix, group.name)))
    return paths
