"""Hostile checks of the command line: global options after the command, missing values."""

from __future__ import annotations

import pytest

from kvctl import cli


@pytest.mark.parametrize(("args", "option"), [
    (["store", "status", "--json", "-vv", "--config"], "--config"),
    (["store", "status", "-c"], "-c"),
    (["bench", "transfer", "--config", "--", "x"], "--config"),
])
def test_a_global_option_after_the_command_without_its_value_says_so(
        args: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Moved to the front, a valueless --config took the command's name as its value and
    the parser answered "No such command 'status'"."""
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"Error: option '{option}' requires a value" in err
    assert "Hint: " in err
    assert "No such command" not in err


def test_normalise_refuses_a_trailing_global_option_with_no_value() -> None:
    import typer

    from kvctl.argv import normalise
    from kvctl.errors import UsageError

    with pytest.raises(UsageError, match="'--config' requires a value"):
        normalise(typer.main.get_command(cli.app), ["topo", "--config"])
