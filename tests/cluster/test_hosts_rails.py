"""Four namespaced hosts with two rails each (``eth0`` on 198.18.0.N, ``eth1`` on 198.18.1.N,
each rail its own bridge), agents in etcd: ``cluster bench --per-rail`` fills one matrix per
rail with verified rows, each pair bound to its rail's addresses at both ends; one host's
rail 1 at a quarter rate is named as that host's NIC, not the host; equal rails name nobody.

Every rail is shaped (``tc tbf``, 50 Mbit/s) so the numbers are the links' and not the
shared CPUs'. One scenario (its steps below, in order): the cluster is set up once.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.cluster.facts import FactSources, Netdev, collect_facts, nic_facts, pinned_rails
from kvctl.cluster.jobs import run_bench, serve_target
from kvctl.cluster.protocol import BenchParams, HostRecord, Rail, SweepParams, TargetParams
from kvctl.errors import UsageError
from tests.cluster.nscluster import AGENT, BURST_BYTES, DOC, SWEEP, NsCluster, bench_json, doc_line
from tests.fixtures.hosts import read_json_doc
from tests.fixtures.nshosts import HostNet, HostsUnavailableError

FAST, SLOW = 50, 12.5  # Mbit/s per rail
RAILS = 2
BAD_HOST, BAD_RAIL = 2, 1  # h3's eth1


def start_agents(net: HostNet) -> NsCluster:
    """etcd on h1; agents naming their rails three ways: ``--rail NIC`` (h1),
    ``--rail NIC=ADDRESS`` (h2), derived from the interfaces (h3, h4)."""
    cluster = NsCluster(net, agents=[])
    try:
        flags = {0: ["--rail", "eth0", "--rail", "eth1"],
                 1: ["--rail", f"eth0={net[1].rail_address(0)}",
                     "--rail", f"eth1={net[1].rail_address(1)}"]}
        procs = {i: net[i].popen([*doc_line(AGENT, net), *flags.get(i, []), "--json"])
                 for i in range(len(net))}
        for i, proc in procs.items():
            cluster.agents[(i, "")] = proc
        for proc in procs.values():
            read_json_doc(proc, timeout_s=60)
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.fixture
def rails_cluster(tmp_path: Path) -> Iterator[NsCluster]:
    """Four hosts with two rails, etcd and agents (:func:`start_agents`)."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    try:
        net = HostNet(4, tmp_path, rails=RAILS)
    except HostsUnavailableError as exc:
        pytest.skip(f"no namespaced hosts here: {exc}")
    try:
        cluster = start_agents(net)
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        net.close()


@pytest.mark.integration
def test_per_rail_matrices_and_a_slow_rail_named_as_its_nic(rails_cluster: NsCluster) -> None:
    every_host_registers_both_rails(rails_cluster)
    a_rail_that_is_not_the_hosts_is_refused(rails_cluster)
    shape(rails_cluster, {})
    healthy = equal_rails_fill_both_matrices_and_name_nobody(rails_cluster)
    shape(rails_cluster, {(BAD_HOST, BAD_RAIL): SLOW})
    a_quarter_rate_rail_is_named_as_that_hosts_nic(rails_cluster)
    a_rail_that_is_down_is_named_unreachable_without_a_wait(rails_cluster, healthy)


def shape(cluster: NsCluster, slow: dict[tuple[int, int], float]) -> None:
    for host in cluster.net:
        for rail in range(RAILS):
            host.shape(rate_mbit=slow.get((host.index, rail), FAST), rail=rail,
                       burst_bytes=BURST_BYTES)


def every_host_registers_both_rails(cluster: NsCluster) -> None:
    import json

    done = cluster.kvctl(0, ["cluster", "ls", "--json"])
    assert done.returncode == 0, done.stderr
    hosts = json.loads(done.stdout)["hosts"]
    assert [h["host"] for h in hosts] == ["h1", "h2", "h3", "h4"]
    for h, host in zip(hosts, cluster.net, strict=True):
        assert h["record"]["rails"] == [
            {"index": r, "nic": f"eth{r}", "address": host.rail_address(r)}
            for r in range(RAILS)], h["host"]


