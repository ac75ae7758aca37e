"""The rdma transport between two namespaced hosts (own network, /tmp and /dev/shm each),
over the fake verbs provider: the QP exchange crosses the hosts' bridge to the address the
target advertises, the fake HCAs meet in a directory both hosts see."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.fakes.fabric import PROVIDER, Fabric
from tests.fakes.pyverbs import CONFIG_ENV
from tests.fixtures.hosts import MakeHosts
from tests.fixtures.nshosts import REPO

MiB = 1 << 20
pytestmark = pytest.mark.integration

INITIATOR = textwrap.dedent("""
    import sys
    from kvctl.transfer import OpCode, TransferEngine, TransferRequest
    from tests.transfer._helpers import pattern
    url, listen, size, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
    with TransferEngine("host-a", url, transport="rdma", listen=listen, token=token) as e:
        e.register_segment("kv-a", size)
        batch = e.allocate_batch(8)
        step = size // 8
        result = e.run(batch, [TransferRequest(OpCode.READ, "kv-a", k * step, "kv-b",
                                               k * step, step) for k in range(8)],
                       timeout_s=60)
        assert result.ok, result.first_cause
        assert bytes(e.local_view("kv-a")) == pattern(71, 0, 0, size), "READ bytes differ"
        paths = sorted({p for s in e.status(batch) for p in s.path.split(",")})
        e.local_view("kv-a")[:] = pattern(72, 0, 0, size)
        e.transfer([TransferRequest(OpCode.WRITE, "kv-a", 0, "kv-b", 0, size)], timeout_s=60)
        print("OK", " ".join(paths))
""")


@pytest.mark.parametrize("token", ["", "ns-secret"], ids=["open", "token"])
def test_rdma_between_two_namespaced_hosts(nshosts: MakeHosts, token: str) -> None:
    shared = Path(tempfile.mkdtemp(prefix="kvf", dir="/var/tmp"))
    try:
        net = nshosts(2, shared=shared)
        target, initiator = net[0], net[1]
        fabric = Fabric(shared)
        config_b = fabric.write("b", fabric.device("mlx5_0", "10.0.1.1"),
                                fabric.device("mlx5_1", "10.0.1.2"), retry_s=0.01)
        config_a = fabric.write("a", fabric.device("mlx5_0", "10.0.0.1"), retry_s=0.01)
        url = f"file://{shared / 'md'}"
        base = {"KVCTL_PYVERBS": PROVIDER, "PYTHONPATH": str(REPO)}
        size = 8 * MiB
        peer = target.popen(
            [sys.executable, "-m", "tests.fakes.rdma_peer", url, "kv-b", str(size), "71",
             "--listen", f"{target.address}:0", *(["--token", token] if token else [])],
            env={**base, CONFIG_ENV: str(config_b)}, cwd=REPO, stdin=subprocess.PIPE)
        assert peer.stdout is not None
        assert peer.stdin is not None
        ready = peer.stdout.readline().decode()
        assert ready.startswith("READY"), (ready, peer.stderr.read() if peer.stderr else b"")
        done = initiator.run(
            [sys.executable, "-c", INITIATOR, url, f"{initiator.address}:0", str(size), token],
            env={**base, CONFIG_ENV: str(config_a)}, cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("OK "), done.stdout
        # one local NIC, two remote ones: the slices used both of the target's NICs
        assert done.stdout.split()[1:] == ["rdma:mlx5_0:1->mlx5_0:1[host->host]",
                                           "rdma:mlx5_0:1->mlx5_1:1[host->host]"]
        peer.stdin.write(f"check 72 0 {size}\nquit\n".encode())
        peer.stdin.flush()
        assert peer.stdout.readline().decode().strip() == "MATCH"
        assert peer.stdout.readline().decode().startswith("BYE")
        peer.wait(30)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_bench_with_pinned_nics_between_two_namespaced_hosts(nshosts: MakeHosts) -> None:
    """``kvctl bench transfer -t rdma --nic`` on two namespaced hosts: the target serves
    on its bridge address pinned to mlx5_1, the initiator pins mlx5_0 and GID index 3;
    every verified row crossed mlx5_0 -> mlx5_1."""
    shared = Path(tempfile.mkdtemp(prefix="kvf", dir="/var/tmp"))
    try:
        net = nshosts(2, shared=shared)
        target, initiator = net[0], net[1]
        fabric = Fabric(shared)
        config_b = fabric.write("b", fabric.device("mlx5_0", "10.0.1.1"),
                                fabric.device("mlx5_1", "10.0.1.2"), retry_s=0.01)
        config_a = fabric.write("a", fabric.device("mlx5_0", "10.0.0.1"),
                                fabric.device("mlx5_1", "10.0.0.2"), retry_s=0.01)
        base = {"KVCTL_PYVERBS": PROVIDER, "PYTHONPATH": str(REPO)}
        sweep = ["-t", "rdma", "-b", "1MiB", "-n", "4", "--gid-index", "3"]
        served = target.popen(
            [sys.executable, "-m", "kvctl", "bench", "transfer", "--role", "target",
             "--listen", f"{target.address}:7400", "--serve-for", "120s", "--nic", "mlx5_1",
             *sweep], env={**base, CONFIG_ENV: str(config_b)}, cwd=REPO,
            stderr=subprocess.STDOUT)
        assert served.stdout is not None
        for _ in range(200):  # bounded: the target prints a handful of lines
            line = served.stdout.readline().decode()
            if not line or "On the initiator:" in line:
                break
        assert "On the initiator:" in line, line
        done = initiator.run(
            [sys.executable, "-m", "kvctl", "bench", "transfer", "--role", "initiator",
             "--peer", f"{target.address}:7400", *sweep, "--nic", "mlx5_0", "-i", "2",
             "--warmup", "0", "--verify", "--json"],
            env={**base, CONFIG_ENV: str(config_a)}, cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = json.loads(done.stdout)["rows"]
        assert len(rows) == 2
        for row in rows:
            assert (row["transport"], row["verified"], row["errors"]) == ("rdma", True, 0)
            assert row["path"] == "rdma:mlx5_0:1->mlx5_1:1[host->host]"
        served.terminate()
        served.wait(30)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
