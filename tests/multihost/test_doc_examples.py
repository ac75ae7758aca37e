"""The operator guide's multi-host examples, run as written on namespaced hosts.

Each example runs without a token and with the same ``KVCTL_TOKEN`` on every host; the
only change to a documented command is the host's address (:mod:`tests.fixtures.docexamples`).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from typing import Any

import pytest

from tests.fixtures.docexamples import load_example, run_example
from tests.fixtures.hosts import MakeHosts
from tests.fixtures.nshosts import REPO, HostNet

GUIDE = REPO / "docs" / "operator-guide.md"
TOKEN = "doc-example-secret-7f3a"

pytestmark = pytest.mark.integration


def _env(net: HostNet, token: bool, **extra: str) -> dict[int, dict[str, str]]:
    base = {"KVCTL_TOKEN": TOKEN} if token else {}
    return {h.index: {**base, **extra} for h in net}


def _rows(stdout: str) -> dict[str, dict[str, Any]]:
    return {r["check"]: r for r in json.loads(stdout)["results"]}


def _runbook_json(steps: list[Any]) -> list[Any]:
    """The example's runbook line, with --json so the test can read the verdicts."""
    last = steps[-1]
    assert "kvctl runbook" in last.command
    return [*steps[:-1], type(last)(last.host, last.command + " --json", last.background)]


