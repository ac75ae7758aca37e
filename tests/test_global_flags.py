"""Global flags anywhere: -v/-q/--config before or after the command, --json before it.

The ``kvctl`` fixture calls :func:`kvctl.cli.main`, so these runs go through the argv
normalisation (:mod:`kvctl.argv`) exactly as the console script does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import pytest
import typer

from kvctl.argv import normalise
from kvctl.cli import app
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = str(REPO / "examples" / "hosts" / "h100-8gpu.tar.gz")
KEYS_RUNBOOK = str(REPO / "examples" / "runbooks" / "key-consistency.yaml")
MANIFESTS = [str(REPO / "examples" / "keys" / f"host-{x}.json") for x in "ab"]

#: Commands that run in-process in well under a second and need no server or hardware.
FAST = {
    "topo": ["topo", "--from", SNAPSHOT],
    "topo doctor": ["topo", "doctor", "--from", SNAPSHOT],
    "verify-keys": ["verify-keys", "--block-size", "32"],
    "verify-keys profiles": ["verify-keys", "profiles"],
    "verify-keys compare": ["verify-keys", "compare", *MANIFESTS],
    "sim pool": ["sim", "pool", "--sessions", "4", "--instances", "2", "--seed", "3"],
    "doctor env": ["doctor", "env"],
}


def both_ways(flags: list[str], command: list[str]) -> tuple[list[str], list[str]]:
    return [*flags, *command], [*command, *flags]


# ------------------------------------------------------------------ the rewrite itself


@pytest.mark.parametrize(("typed", "parsed"), [
    ("bench transfer --verify -v", "-v bench transfer --verify"),
    ("runbook x.yaml -v", "-v runbook x.yaml"),
    ("--json store status", "store status --json"),
    ("store --json status -vv -q", "-vv -q store status --json"),
    ("topo --from x.tgz --config=a.yaml", "--config=a.yaml topo --from x.tgz"),
    ("topo doctor -c a.yaml --verbose --quiet", "-c a.yaml --verbose --quiet topo doctor"),
    ("topo doctor -ca.yaml", "-ca.yaml topo doctor"),
    ("topo -vc a.yaml --json", "-vc a.yaml topo --json"),
    ("verify-keys compare a.json b.json -vq", "-vq verify-keys compare a.json b.json"),
    ("--json verify-keys emit -o m.json", "verify-keys emit --json -o m.json"),
    # Later options win in the parser, so a --config after the command stays the later one.
    ("-c a.yaml topo -c b.yaml", "-c a.yaml -c b.yaml topo"),
    # Already in place: untouched.
    ("-v -c a.yaml store status --json", "-v -c a.yaml store status --json"),
    # Values of options are never moved, nor is anything after --.
    ("store status --master -v", "store status --master -v"),
    ("bench transfer -n -q -d -c", "bench transfer -n -q -d -c"),
    ("verify-keys compare a.json -- -v --json", "verify-keys compare a.json -- -v --json"),
    # What the walk cannot place stays for the parser to reject as usual.
    ("--json frobnicate -v", "--json frobnicate -v"),
    ("--json store", "--json store"),
    ("--json", "--json"),
    # ("topo --config": a missing value is an error, tests/reliability/test_cli_global_options.py)
    # Help still works wherever the global flags are.
    ("bench transfer --help -v", "-v bench transfer --help"),
])
def test_normalise_on_the_real_command_tree(typed: str, parsed: str) -> None:
    assert normalise(typer.main.get_command(app), typed.split()) == parsed.split()


def _app_with_own_short_options() -> typer.Typer:
    """A root with -v/-c/-q and a leaf that defines -c and -v itself, with other meanings."""
    demo = typer.Typer()

    @demo.callback()
    def root(
        config: Annotated[str | None, typer.Option("--config", "-c")] = None,
        verbose: Annotated[int, typer.Option("--verbose", "-v", count=True)] = 0,
        quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    ) -> None:
        pass

    @demo.command()
    def leaf(
        count: Annotated[int, typer.Option("--count", "-c")] = 1,
        version: Annotated[bool, typer.Option("--show-version", "-v")] = False,
        json_out: Annotated[bool, typer.Option("--json")] = False,
    ) -> None:
        pass

    @demo.command()
    def other() -> None:
        pass

    return demo


@pytest.mark.parametrize(("typed", "parsed"), [
    ("leaf -c 3 -v -q", "-q leaf -c 3 -v"),  # -c and -v are the leaf's own
    ("leaf --config f.yaml --verbose", "--config f.yaml --verbose leaf"),  # long names: root's
    ("leaf -vq", "leaf -vq"),  # a cluster holding a leaf option is the leaf's
    ("--json leaf", "leaf --json"),
    ("--json other", "--json other"),  # other has no --json: the parser's error stays
])
def test_a_leaf_option_with_a_global_name_keeps_its_meaning(typed: str, parsed: str) -> None:
    tree = typer.main.get_command(_app_with_own_short_options())
    assert normalise(tree, typed.split()) == parsed.split()


# ------------------------------------------------------------------ through kvctl


@pytest.mark.parametrize("name", sorted(FAST))
def test_json_before_or_after_the_command_gives_the_same_document(
    kvctl: Kvctl, name: str
) -> None:
    before, after = both_ways(["--json"], FAST[name])
    first, second = kvctl(*before), kvctl(*after)
    assert first.exit_code == second.exit_code, (first.stderr, second.stderr)
    if name == "doctor env":  # probes take different times; the findings are the same
        assert [c["name"] for c in first.json()["components"]] == [
            c["name"] for c in second.json()["components"]]
    else:
        assert first.json() == second.json()
    assert first.json()["schema_version"] == 2


def test_json_on_a_group_leaves_the_usual_error(kvctl: Kvctl) -> None:
    result = kvctl("--json", "store")
    assert result.exit_code == 2
    assert "No such option: --json" in result.stderr


@pytest.mark.parametrize("flag", ["--config", "-c", "--config="])
@pytest.mark.parametrize("name", ["topo", "verify-keys", "sim pool", "doctor env"])
def test_a_bad_config_file_fails_the_same_before_or_after(
    kvctl: Kvctl, tmp_path: Path, flag: str, name: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nosuchsection:\n  a: 1\n")
    flags = [flag + str(bad)] if flag.endswith("=") else [flag, str(bad)]
    results = [kvctl(*args) for args in both_ways(flags, FAST[name])]
    for result in results:
        assert result.exit_code == 2, result.stderr
        assert "nosuchsection" in result.stderr
        assert "No such option" not in result.stderr
    assert results[0].stderr == results[1].stderr


@pytest.mark.parametrize("flag", ["--config", "-c"])
def test_a_config_file_after_the_command_is_read(
    kvctl: Kvctl, tmp_path: Path, flag: str
) -> None:
    config = tmp_path / "kvctl.yaml"
    config.write_text("store:\n  master: 127.0.0.1:1\n")  # nothing listens on port 1
    for args in both_ways([flag, str(config)], ["store", "status", "--json"]):
        result = kvctl(*args)
        assert result.exit_code == 3, result.stderr
        assert "127.0.0.1:1" in result.stderr


@pytest.mark.parametrize("flags", [["-v"], ["--verbose"], ["-vv"], ["-v", "-v"]])
def test_verbose_before_or_after_the_command_shows_progress(
    kvctl: Kvctl, flags: list[str]
) -> None:
    assert "INFO kvctl.runbook" not in kvctl("runbook", KEYS_RUNBOOK).stderr
    for args in both_ways(flags, ["runbook", KEYS_RUNBOOK]):
        result = kvctl(*args)
        assert result.exit_code == 0, result.stderr
        assert "INFO kvctl.runbook: scheme finished" in result.stderr


@pytest.mark.parametrize("flag", ["-q", "--quiet"])
def test_quiet_before_or_after_the_command_hides_status_lines(
    kvctl: Kvctl, tmp_path: Path, flag: str
) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "pool.png"
    command = [*FAST["sim pool"], "--plot", str(plot)]
    loud = kvctl(*command)
    assert loud.exit_code == 0, loud.stderr
    assert f"wrote {plot}" in loud.stderr
    for args in both_ways([flag], command):
        plot.unlink()
        result = kvctl(*args)
        assert result.exit_code == 0, result.stderr
        assert "wrote" not in result.stderr
        assert plot.exists()
        assert result.stdout == loud.stdout  # the results themselves stay


def test_bench_transfer_takes_verbose_after_its_options(kvctl: Kvctl) -> None:
    result = kvctl("bench", "transfer", "--transport", "shm", "-b", "4KiB", "-n", "4",
                   "--iterations", "2", "--warmup", "0", "--verify", "-v")
    assert result.exit_code == 0, result.stderr
    assert "INFO kvctl.bench" in result.stderr


def test_a_value_that_looks_like_a_flag_stays_a_value(kvctl: Kvctl) -> None:
    result = kvctl("store", "status", "--master", "-v")
    assert result.exit_code == 2
    assert "store master address '-v'" in result.stderr
    result = kvctl("verify-keys", "compare", "--", "-v")
    assert result.exit_code == 2
    assert "cannot read manifest -v" in result.stderr


def test_help_still_works_with_global_flags(kvctl: Kvctl) -> None:
    for args in (["bench", "transfer", "--help"], ["bench", "transfer", "--help", "-v"],
                 ["-q", "bench", "transfer", "--help"]):
        result = kvctl(*args)
        assert result.exit_code == 0, result.stderr
        assert "kvctl bench transfer" in result.stdout
    root = kvctl("--help").stdout
    for option in ("--config", "-c", "--verbose", "-v", "--quiet", "-q"):
        assert option in root
