"""The agent's real job handlers and host facts, in one process on loopback."""

from __future__ import annotations

import secrets

import msgspec
import pytest

from kvctl.bench.spec import CPU0, Op, Sweep
from kvctl.cluster.agent import Agent
from kvctl.cluster.bench import ClusterBenchOptions, run_cluster_bench, sweep_params
from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.facts import FactSources, Netdev, collect_facts, nic_facts, primary_address
from kvctl.cluster.jobs import default_handlers, object_content, sweep_from
from kvctl.cluster.protocol import ClusterKeys
from kvctl.cluster.registry import read_hosts
from kvctl.errors import UsageError
from kvctl.metadata import open_metadata

SWEEP = Sweep(ops=(Op.READ, Op.WRITE), transports=("tcp",), block_sizes_bytes=(64 << 10,),
              batch_sizes=(4,), duration_s=0.05, warmup_batches=1, verify=True, local=CPU0,
              remote=CPU0)

NETDEVS = [Netdev("eth0", True, 25000, ("10.1.0.7",)), Netdev("eth1", True, 0, ("10.2.0.7",)),
           Netdev("eth9", False, 0, ())]


def _sources() -> FactSources:
    return FactSources(topology=lambda: None, netdevs=lambda: list(NETDEVS),
                       engines=lambda: ["kvctl"], route=lambda _h: "10.2.0.7")


def test_facts_list_virtual_nics_rails_and_the_routed_address() -> None:
    record, topology = collect_facts(hostname="node-7", toward="10.2.0.1", sources=_sources())
    assert topology is None
    assert record.address == "10.2.0.7"  # the one that routes to the metadata service
    assert record.addresses == ["10.1.0.7", "10.2.0.7"]
    assert [(n.name, n.state, n.rate_gbps) for n in record.nics] == [
        ("eth0", "active", 25.0), ("eth1", "active", None)]  # eth9: down, no address
    assert [(r.index, r.nic, r.address) for r in record.rails] == [
        (0, "eth0", "10.1.0.7"), (1, "eth1", "10.2.0.7")]
    assert record.doctor.error is not None  # no topology: said, not hidden
    assert record.transports == ["shm", "tcp"]


def test_primary_address_prefers_advertise_then_route_then_interfaces() -> None:
    assert primary_address("10.0.0.1", "kv-7.example") == "kv-7.example"
    assert primary_address("127.0.0.1", None) == "127.0.0.1"
    assert primary_address(None, None, interfaces=lambda: ["10.9.9.9"]) == "10.9.9.9"
    assert primary_address("10.0.0.1", None, route=lambda _h: None,
                           interfaces=list) == "127.0.0.1"
    assert nic_facts(None, []) == []


def test_bad_host_names_are_refused() -> None:
    with pytest.raises(UsageError, match="cannot name a cluster member"):
        collect_facts(hostname="a/b", sources=_sources())


def test_sweeps_from_jobs_are_validated_and_bounded() -> None:
    params = sweep_params(SWEEP)
    assert sweep_from(params, max_region_bytes=1 << 30) == SWEEP
    with pytest.raises(UsageError, match="over this agent's limit"):
        sweep_from(params, max_region_bytes=1024)
    with pytest.raises(UsageError, match="unknown op"):
        sweep_from(msgspec.structs.replace(params, ops=["erase"]), max_region_bytes=1 << 30)
    with pytest.raises(UsageError, match="positive"):
        sweep_from(msgspec.structs.replace(params, batch_sizes=[0]), max_region_bytes=1 << 30)


def test_object_content_is_a_function_of_the_key() -> None:
    assert object_content("k/1", 1000) == object_content("k/1", 1000)
    assert object_content("k/1", 1000) != object_content("k/2", 1000)
    assert len(object_content("k", 12345)) == 12345


@pytest.mark.integration
def test_real_targets_and_benches_between_two_agents_on_loopback() -> None:
    client = open_metadata(f"memory://jobs-{secrets.token_hex(4)}")
    handlers = default_handlers()
    agents = []
    for name in ("l1", "l2"):
        record, _ = collect_facts(hostname=name, advertise="127.0.0.1", lease_ttl_s=5.0,
                                  poll_s=0.02, sources=_sources())
        agents.append(Agent(client, record, handlers=handlers).start())
    try:
        with Coordinator(client, ClusterKeys(), token=None, poll_s=0.02) as coord:
            report = run_cluster_bench(coord, read_hosts(client, ClusterKeys(), None),
                                       ClusterBenchOptions(sweep=SWEEP))
    finally:
        for agent in agents:
            agent.close()
        client.close()
    (pair,) = report.outcomes
    assert pair.state == "ok", pair.error
    assert pair.verified
    assert {r.op for r in pair.rows} == {"read", "write"}
    assert all(r.transport == "tcp" and "127.0.0.1" in r.path for r in pair.rows)
