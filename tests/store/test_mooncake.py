"""The same smoke suite and put/get against a real mooncake_master on loopback."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.store.errors import ObjectNotFoundError
from tests.fixtures.cli import CliResult

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[str]:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeMaster, MooncakeUnavailableError

    try:
        master = MooncakeMaster(storage_bytes=256 << 20)
    except MooncakeUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc.cause}")
    yield master.address
    master.close()


def test_smoke_suite_against_mooncake(mooncake_master: str) -> None:
    from kvctl.store.smoke import run_mooncake

    report = run_mooncake(mooncake_master)
    status = {c.name: c.status for c in report.checks}
    assert report.failed == [], report.failed
    assert status["single"] == status["batch"] == status["exists-remove"] == "pass"


def test_adapter_distinguishes_absence(mooncake_master: str) -> None:
    from kvctl.store.mooncake import MooncakeStore

    with MooncakeStore(mooncake_master) as store:
        with pytest.raises(ObjectNotFoundError):
            store.get("mooncake-test/never")
        data = os.urandom(100_000)
        store.put("mooncake-test/a", data)
        assert store.get("mooncake-test/a") == data
        assert store.exists("mooncake-test/a")
        assert store.remove("mooncake-test/a")
        assert not store.exists("mooncake-test/a")


def test_cli_put_get_with_mooncake_backend(
        kvctl: Callable[..., CliResult], mooncake_master: str, tmp_path: Path) -> None:
    src, dst = tmp_path / "in", tmp_path / "out"
    src.write_bytes(os.urandom(70_000))
    m = ["--backend", "mooncake", "--master", mooncake_master]
    assert kvctl("store", "put", "mooncake-cli/x", str(src), *m).exit_code == 0
    r = kvctl("store", "get", "mooncake-cli/x", "-o", str(dst), *m)
    assert r.exit_code == 0, r.stderr
    assert dst.read_bytes() == src.read_bytes()
    r = kvctl("store", "get", "mooncake-cli/none", "-o", str(dst), *m)
    assert r.exit_code == 1
    assert "is not in the store" in r.stderr
