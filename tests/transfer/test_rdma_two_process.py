"""Two processes, two fake hosts on one fabric: the real rdma transport end to end.

The child (``tests.fakes.rdma_peer``) is the target on host B; this process is the
initiator on host A. Bytes cross between the processes through the fake HCAs' sockets;
the QP exchange goes straight to the child's exchange service (the metadata service here is
a ``file://`` directory both see, used only to find the segment).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.transfer import OpCode, TransferEngine, TransferRequest
from tests.fakes.fabric import Fabric, bench_target, fabric_fixture  # noqa: F401
from tests.transfer._helpers import pattern

MiB = 1 << 20
pytestmark = pytest.mark.integration


class Peer:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        line = self.read()
        assert line.startswith("READY "), line
        self.ports = json.loads(line[6:])

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"peer exited: {err[-3000:]}")
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()


@pytest.fixture
def peer_factory(fabric: Fabric, tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[str]] = []

    def start(url: str, segment: str, size: int, run: int, token: str | None = None,
              subnet: str = "lab") -> Peer:
        config = fabric.write("b", fabric.device("mlx5_0", "10.0.1.1", subnet=subnet),
                              fabric.device("mlx5_1", "10.0.1.2", subnet=subnet),
                              retry_s=0.01)
        args = [sys.executable, "-m", "tests.fakes.rdma_peer", url, segment, str(size),
                str(run), *(["--token", token] if token else [])]
        proc = subprocess.Popen(args, env=fabric.child_env(config), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        procs.append(proc)
        return Peer(proc)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("token", [None, "two-hosts"])
def test_write_and_read_between_two_processes(fabric: Fabric, peer_factory: object,
                                              tmp_path: Path, token: str | None) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"),
                retry_s=0.01)
    url = f"file://{tmp_path / 'md'}"
    size = 16 * MiB
    peer = peer_factory(url, "kv-b", size, 21, token)  # type: ignore[operator]
    assert peer.ports == ["mlx5_0:1", "mlx5_1:1"]
    with TransferEngine("host-a", url, transport="rdma", token=token) as engine:
        engine.register_segment("kv-a", size)
        # READ what the peer filled
        batch = engine.allocate_batch(16)
        reqs = [TransferRequest(OpCode.READ, "kv-a", k * MiB, "kv-b", k * MiB, MiB)
                for k in range(16)]
        result = engine.run(batch, reqs, timeout_s=60)
        assert result.ok, result.first_cause
        assert bytes(engine.local_view("kv-a")) == pattern(21, 0, 0, size)
        nics = {p.split("->")[0] for s in engine.status(batch) for p in s.path.split(",")}
        assert nics == {"rdma:mlx5_0:1", "rdma:mlx5_1:1"}
        engine.free_batch(batch)
        # WRITE a new pattern, then ask the peer to check it byte for byte
        engine.local_view("kv-a")[:] = pattern(22, 0, 0, size)
        result = engine.transfer([TransferRequest(OpCode.WRITE, "kv-a", 0, "kv-b", 0, size)],
                                 timeout_s=60)
        assert result.ok
        assert peer.ask(f"check 22 0 {size}") == "MATCH"
    bye = peer.ask("quit")
    assert bye.startswith("BYE ")
    assert not any(json.loads(bye[4:]).values()), bye  # the peer left nothing behind


def test_bench_transfer_cli_over_rdma_between_two_fake_hosts(fabric: Fabric) -> None:
    """``kvctl bench transfer -t rdma --verify`` between two processes on two fake hosts:
    every row verified, and its path names the NIC pairs and memory modes."""
    config_a = fabric.write("a", fabric.device("mlx5_0", "10.0.0.1"),
                            fabric.device("mlx5_1", "10.0.0.2"), retry_s=0.01)
    config_b = fabric.write("b", fabric.device("mlx5_0", "10.0.1.1"),
                            fabric.device("mlx5_1", "10.0.1.2"), retry_s=0.01)
    sweep = ["-t", "rdma", "-b", "64KiB,1MiB", "-n", "8"]
    with bench_target(fabric.child_env(config_b), sweep) as metadata:
        out = subprocess.run(
            [sys.executable, "-m", "kvctl", "bench", "transfer", "--role", "initiator",
             "--peer", metadata, *sweep, "-d", "0.2s", "--verify", "--json"],
            env=fabric.child_env(config_a), text=True, capture_output=True, timeout=120,
            check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)["rows"]
    assert len(rows) == 4
    for row in rows:
        assert (row["transport"], row["verified"], row["errors"]) == ("rdma", True, 0)
        assert set(row["path"].split(", ")) == {"rdma:mlx5_0:1->mlx5_0:1[host->host]",
                                                "rdma:mlx5_1:1->mlx5_1:1[host->host]"}
