"""What kvctl says to people: counts in the right number, errors that say what is wrong."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from kvctl.units import parse_size, parse_size_list
from kvctl.wording import plural
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[1]


def test_plural_says_one_of_a_thing() -> None:
    assert plural(1, "object") == "1 object"
    assert plural(0, "object") == "0 objects"
    assert plural(1234, "entry", "entries") == "1,234 entries"


@pytest.mark.parametrize(("text", "says"), [
    ("-4KiB", "block size '-4KiB' is negative"),
    ("4KiB,-1MiB", "block size '-1MiB' is negative"),
    ("4KiB--1MiB", "block size '-1MiB' is negative"),
    ("4KiB-", "block size range '4KiB-' has no upper end"),
    ("4XB", "block size '4XB' has an unknown unit"),
])
def test_a_bad_size_list_names_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size_list(text, what="block size")
    assert says in info.value.cause


def test_a_negative_size_is_called_negative() -> None:
    with pytest.raises(UsageError) as info:
        parse_size(" -1MiB ", what="capacity")
    assert info.value.cause == "capacity '-1MiB' is negative"


def test_bench_with_a_negative_block_size_says_so(kvctl: Kvctl) -> None:
    r = kvctl("bench", "transfer", "-b", "-4KiB")
    assert r.exit_code == 2
    assert "Error: block size '-4KiB' is negative" in r.stderr
    assert "''" not in r.stderr


@pytest.mark.parametrize("argv", [["metadata", "ls"], ["metadata", "ls", "--json"],
                                  ["metadata", "get", "kvctl/x"], ["segment", "list"]])
def test_metadata_commands_without_a_service_say_none_is_configured(
        kvctl: Kvctl, argv: list[str]) -> None:
    r = kvctl(*argv)
    assert r.exit_code == 2, r.stderr
    assert r.stdout == ""
    assert "Error: no metadata service is configured" in r.stderr
    assert "Hint:" in r.stderr
    assert "--metadata" in r.stderr


@pytest.fixture
def store_256mib() -> Iterator[EmbeddedStore]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=256 << 20)) as store:
        yield store


def test_smoke_says_why_a_large_store_skips_eviction(kvctl: Kvctl,
                                                     store_256mib: EmbeddedStore) -> None:
    r = kvctl("store", "smoke", "--master", store_256mib.address, "--json")
    assert r.exit_code == 0, r.stderr
    eviction = next(c for c in r.json()["checks"] if c["name"] == "eviction")
    assert eviction["status"] == "skip"
    assert eviction["detail"].startswith("filling a 256 MiB store past eviction takes writing "
                                         "384 MiB, over this check's 256 MiB budget")
    assert "at most 170 MiB" in eviction["detail"]


def test_store_ls_counts_one_object(kvctl: Kvctl, store_256mib: EmbeddedStore,
                                    tmp_path: Path) -> None:
    (tmp_path / "v").write_bytes(b"x")
    master = store_256mib.address
    assert kvctl("store", "put", "k1", str(tmp_path / "v"), "--master", master).exit_code == 0
    r = kvctl("store", "ls", "--master", master)
    assert r.exit_code == 0, r.stderr
    assert "1 object under" in r.stdout
    r = kvctl("store", "status", "--master", master)
    assert "1 object (" in r.stdout
    assert "1 objects" not in r.stdout


@pytest.mark.integration
def test_store_serve_first_line_is_a_sentence(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "store", "serve", "--listen", "127.0.0.1:0",
         "--capacity", "8MiB"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**env, "XDG_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert first.startswith("store up: master 127.0.0.1:"), (first, err)
    assert "8 MiB DRAM, no SSD tier; Ctrl-C stops it" in first


@pytest.mark.parametrize("argv", [["verify-keys", "profiles", "--json"],
                                  ["verify-keys", "profiles"]], ids=["json", "table"])
def test_a_full_disk_under_stdout_is_not_called_a_bug(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    with Path("/dev/full").open("w") as full:
        done = subprocess.run([sys.executable, "-m", "kvctl", *argv], cwd=REPO, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60, check=False,
                              env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 3, done.stderr
    assert "No space left on device" in done.stderr
    assert "bug" not in done.stderr
    assert "Hint:" in done.stderr


@pytest.mark.parametrize(("argv", "env", "says"), [
    (["bench", "transfer", "-d", "-1s"], {}, "Error: option --duration '-1s' is negative"),
    (["store", "serve", "--capacity", "-1MiB"], {},
     "Error: option --capacity '-1MiB' is negative"),
    (["store", "serve"], {"KVCTL_STORE_CAPACITY": "-3G"},
     "Error: environment KVCTL_STORE_CAPACITY '-3G' is negative"),
])
def test_a_bad_size_or_duration_is_named_once(kvctl: Kvctl, argv: list[str],
                                              env: dict[str, str], says: str) -> None:
    r = kvctl(*argv, env=env)
    assert r.exit_code == 2
    assert r.stderr.splitlines()[0] == says
    assert "bad value" not in r.stderr  # said once, not wrapped around itself