def a_rail_that_is_not_the_hosts_is_refused(cluster: NsCluster) -> None:
    net = cluster.net
    for bad, says in ((["--rail", "eth7"], "no NIC or interface eth7"),
                      (["--rail", "eth1=198.18.1.9"], "198.18.1.9 is not an address"),
                      (["--rail", "eth0", "--rail", "eth0"], "already a rail")):
        done = net[0].run([*doc_line(AGENT, net), *bad, "--hostname", "hx"], timeout=60)
        assert done.returncode == 2, (bad, done.stderr)
        assert "Error:" in done.stderr, done.stderr
        assert says in done.stderr, done.stderr
        assert "Hint:" in done.stderr, done.stderr


def _bench(cluster: NsCluster) -> dict[str, Any]:
    return bench_json(cluster.kvctl(0, ["cluster", "bench", "--per-rail", *SWEEP, "--json"],
                                    timeout=300))


def _rail_of(label: str) -> int:
    return int(label.rpartition("/eth")[2])


def equal_rails_fill_both_matrices_and_name_nobody(cluster: NsCluster) -> dict[str, Any]:
    doc = _bench(cluster)
    values = [(p["a"], p["b"], p["gbytes_per_s"]) for p in doc["pairs"]]
    assert doc["per_rail"] is True
    # Nobody named. A loaded machine may still push one pair below 70% of the median.
    assert doc["diagnosis"]["culprits"] == [], values
    assert len(doc["diagnosis"]["slow"]) <= 1, values
    assert doc["exit_code"] == (1 if doc["diagnosis"]["slow"] else 0), doc["stderr"]
    net = cluster.net
    by_name = {h.name: h for h in net}
    assert len(doc["pairs"]) == 6 * RAILS
    for pair in doc["pairs"]:
        a, _, nic_a = pair["a"].partition("/")
        b, _, nic_b = pair["b"].partition("/")
        assert nic_a == nic_b, pair  # rail i against rail i
        rail = _rail_of(pair["a"])
        assert pair["state"] == "ok", pair
        assert pair["verified"] is True
        assert pair["a_address"] == by_name[a].rail_address(rail)
        assert pair["b_address"] == by_name[b].rail_address(rail)
        rows = pair["rows"]
        assert {r["op"] for r in rows} == {"read", "write"}
        for r in rows:
            assert r["errors"] == 0, r
            assert r["verified"] is True, r
            # the initiator's connections left from its rail address to the target's
            assert r["path"].startswith(f"{pair['a_address']}->{pair['b_address']}:"), r
        assert 0.003 < pair["gbytes_per_s"] < 0.008, pair  # 50 Mbit/s is 0.00625 GB/s
    labels = [m["label"] for m in doc["matrices"]]
    assert labels == [f"rail {r}" for r in range(RAILS)]
    for m in doc["matrices"]:
        cells = m["gbytes_per_s"]
        assert all(cells[i][j] is not None for i in range(4) for j in range(4) if i != j), m
    return doc


def a_quarter_rate_rail_is_named_as_that_hosts_nic(cluster: NsCluster) -> None:
    doc = _bench(cluster)
    bad = f"{cluster.net[BAD_HOST].name}/eth{BAD_RAIL}"
    values = [(p["a"], p["b"], p["gbytes_per_s"]) for p in doc["pairs"]]
    assert doc["exit_code"] == 1, doc["stderr"]
    culprits = doc["diagnosis"]["culprits"]
    assert [c["subject"] for c in culprits] == [bad], values
    (culprit,) = culprits
    assert culprit["host"] == cluster.net[BAD_HOST].name
    assert culprit["nic"] == f"eth{BAD_RAIL}"
    assert culprit["slow_pairs"] == 3
    slow = {(s["a"], s["b"]) for s in doc["diagnosis"]["slow"]}
    assert all(bad in pair for pair in slow), slow  # the host's rail 0 is not slow
    for pair in doc["pairs"]:
        ends = (pair["a"], pair["b"])
        if bad in ends:
            assert 0.0008 < pair["gbytes_per_s"] < 0.002, pair  # 12.5 Mbit/s: 0.00156 GB/s
        elif cluster.net[BAD_HOST].name + "/eth0" in ends:
            assert pair["gbytes_per_s"] > 0.003, pair
    assert f"likely culprit {bad}" in doc["stderr"], doc["stderr"]


