"""Five namespaced hosts with agents, etcd on the first: ls, the matrix, the diagnosis, a
host that dies mid-run.

Every link is shaped (``tc tbf``) so the numbers are the links' and not the shared CPUs':
50 Mbit/s each, and one host at a quarter of that where the test plants a slow host.

The five-host scenario is one test (its steps are the functions below, in order): one
cluster of five agents is worth setting up once, and pytest-xdist would set up a module
fixture once per worker.
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from typing import Any

import pytest

from tests.cluster.conftest import MakeCluster
from tests.cluster.nscluster import DOC, ETCD, SWEEP, TTL_S, NsCluster, bench_json

pytestmark = pytest.mark.integration

FAST, SLOW = 50, 12.5  # Mbit/s: 6.25 and 1.56 MB/s, far below what the shared CPUs move


def test_five_hosts_ls_matrix_diagnosis_and_a_host_killed_mid_bench(
        ns_cluster: MakeCluster) -> None:
    five = ns_cluster(5)
    ls_shows_the_five_hosts(five)
    equal_links_fill_the_matrix_and_name_nobody(five)
    a_quarter_rate_host_is_named_and_only_it(five)
    an_agent_killed_mid_bench_is_reported_missing_within_its_ttl(five)


def _pairs(doc: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    return {tuple(sorted((p["a"], p["b"]))): p for p in doc["pairs"]}


def ls_shows_the_five_hosts(five: NsCluster) -> None:
    done = five.kvctl(0, ["cluster", "ls", "--json"])
    assert done.returncode == 0, done.stderr
    hosts = json.loads(done.stdout)["hosts"]
    assert [h["host"] for h in hosts] == ["h1", "h2", "h3", "h4", "h5"]
    for h, host in zip(hosts, five.net, strict=True):
        assert h["state"] == "live"
        assert not h["version_skew"]
        record = h["record"]
        assert record["address"] == host.address  # routable, never loopback
        assert [n["name"] for n in record["nics"]] == ["eth0"]
        assert record["rails"] == [{"index": 0, "nic": "eth0", "address": host.address}]
        assert "tcp" in record["transports"]
        assert set(record["jobs"]) >= {"target", "bench", "runbook", "store-node"}
    table = five.kvctl(0, ["cluster", "ls"])
    assert "5 host(s) registered" in table.stdout


def equal_links_fill_the_matrix_and_name_nobody(five: NsCluster) -> None:
    five.shape(dict.fromkeys(range(5), FAST))
    doc = bench_json(five.kvctl(0, ["cluster", "bench", *SWEEP, "--json"]))
    values = [(p["a"], p["b"], p["gbytes_per_s"]) for p in doc["pairs"]]
    # Names nobody. On a loaded machine a single pair may still dip below 70% of the
    # median (then the run says so and exits 1); no host can own most of such pairs.
    assert doc["diagnosis"]["culprits"] == [], values
    assert doc["exit_code"] == (1 if doc["diagnosis"]["slow"] else 0), doc["stderr"]
    assert len(doc["diagnosis"]["slow"]) <= 1, values
    pairs = _pairs(doc)
    assert len(pairs) == 10
    for pair in pairs.values():
        assert pair["state"] == "ok", pair
        assert pair["verified"] is True
        rows = pair["rows"]
        assert {r["op"] for r in rows} == {"read", "write"}
        assert all(r["errors"] == 0 and r["verified"] for r in rows)
        assert 0.003 < pair["gbytes_per_s"] < 0.008, pair  # 50 Mbit/s is 0.00625 GB/s
    (matrix,) = doc["matrices"]
    cells = matrix["gbytes_per_s"]
    assert all(cells[i][j] is not None for i in range(5) for j in range(5) if i != j)
    assert doc["schedule"] == {"mode": "rounds", "rounds": 5, "pairs": 10, "sampled": False,
                               "max_concurrency": 2}


def a_quarter_rate_host_is_named_and_only_it(five: NsCluster) -> None:
    five.shape({i: SLOW if i == 2 else FAST for i in range(5)})
    try:
        done = five.kvctl(0, ["cluster", "bench", *SWEEP, "--json"])
    finally:
        five.shape(dict.fromkeys(range(5), FAST))
    doc = bench_json(done)
    assert doc["exit_code"] == 1, doc["stderr"]
    assert "likely culprit h3" in doc["stderr"]
    diagnosis = doc["diagnosis"]
    (culprit,) = diagnosis["culprits"]
    assert culprit["subject"] == "h3"
    assert culprit["slow_pairs"] == culprit["measured_pairs"] == 4
    evidence = culprit["row"] + culprit["column"]
    assert sorted(e["peer"] for e in evidence) == ["h1", "h2", "h4", "h5"]
    assert all(e["slow"] and e["gbytes_per_s"] < 0.003 for e in evidence)
    assert {tuple(sorted((s["a"], s["b"]))) for s in diagnosis["slow"]} == {
        tuple(sorted(("h3", h))) for h in ("h1", "h2", "h4", "h5")}
    assert all(p["verified"] for p in doc["pairs"])


TOKEN = "cluster-secret-5e1d"
SECURE = "secure"  # a second cluster in the same etcd, run with a token


def test_with_a_token_an_agent_without_it_cannot_register_nor_a_client_schedule(
        ns_cluster: MakeCluster) -> None:
    hosts = ns_cluster(4, agents=[])
    hosts.shape(dict.fromkeys(range(4), FAST))
    with_token = {"KVCTL_TOKEN": TOKEN, "KVCTL_CLUSTER_ID": SECURE}
    for index in (0, 1):
        hosts.start_agent(index, env={"KVCTL_TOKEN": TOKEN}, cluster=SECURE)
    try:
        intruder = hosts.host(2).run([*five_agent(hosts), "--json"],
                                    env={"KVCTL_CLUSTER_ID": SECURE}, timeout=60)
        assert intruder.returncode == 2, intruder.stderr
        assert "requires the shared token" in intruder.stderr
        assert "Hint:" in intruder.stderr
        listed = hosts.kvctl(0, ["cluster", "ls", "--json"], env=with_token)
        assert [h["host"] for h in json.loads(listed.stdout)["hosts"]] == ["h1", "h2"]

        started = time.monotonic()
        refused = hosts.kvctl(3, ["cluster", "bench", *SWEEP],
                             env={"KVCTL_CLUSTER_ID": SECURE})
        assert refused.returncode == 2, refused.stderr
        assert "KVCTL_TOKEN" in refused.stderr
        assert time.monotonic() - started < 20
        wrong = hosts.kvctl(3, ["cluster", "bench", *SWEEP],
                           env={"KVCTL_CLUSTER_ID": SECURE, "KVCTL_TOKEN": "not-it"})
        assert wrong.returncode == 2
        assert "another token" in wrong.stderr
        jobs = hosts.kvctl(0, ["metadata", "ls", f"kvctl/{SECURE}/cluster/jobs/", "--json"])
        assert jobs.returncode == 0, jobs.stderr
        assert json.loads(jobs.stdout)["entries"] == []  # nothing was ever scheduled

        doc = bench_json(hosts.kvctl(3, ["cluster", "bench", *SWEEP, "--json"], env=with_token))
        assert doc["exit_code"] == 0, doc["stderr"]
        (pair,) = doc["pairs"]
        assert pair["state"] == "ok"
        assert pair["verified"]
    finally:
        for index in (0, 1):
            hosts.stop_agent(index, cluster=SECURE)


def five_agent(five: NsCluster) -> list[str]:
    from tests.cluster.nscluster import AGENT, doc_line

    return doc_line(AGENT, five.net)


def _wait_for_line(proc: subprocess.Popen[bytes], needle: bytes, timeout_s: float) -> bytes:
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and needle not in seen:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if ready:
            chunk = proc.stderr.read1(65536)  # type: ignore[attr-defined]
            if not chunk:
                break
            seen += chunk
    assert needle in seen, seen[-3000:]
    return seen


def an_agent_killed_mid_bench_is_reported_missing_within_its_ttl(five: NsCluster
                                                                       ) -> None:
    five.shape(dict.fromkeys(range(5), FAST))
    bench = five.host(0).popen(["kvctl", "cluster", "bench", *SWEEP, "--json", "-v",
                                "--metadata", five.url])
    try:
        early = _wait_for_line(bench, b" GB/s", timeout_s=60)  # the first pair is done
        victim = five.agents.pop((4, ""))
        victim.kill()  # SIGKILL: no deregistration, the lease has to expire
        killed_at = time.time()
        out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate(timeout=10)
        victim.communicate(timeout=10)
        five.start_agent(4)
    doc = bench_json(subprocess.CompletedProcess(bench.args, bench.returncode, out.decode(),
                                                 (early + err).decode(errors="replace")))
    assert doc["exit_code"] == 1
    (missing,) = doc["missing"]
    assert missing["host"] == "h5"
    assert missing["detected_at"] - killed_at < TTL_S + 2.0, (missing, killed_at)
    pairs = _pairs(doc)
    assert len(pairs) == 10  # every pair accounted for: none left hanging
    for key, pair in pairs.items():
        if "h5" not in key:
            assert pair["state"] == "ok", pair
        else:
            assert pair["state"] in ("ok", "missing", "not-run"), pair
    assert any(p["state"] in ("missing", "not-run") for k, p in pairs.items() if "h5" in k)
    assert "missing h5" in doc["stderr"]
    # the agent is gone, not the link: the hint says to restart it (it said "check the
    # named host's link, NIC and cable")
    assert "Hint: the agent on h5 stopped renewing its lease" in doc["stderr"], doc["stderr"]
    assert "restart 'kvctl agent' there" in doc["stderr"]


def test_the_docs_show_the_commands_the_tests_run() -> None:
    text = DOC.read_text()
    assert ETCD in text
    assert "kvctl agent --metadata etcd://10.0.0.1:2379 --ttl 3s --poll 0.2s" in text
    assert "kvctl cluster bench --metadata etcd://10.0.0.1:2379 " + " ".join(SWEEP) in text
