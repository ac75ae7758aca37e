"""Pytest helpers for the fake verbs provider: a fabric directory, hosts on it, leak checks.

Use the ``fabric`` fixture (import it into the test module)::

    from tests.fakes.fabric import Fabric, fabric_fixture  # noqa: F401

    def test_x(fabric: Fabric) -> None:
        fabric.host(fabric.device("mlx5_0", "10.0.0.1"))   # this process's host
        path = fabric.write("b", fabric.device("mlx5_0", "10.0.1.1"))  # a child's host

It points kvctl at the fake (``KVCTL_PYVERBS``) and, at the end, checks that the test
left no queue pair, memory region or native WR/SGE allocation behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import pyverbs as fv
from tests.fakes.pyverbs._hca import STATE, reset

PROVIDER = "tests.fakes.pyverbs"


class Fabric:
    """A fabric directory (short path: Unix socket names are limited) and its hosts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._ips = 0

    @staticmethod
    def device(name: str, ipv4: str, *, ports: int = 1, subnet: str = "lab",
               **port_fields: Any) -> fv.DeviceSpec:
        """A RoCE device with ``ports`` ports (addresses ``ipv4``, ``ipv4``+1, ...)."""
        a, b, c, d = (int(x) for x in ipv4.split("."))
        specs = [fv.roce_port(f"{a}.{b}.{c}.{d + k}", subnet=subnet,
                              mac_suffix=(c << 8) + d + k, **port_fields) for k in range(ports)]
        return fv.DeviceSpec(name, specs)

    def spec(self, *devices: fv.DeviceSpec, **host_fields: Any) -> fv.HostSpec:
        return fv.HostSpec(str(self.root), list(devices), **host_fields)

    def host(self, *devices: fv.DeviceSpec, **host_fields: Any) -> fv.HostSpec:
        """Make this process the host with ``devices``."""
        spec = self.spec(*devices, **host_fields)
        fv.configure(spec)
        return spec

    def write(self, name: str, *devices: fv.DeviceSpec, **host_fields: Any) -> Path:
        """Write a host for a child process; pass the path in ``FAKE_PYVERBS_CONFIG``."""
        path = self.root / f"{name}.host.json"
        path.write_text(self.spec(*devices, **host_fields).to_json(), encoding="utf-8")
        return path

    def child_env(self, config: Path) -> dict[str, str]:
        """Environment for a child process on the host described by ``config``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        env.update({"KVCTL_PYVERBS": PROVIDER, fv.CONFIG_ENV: str(config),
                    "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        return env


@contextlib.contextmanager
def bench_target(env: dict[str, str], args: Sequence[str]) -> Iterator[str]:
    """``kvctl bench transfer --role target ARGS`` on loopback in a child process; yields
    the ``HOST:PORT`` an initiator passes as ``--peer`` and stops the target afterwards."""
    target = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "bench", "transfer", "--role", "target", "--listen",
         "127.0.0.1:0", "--serve-for", "120s", *args], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert target.stdout is not None
        metadata = None
        for line in target.stdout:
            if "metadata http://" in line:
                metadata = line.rsplit("http://", 1)[1].split()[0]
                break
        assert metadata, "the target never said where it serves"
        yield metadata
    finally:
        target.terminate()
        target.wait(30)
        if target.stdout is not None:
            target.stdout.close()


def leftovers() -> dict[str, int]:
    """What the fake still holds: open ports, QPs, pinned bytes, unfreed SGE/SendWR."""
    return {"ports": len(STATE.endpoints), "qps": len(STATE.qps),
            "pinned_bytes": STATE.pinned_bytes, **STATE.native}


@pytest.fixture(name="fabric")
def fabric_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fabric]:
    """A fresh fabric; kvctl's rdma transport uses the fake pyverbs during the test."""
    monkeypatch.setenv("KVCTL_PYVERBS", PROVIDER)
    root = Path(tempfile.mkdtemp(prefix="kvf", dir="/tmp"))
    before = dict(STATE.native)
    try:
        yield Fabric(root)
        left = leftovers()
        left["SGE"] -= before["SGE"]
        left["SendWR"] -= before["SendWR"]
        assert not any(left.values()), f"the test left verbs resources behind: {left}"
    finally:
        reset()
        shutil.rmtree(root, ignore_errors=True)