#: ``cluster bench``'s default ``--timeout`` (longest one batch may take), seconds.
BATCH_TIMEOUT_S = 10.0


def a_rail_that_is_down_is_named_unreachable_without_a_wait(
        cluster: NsCluster, healthy: dict[str, Any]) -> None:
    """h1's eth1 down (h3's eth1 still slow): its three pairs fail, ``no pair reached
    h1/eth1`` is the diagnosis (it was not: the failed pairs never reached it), and the run
    costs one connect timeout over a healthy one, not a lease TTL per round besides."""
    down = f"{cluster.net[0].name}/eth1"
    subprocess.run(["ip", "-n", cluster.net[0].netns, "link", "set", "eth1", "down"],
                   check=True, capture_output=True)
    doc = _bench(cluster)
    failed = sorted((p["a"], p["b"]) for p in doc["pairs"] if p["state"] != "ok")
    assert len(failed) == 3, failed
    assert all(down in pair for pair in failed), failed
    assert all(p["state"] == "failed" for p in doc["pairs"] if p["state"] != "ok")
    assert doc["missing"] == []
    assert doc["diagnosis"]["unreachable"] == [down], doc["diagnosis"]
    assert f"no pair reached {down}" in doc["diagnosis"]["summary"]
    assert f"no pair reached {down}" in doc["stderr"], doc["stderr"]
    assert doc["exit_code"] == 1
    # before: 23 s against a healthy 7.6 s here (47 s against 11 s on a loaded machine)
    assert doc["duration_s"] < healthy["duration_s"] + BATCH_TIMEOUT_S, (
        doc["duration_s"], healthy["duration_s"])




NETDEVS = [Netdev("eth0", True, 0, ("10.0.0.5",)), Netdev("eth1", True, 0, ("10.1.0.5",)),
           Netdev("eth2", True, 0, ())]


def test_rails_are_numbered_in_the_order_given_by_nic_or_address() -> None:
    nics = nic_facts(None, NETDEVS)
    addresses = ["10.0.0.5", "10.1.0.5"]
    assert pinned_rails(["eth1", "eth0"], nics, addresses) == [
        Rail(0, "eth1", "10.1.0.5"), Rail(1, "eth0", "10.0.0.5")]
    assert pinned_rails(["r0=10.0.0.5", " r1 = 10.1.0.5 "], nics, addresses) == [
        Rail(0, "r0", "10.0.0.5"), Rail(1, "r1", "10.1.0.5")]


@pytest.mark.parametrize(("specs", "says"), [
    (["eth9"], "no NIC or interface eth9"),
    (["eth2"], "eth2 has no IPv4 address"),
    (["r=10.9.9.9"], "10.9.9.9 is not an address of this host"),
    (["r="], "is not NAME or NAME=ADDRESS"),
    (["=10.0.0.5"], "is not NAME or NAME=ADDRESS"),
    (["eth0", "x=10.0.0.5"], "already a rail"),
    (["eth0", "eth0"], "already a rail"),
])
def test_a_rail_this_host_cannot_have_is_a_usage_error(specs: list[str], says: str) -> None:
    with pytest.raises(UsageError, match=says) as caught:
        pinned_rails(specs, nic_facts(None, NETDEVS), ["10.0.0.5", "10.1.0.5"])
    assert caught.value.hint