def _assert_cross_host(stdout: str, target: HostNet) -> None:
    found = _rows(stdout)
    transfer = {n: r for n, r in found.items() if n.startswith("cross-host transfer: ")}
    assert sorted(transfer) == [f"cross-host transfer: kvctl {op} tcp {size} x32"
                                for op in ("read", "write") for size in ("1 MiB", "64 KiB")]
    for row in transfer.values():
        assert row["verdict"] == "pass", row
        assert row["measured"].endswith(", verified")
        assert row["details"]["errors"] == 0
        assert f"->{target[0].address}:" in row["details"]["path"], row  # host A, not loopback


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_two_hosts(nshosts: MakeHosts, token: bool) -> None:
    net = nshosts(2)
    run = run_example(_runbook_json(load_example(GUIDE, "two-hosts")), net,
                      env=_env(net, token))
    _assert_cross_host(run.last().stdout, net)


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_two_hosts_through_etcd(nshosts: MakeHosts, token: bool) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    net = nshosts(3)
    run = run_example(_runbook_json(load_example(GUIDE, "two-hosts-etcd")), net,
                      env=_env(net, token))
    _assert_cross_host(run.last().stdout, net)


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_metadata_server_on_one_host_used_by_the_others(nshosts: MakeHosts,
                                                        token: bool) -> None:
    net = nshosts(3)
    run = run_example(load_example(GUIDE, "metadata-serve"), net, env=_env(net, token))
    (_, show), (_, bench) = run.results
    assert f"{net[1].address}:" in show.stdout  # B's address, as published on A
    assert "127.0.0.1" not in show.stdout
    assert "verified" in bench.stdout or "ok" in bench.stdout, bench.stdout


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_store_across_three_hosts(nshosts: MakeHosts, token: bool, transport: str) -> None:
    net = nshosts(3)
    run = run_example(load_example(GUIDE, "store-three-hosts"), net,
                      env=_env(net, token, KVCTL_STORE_TRANSPORT=transport))
    results = [done for _, done in run.results]
    got = net[1].tmp / "prompts.jsonl"
    assert got.read_bytes() == (REPO / "examples" / "keys" / "prompts.jsonl").read_bytes()
    status = results[2].stdout
    assert "of 512 MiB" in status, status  # both nodes, 256 MiB each
    assert "failover" in results[3].stdout  # the smoke ran its checks (and exited 0)


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_store_standby_takes_over_across_three_hosts(nshosts: MakeHosts, token: bool) -> None:
    """docs/store.md "Standby masters", as written; then the leader on A is SIGKILLed and
    the object is read back through B, the standby that took over."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    net = nshosts(3)
    env = _env(net, token)
    run = run_example(load_example(STORE, "store-standby"), net, env=env)
    status = run.last().stdout
    assert f"master {net[0].address}:50051" in status, status  # A leads, B stands by
    leader = next(proc for step, proc in run.servers
                  if step.host == 0 and "store master" in step.command)
    leader.kill()
    leader.wait(10)
    both = f"{net[0].address}:50051,{net[1].address}:50051"
    deadline = time.monotonic() + 60
    while True:  # the node re-registers with the new leader a moment after it leads
        done = net[2].run(["kvctl", "store", "get", "doc/prompts", "-o", "/tmp/got.jsonl",
                           "--master", both], env=env[2], timeout=60)
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.returncode == 0, done.stderr
    got = net[2].tmp / "got.jsonl"
    assert got.read_bytes() == (REPO / "examples" / "keys" / "prompts.jsonl").read_bytes()
    status = net[2].run(["kvctl", "store", "status", "--master", both], env=env[2],
                        timeout=60).stdout
    assert f"master {net[1].address}:50051" in status, status


STORE = REPO / "docs" / "store.md"


def test_every_marked_example_is_tested() -> None:
    marked = set()
    for doc in [*REPO.glob("docs/*.md"), *REPO.glob("examples/**/*.md"), REPO / "README.md"]:
        marked |= set(re.findall(r"<!--\s*example:\s*([\w.-]+)\s*-->", doc.read_text()))
    tested = {"two-hosts", "two-hosts-etcd", "metadata-serve", "store-three-hosts",
              "bench-two-hosts", "bench-two-hosts-etcd", "bench-foreign-two-hosts",
              "store-standby",
              "keys-watch-two-hosts"}  # tests/multihost/test_doc_example_keys_watch.py
    assert marked <= tested, marked - tested


BENCH = REPO / "docs" / "bench.md"


def _bench_rows(stdout: str, target: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(stdout)["rows"]
    assert rows
    for row in rows:
        assert row["errors"] == 0
        assert row["verified"]
        assert re.search(rf"->\s*{re.escape(target)}(:|\s|$)", row["path"]), row
    return rows


def _json_last(steps: list[Any]) -> list[Any]:
    last = steps[-1]
    return [*steps[:-1], type(last)(last.host, last.command + " --json", last.background)]


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_bench_two_hosts_by_address(nshosts: MakeHosts, token: bool) -> None:
    net = nshosts(2)
    run = run_example(_json_last(load_example(BENCH, "bench-two-hosts")), net,
                      env=_env(net, token))
    rows = _bench_rows(run.last().stdout, net[0].address)
    assert {r["transport"] for r in rows} == {"tcp"}  # rdma: skipped with its reason here
    assert "rdma" in json.dumps(json.loads(run.last().stdout)["skipped"])


def test_bench_two_hosts_through_etcd(nshosts: MakeHosts) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    net = nshosts(3)
    run = run_example(_json_last(load_example(BENCH, "bench-two-hosts-etcd")), net,
                      env=_env(net, True))
    _bench_rows(run.last().stdout, net[0].address)


def test_the_runbook_readme_shows_the_tested_two_host_commands() -> None:
    """examples/runbooks/README.md repeats the guide's two-host commands: each line there is
    a line of one of the guide's tested examples."""
    readme = (REPO / "examples" / "runbooks" / "README.md").read_text()
    section = readme[readme.index("## `two-hosts.yaml`"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.group(1).splitlines()]
    tested = {s.command for name in ("two-hosts", "two-hosts-etcd")
              for s in load_example(GUIDE, name)}
    shown = [line for line in lines if line and not line.startswith("#")]
    assert shown
    assert set(shown) <= tested, set(shown) - tested


@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_bench_three_engines_across_two_hosts(nshosts: MakeHosts, token: bool) -> None:
    pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")
    net = nshosts(2)
    run = run_example(_json_last(load_example(BENCH, "bench-foreign-two-hosts")), net,
                      env=_env(net, token), server_deadline_s=60)
    doc = json.loads(run.last().stdout)
    engines = {r["engine"] for r in doc["rows"]}
    skipped = {s["engine"] for s in doc["skipped"]}
    assert {"kvctl", "mooncake"} <= engines
    assert engines | skipped >= {"kvctl", "mooncake", "nixl"}
    _bench_rows(run.last().stdout, net[0].address)
