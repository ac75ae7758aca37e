"""``kvctl metadata serve|ls|get``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.metadata import open_metadata
from tests.fixtures.cli import CliResult
from tests.fixtures.servers import free_port
from tests.metadata._util import REPO, read_line

Kvctl = Callable[..., CliResult]


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    return subprocess.Popen([sys.executable, "-m", "kvctl", "metadata", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**clean, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO)


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    return proc.returncode, err


@pytest.fixture
def served() -> Iterator[str]:
    """URL of a ``kvctl metadata serve`` subprocess (port from the environment setting)."""
    proc = _serve(env={"KVCTL_METADATA_LISTEN": "127.0.0.1:0"})
    try:
        url = read_line(proc, 20.0)
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        if proc.poll() is None:
            code, err = _stop(proc)
            assert code == 0, err


@pytest.mark.integration
def test_serve_prints_its_url_and_ls_get_read_it(served: str, kvctl: Kvctl) -> None:
    with open_metadata(served) as c:
        c.put("kvctl/segments/host-a", b'{"addr": "10.0.0.1:7000"}')
        c.put("kvctl/segments/bin", b"\xff\x00")
        c.put("kvctl/other/x", b"1")
    r = kvctl("metadata", "ls", "kvctl/segments/", "--metadata", served, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["kind"] == "metadata.ls"
    assert doc["schema_version"] == 2
    assert [e["key"] for e in doc["entries"]] == ["kvctl/segments/bin", "kvctl/segments/host-a"]
    assert doc["entries"][0]["value"] is None
    assert doc["entries"][0]["value_base64"] == "/wA="
    assert doc["entries"][1]["size_bytes"] == 25

    r = kvctl("metadata", "ls", env={"KVCTL_METADATA": served})
    assert r.exit_code == 0
    assert "kvctl/other/x" in r.stdout
    assert "<binary>" in r.stdout

    r = kvctl("metadata", "get", "kvctl/segments/host-a", "-m", served)
    assert r.exit_code == 0
    assert r.stdout.strip() == '{"addr": "10.0.0.1:7000"}'
    r = kvctl("metadata", "get", "kvctl/segments/bin", "-m", served, "--json")
    assert r.exit_code == 0
    assert r.json()["value_base64"] == "/wA="


@pytest.mark.integration
def test_ls_defaults_to_the_cluster_prefix(served: str, kvctl: Kvctl) -> None:
    with open_metadata(served) as c:
        c.put("kvctl/blue/a", b"1")
        c.put("kvctl/green/a", b"2")
    r = kvctl("metadata", "ls", "--json", env={"KVCTL_METADATA": served,
                                               "KVCTL_CLUSTER_ID": "blue"})
    assert r.exit_code == 0
    assert r.json()["prefix"] == "kvctl/blue/"
    assert [e["key"] for e in r.json()["entries"]] == ["kvctl/blue/a"]


@pytest.mark.integration
def test_serve_with_token_refuses_unsigned_clients(kvctl: Kvctl, tmp_path: Path) -> None:
    proc = _serve("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "state"),
                  env={"KVCTL_TOKEN": "tok-123"})
    try:
        url = read_line(proc, 20.0)
        r = kvctl("metadata", "ls", "-m", url)
        assert r.exit_code == 3
        assert "Error:" in r.stderr
        assert "Hint:" in r.stderr
        assert "KVCTL_TOKEN" in r.stderr
        r = kvctl("metadata", "ls", "-m", url, env={"KVCTL_TOKEN": "tok-123"})
        assert r.exit_code == 0, r.stderr
    finally:
        code, err = _stop(proc)
    assert code == 0
    assert "tok-123" not in err
    assert (tmp_path / "state" / "entries").is_dir()  # --data-dir was used


def test_get_absent_key_exits_1(kvctl: Kvctl, tmp_path: Path) -> None:
    r = kvctl("metadata", "get", "kvctl/nope", "-m", f"file://{tmp_path}")
    assert r.exit_code == 1
    assert "Error:" in r.stderr
    assert "kvctl metadata ls" in r.stderr


def test_file_backend_through_the_cli(kvctl: Kvctl, tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c:
        c.put("kvctl/a", b"hello")
    r = kvctl("metadata", "get", "kvctl/a", env={"KVCTL_METADATA": f"file://{tmp_path}"})
    assert r.exit_code == 0
    assert r.stdout.strip() == "hello"


@pytest.mark.parametrize("args", [
    ("metadata", "ls", "-m", "http://127.0.0.1:notaport"),
    ("metadata", "ls", "-m", "zk://127.0.0.1:2181"),
    ("metadata", "get", "kvctl/a", "-m", "etcd://"),
    ("metadata", "serve", "--listen", "127.0.0.1:notaport"),
    ("metadata", "serve", "--listen", "127.0.0.1:70000"),
])
def test_bad_input_exits_2_with_error_and_hint(kvctl: Kvctl, args: tuple[str, ...]) -> None:
    r = kvctl(*args)
    assert r.exit_code == 2, r.stderr
    assert r.stderr.startswith("Error: ")
    assert "\nHint: " in r.stderr


def test_bad_setting_in_environment_exits_2(kvctl: Kvctl) -> None:
    r = kvctl("metadata", "ls", env={"KVCTL_METADATA_TIMEOUT_S": "soon"})
    assert r.exit_code == 2
    assert "KVCTL_METADATA_TIMEOUT_S" in r.stderr


def test_serve_on_a_busy_port_exits_2(kvctl: Kvctl) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = kvctl("metadata", "serve", "--listen", f"127.0.0.1:{port}")
    assert r.exit_code == 2
    assert str(port) in r.stderr
    assert "Hint:" in r.stderr


def test_unreachable_service_exits_3(kvctl: Kvctl) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = kvctl("metadata", "ls", "-m", url)
    assert r.exit_code == 3
    assert url in r.stderr
    assert "kvctl metadata serve" in r.stderr


def test_help_has_examples(kvctl: Kvctl) -> None:
    for command in ("serve", "ls", "get"):
        r = kvctl("metadata", command, "--help")
        assert r.exit_code == 0
        assert "Example:" in r.stdout


@pytest.mark.integration
def test_serve_json_reports_the_url() -> None:
    proc = _serve("--listen", "127.0.0.1:0", "--json")
    try:
        lines = [read_line(proc, 20.0)]
        while lines[-1] != "}":
            lines.append(read_line(proc, 5.0))
        doc = json.loads("\n".join(lines))
        assert doc["kind"] == "metadata.serve"
        assert doc["auth"] is False
        with open_metadata(doc["url"]) as c:
            assert c.list("kvctl/") == {}
    finally:
        code, _ = _stop(proc)
    assert code == 0