def test_a_pinned_nic_that_is_down_stays_a_rail_and_the_default_skips_it() -> None:
    netdevs = [Netdev("eth0", True, 0, ("10.0.0.5",)), Netdev("eth1", False, 0, ("10.1.0.5",)),
               Netdev("eth2", True, 0, ("10.2.0.5",))]
    sources = FactSources(topology=lambda: None, netdevs=lambda: netdevs,
                          engines=list, route=lambda _host: "10.0.0.5")

    def rails(specs: list[str]) -> list[Rail]:
        record, _ = collect_facts(hostname="h1", toward="10.0.0.1", rails=specs,
                                  sources=sources)
        return record.rails

    # by default eth1 (down) is left out and eth2 becomes rail 1: --rail keeps the order
    assert [r.nic for r in rails([])] == ["eth0", "eth2"]
    assert rails(["eth0", "eth1", "eth2"]) == [
        Rail(0, "eth0", "10.0.0.5"), Rail(1, "eth1", "10.1.0.5"), Rail(2, "eth2", "10.2.0.5")]
    assert rails(["a=10.0.0.5", "b=10.1.0.5"])[1] == Rail(1, "b", "10.1.0.5")



class _Ctx:
    """As much of a job's context as the bench and target handlers read before starting."""

    def __init__(self, host: HostRecord, params: object) -> None:
        self.host, self._params, self.token = host, params, None

    def params(self, _cls: type) -> object:
        return self._params


@pytest.mark.parametrize("job", ["bench", "target"])
def test_a_job_binding_to_an_address_that_is_not_the_hosts_is_refused(job: str) -> None:
    netdevs = [Netdev("eth0", True, 0, ("10.0.0.5",)), Netdev("eth1", True, 0, ("10.1.0.5",))]
    host, _ = collect_facts(hostname="h1", toward="10.0.0.1", sources=FactSources(
        topology=lambda: None, netdevs=lambda: netdevs, engines=list,
        route=lambda _host: "10.0.0.5"))
    sweep = SweepParams(ops=["read"], transports=["tcp"], block_sizes_bytes=[4096],
                        batch_sizes=[1], duration_s=None, iterations=1, warmup=0,
                        verify=True, threads=1, local_location="cpu:0",
                        remote_location="cpu:0")
    bench = BenchParams(peer="10.1.0.6:7000", sweep=sweep, engines=["kvctl"],
                        local_address="10.9.0.5")
    target = TargetParams(region_bytes=4096, engines=["kvctl"], transports=["tcp"],
                          address="10.9.0.5")
    ctx: Any = _Ctx(host, bench if job == "bench" else target)
    handler = (functools.partial(run_bench, topology=None) if job == "bench"
               else serve_target)
    with pytest.raises(UsageError, match=r"10\.9\.0\.5 is not an address of h1") as caught:
        handler(ctx, max_region_bytes=1 << 20)
    assert "10.0.0.5, 10.1.0.5" in (caught.value.hint or "")


def test_the_docs_show_the_commands_this_test_runs() -> None:
    text = DOC.read_text()
    assert f"{AGENT.split(' --ttl')[0]} --rail eth0 --rail eth1" in text
    assert ("kvctl cluster bench --metadata etcd://10.0.0.1:2379 --per-rail "
            + " ".join(SWEEP)) in text


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.cluster.test_hosts_rails figures DIR``: the run docs/cluster.md
    shows (h3's rail 1 at a quarter rate), its table and JSON into DIR."""
    import sys
    import tempfile

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "figures":
        sys.stderr.write("usage: python -m tests.cluster.test_hosts_rails figures DIR\n")
        return 2
    out = Path(args[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, HostNet(4, Path(tmp), rails=RAILS) as net:
        cluster = start_agents(net)
        try:
            shape(cluster, {(BAD_HOST, BAD_RAIL): SLOW})
            table = cluster.kvctl(0, ["cluster", "bench", "--per-rail", *SWEEP], timeout=300)
            (out / "cluster-rails.txt").write_text(table.stdout + table.stderr)
            doc = cluster.kvctl(0, ["cluster", "bench", "--per-rail", *SWEEP, "--json"],
                                timeout=300)
            (out / "cluster-rails.json").write_text(doc.stdout)
        finally:
            cluster.close()
    sys.stdout.write(table.stdout + table.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
