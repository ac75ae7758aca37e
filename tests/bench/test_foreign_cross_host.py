"""Mooncake and NIXL across namespaced hosts, beside kvctl's engine, and NIXL's exit code.

h1 runs ``--role target`` for all three engines at once; h2's initiator finds each foreign
target through the target's metadata server and runs the same verified sweep through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvctl.bench.engines import driver_class
from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host

pytestmark = pytest.mark.integration

TOKEN = "foreign-cross-host-5e2a"
SWEEP = ["-t", "tcp", "-b", "64KiB,1MiB", "-n", "16"]
ALL = ["--engine", "kvctl", "--engine", "mooncake", "--engine", "nixl"]
FOREIGN = ["--engine", "mooncake", "--engine", "nixl"]


def _require(*engines: str) -> None:
    for engine in engines:
        reason = driver_class(engine).unavailable_reason()
        if reason is not None:
            pytest.skip(f"{engine} unavailable: {reason}")


def _target(host: Host, engines: list[str], *, port: int = 7400,
            env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = host.popen(["kvctl", "bench", "transfer", "--role", "target", "--listen",
                       f"0.0.0.0:{port}", *engines, *SWEEP, "--json"], env=env)
    return proc, read_json_doc(proc, timeout_s=60)


def _initiator(host: Host, peer: str, engines: list[str], *, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return host.run(["kvctl", "bench", "transfer", "--role", "initiator", "--peer", peer,
                     *engines, *SWEEP, "-i", "3", "--warmup", "1", "--verify", "--json"],
                    env=env, timeout=timeout)


def test_three_engines_across_hosts_with_a_token(nshosts: MakeHosts) -> None:
    _require("mooncake", "nixl")
    net = nshosts(2)
    env = {"KVCTL_TOKEN": TOKEN}
    proc, info = _target(net[0], ALL, env=env)
    try:
        assert info["engines"] == ["kvctl", "mooncake", "nixl"]
        assert {(t["engine"], t["host"]) for t in info["foreign"]} == {
            ("mooncake", net[0].address), ("nixl", net[0].address)}
        done = _initiator(net[1], info["peer"], ALL, env=env)
    finally:
        stop(proc)
    assert done.returncode == 0, done.stderr[-4000:]  # NIXL ran, kvctl still exits 0
    doc = json.loads(done.stdout)
    rows = doc["rows"]
    assert [r["engine"] for r in rows] == ["kvctl"] * 4 + ["mooncake"] * 4 + ["nixl"] * 4
    assert doc["baseline_engine"] == "kvctl"
    for row in rows:
        assert row["verified"] is True, row
        assert row["errors"] == 0, row
        assert row["throughput_gbytes_per_s"] > 0, row
        assert net[0].address in row["path"], row
        assert "127.0.0.1" not in row["path"], row
        if row["engine"] != "kvctl":
            assert row["ratio_vs_baseline"] is not None
    assert {r["transport"] for r in rows if r["engine"] == "mooncake"} == {"tcp"}
    assert {r["transport"] for r in rows if r["engine"] == "nixl"} == {"ucx-tcp"}


def test_a_token_on_one_side_only_is_a_clear_auth_error(nshosts: MakeHosts) -> None:
    _require("mooncake", "nixl")
    net = nshosts(2)
    guarded, info = _target(net[0], FOREIGN, port=7400, env={"KVCTL_TOKEN": TOKEN})
    open_, open_info = _target(net[0], FOREIGN, port=7401)
    try:
        assert info["address"] is None  # no kvctl engine: the metadata server alone
        cases = [(info["peer"], None, "refused the request"),
                 (open_info["peer"], {"KVCTL_TOKEN": TOKEN}, "is not signed")]
        for peer, env, expected in cases:
            started = time.monotonic()
            done = _initiator(net[1], peer, FOREIGN, env=env, timeout=60)
            assert time.monotonic() - started < 30
            assert done.returncode not in (0, 139), done.stderr[-3000:]
            assert expected in done.stderr, done.stderr[-3000:]
            assert "Hint:" in done.stderr
    finally:
        stop(guarded)
        stop(open_)


def test_nixl_from_the_console_script_exits_zero() -> None:
    _require("nixl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    kvctl = Path(sys.executable).parent / "kvctl"
    done = subprocess.run([str(kvctl), "bench", "transfer", "--engine", "nixl", "-t", "tcp",
                           "-b", "16KiB", "-n", "8", "-i", "3", "--warmup", "1", "--verify",
                           "--json"], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    rows = json.loads(done.stdout)["rows"]
    assert [(r["engine"], r["op"]) for r in rows] == [("nixl", "read"), ("nixl", "write")]
    assert all(r["verified"] and r["errors"] == 0 for r in rows)
