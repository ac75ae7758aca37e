"""Secrets stay off the command line and unauthenticated endpoints (issue 15.11)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.errors import ConfigError
from kvctl.store.tenants import inline_tenant_tokens, parse_tenants
from tests.fixtures.hosts import MakeHosts, read_json_doc, stop

TOKEN = "secret-exposure-5d1e"


def test_a_tenant_token_can_come_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "alice.token"
    token_file.write_text("alice-secret\n")
    (tenant,) = parse_tenants([f"alice=@{token_file}"])
    assert tenant.name == "alice"
    assert tenant.token == "alice-secret"
    with pytest.raises(ConfigError) as info:
        parse_tenants([f"bob=@{tmp_path / 'missing'}"])
    assert "token file of tenant 'bob'" in info.value.cause
    assert inline_tenant_tokens(["a=x", f"b=@{token_file}"]) == ["a"]


def test_an_inline_tenant_token_is_warned_about(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "store", "master", "--listen",
                             "127.0.0.1:0", "--tenant", "alice=inline-secret", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"KVCTL_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"})
    try:
        read_json_doc(proc)
    finally:
        _, err = stop(proc)
    assert b"/proc/PID/cmdline" in err
    assert b"inline-secret" not in err


@pytest.mark.integration
@pytest.mark.parametrize("token", [True, False], ids=["token", "open"])
def test_master_metrics_stay_on_loopback_with_a_token(nshosts: MakeHosts, token: bool) -> None:
    net = nshosts(2)
    env = {"KVCTL_TOKEN": TOKEN} if token else None
    master = net[0].popen(["kvctl", "store", "master", "--listen", "0.0.0.0:50051",
                           "--metrics-port", "9100", "--json"], env=env)
    read_json_doc(master)
    probe = ("import sys, urllib.request\n"
             "try:\n urllib.request.urlopen(sys.argv[1], timeout=3); print('open')\n"
             "except OSError as e: print('closed', e)")
    remote = net[1].run(["python3", "-c", probe, f"http://{net[0].address}:9100/metrics"])
    local = net[0].run(["python3", "-c", probe, "http://127.0.0.1:9100/metrics"])
    _, err = stop(master)
    assert local.stdout.startswith("open"), local.stdout
    assert remote.stdout.startswith("closed" if token else "open"), remote.stdout
    if token:
        assert b"stays on loopback" in err
