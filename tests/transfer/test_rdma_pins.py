"""``--nic`` and ``--gid-index``: pins checked against the host's devices (fake pyverbs), and
carried from ``kvctl bench transfer`` (initiator, embedded target, ``--role target``) down to
the rdma transport's :class:`RdmaOptions`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvctl.bench.runner import plan_for
from kvctl.bench.spec import BenchSettings, build_sweep
from kvctl.errors import UsageError
from kvctl.transfer import TransferEngine
from kvctl.transfer.transports.rdma import RdmaOptions, RdmaTransport, rdma_probe
from tests.fakes.fabric import Fabric, bench_target, fabric_fixture  # noqa: F401
from tests.transfer._helpers import memory_url


def _two_nics(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"),
                retry_s=0.01)


def test_unknown_device_lists_the_ones_present(fabric: Fabric) -> None:
    _two_nics(fabric)
    with pytest.raises(UsageError) as err:
        RdmaTransport(engine_name="e", options=RdmaOptions(nics=("mlx5_0", "mlx5_9")))
    assert "'mlx5_9' is not on this host (present: mlx5_0, mlx5_1)" in err.value.cause
    assert "--nic mlx5_0" in (err.value.hint or "")


def test_unknown_port_lists_the_device_ports(fabric: Fabric) -> None:
    _two_nics(fabric)
    with pytest.raises(UsageError) as err:
        RdmaTransport(engine_name="e", options=RdmaOptions(nics=("mlx5_1:2",)))
    assert err.value.cause == "RDMA device mlx5_1 has no port 2 (ports: mlx5_1:1)"


def test_gid_index_past_the_table_says_its_size(fabric: Fabric) -> None:
    _two_nics(fabric)  # the fake's ports have 16-entry GID tables
    with pytest.raises(UsageError) as err:
        RdmaTransport(engine_name="e", options=RdmaOptions(gid_index=16))
    assert "GID index 16 is past the GID table of mlx5_0:1 (16 entries: 0-15)" in err.value.cause
    # rdma_probe (doctor, segment register) reports it instead of raising
    assert "16 entries" in (rdma_probe(RdmaOptions(gid_index=16)).reason or "")


def test_empty_gid_entry_names_the_populated_ones(fabric: Fabric) -> None:
    _two_nics(fabric)  # entries 0-3 populated, 3 is the RoCE v2 IPv4-mapped one
    found = rdma_probe(RdmaOptions(gid_index=9))
    assert found.ports == ()
    assert "mlx5_0:1: GID index 9 is empty (populated: 0, 1, 2, 3)" in (found.reason or "")


def test_pins_and_gid_index_reach_the_ports(fabric: Fabric) -> None:
    _two_nics(fabric)
    t = RdmaTransport(engine_name="e",
                      options=RdmaOptions(nics=("mlx5_1:1", "mlx5_0"), gid_index=1))
    try:
        assert [(p.name, p.gid_index, p.gid_type) for p in t.ports] == [
            ("mlx5_1:1", 1, "RoCE v2"), ("mlx5_0:1", 1, "RoCE v2")]
    finally:
        t.close()


def test_a_bad_pin_is_fatal_under_auto_not_a_silent_tcp_fallback(fabric: Fabric) -> None:
    _two_nics(fabric)
    with pytest.raises(UsageError, match="mlx5_7"):
        TransferEngine("e", memory_url(), transport="auto", rdma_devices=["mlx5_7"])


def test_bench_settings_carry_pins_to_the_driver_plan() -> None:
    sweep = build_sweep(BenchSettings(transport="rdma", nic="mlx5_1:1, mlx5_0,mlx5_1:1",
                                      gid_index=3))
    plan = plan_for(sweep)
    assert (plan.nics, plan.gid_index) == (("mlx5_1:1", "mlx5_0"), 3)


@pytest.mark.parametrize(("settings", "message"), [
    (BenchSettings(transport="rdma", nic="mlx5_0:x"), "NIC 'mlx5_0:x'"),
    (BenchSettings(transport="rdma", gid_index=256), "gid_index 256 (0-255)"),
    (BenchSettings(transport="shm,tcp", nic="mlx5_0"), "no rdma or auto transport"),
])
def test_bench_settings_refuse_bad_pins(settings: BenchSettings, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_sweep(settings)


def _kvctl(fabric: Fabric, name: str, *args: str, timeout: float = 120
           ) -> subprocess.CompletedProcess[str]:
    config = fabric.write(name, fabric.device("mlx5_0", "10.0.0.1"),
                          fabric.device("mlx5_1", "10.0.0.2"), retry_s=0.01)
    return subprocess.run([sys.executable, "-m", "kvctl", "bench", "transfer", *args],
                          env=fabric.child_env(config), text=True, capture_output=True,
                          timeout=timeout, check=False)


def test_cli_unknown_nic_is_an_error_with_the_present_devices(fabric: Fabric) -> None:
    r = _kvctl(fabric, "a", "-t", "rdma", "--nic", "mlx5_9", "-b", "4KiB", "-n", "2",
               "-i", "1", "--warmup", "0")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Error: RDMA device 'mlx5_9' is not on this host (present: mlx5_0, mlx5_1)" in (
        " ".join(r.stderr.split()))
    assert "Hint:" in r.stderr


def test_cli_gid_index_past_the_table(fabric: Fabric) -> None:
    r = _kvctl(fabric, "a", "-t", "rdma", "--gid-index", "40", "-b", "4KiB", "-n", "2",
               "-i", "1", "--warmup", "0")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "(16 entries: 0-15)" in " ".join(r.stderr.split())


@pytest.mark.integration
def test_cli_pinned_nics_between_two_processes(fabric: Fabric) -> None:
    """Target pinned to mlx5_1, initiator to mlx5_0, both at GID index 3: every slice goes
    mlx5_0 -> mlx5_1, verified."""
    config_b = fabric.write("b", fabric.device("mlx5_0", "10.0.1.1"),
                            fabric.device("mlx5_1", "10.0.1.2"), retry_s=0.01)
    sweep = ["-t", "rdma", "-b", "1MiB", "-n", "4", "--gid-index", "3"]
    with bench_target(fabric.child_env(config_b), ["--nic", "mlx5_1", *sweep]) as metadata:
        r = _kvctl(fabric, "a", "--role", "initiator", "--peer", metadata, *sweep,
                   "--nic", "mlx5_0:1", "-i", "2", "--warmup", "0", "--verify", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    assert len(rows) == 2
    for row in rows:
        assert (row["transport"], row["verified"], row["errors"]) == ("rdma", True, 0)
        assert row["path"] == "rdma:mlx5_0:1->mlx5_1:1[host->host]"
