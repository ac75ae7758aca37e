"""Cross-host behaviour beyond the documented examples, on namespaced hosts.

- What a target prints for the other host is a command that works there as pasted.
- A token on one side only is a clear authentication error within seconds, never a hang.
- A store node never registers a loopback data path with a master on another host.
- A shaped link is seen: the rows to and from the slow host miss ``--expect-gbytes-per-s``.
"""

from __future__ import annotations

import json
import select
import shlex
import subprocess
import time
from typing import Any

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host

pytestmark = pytest.mark.integration
TOKEN = "cross-host-secret-19c4"
SMALL = ["--block-size", "256KiB", "--batch-size", "8"]


def _target(host: Host, *extra: str, env: dict[str, str] | None = None
            ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = host.popen(["kvctl", "bench", "transfer", "--role", "target", "--listen",
                       "0.0.0.0:7400", "--json", *extra], env=env)
    return proc, read_json_doc(proc)


def _stderr_line(proc: subprocess.Popen[bytes], prefix: str, timeout_s: float = 20) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    buffered = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if ready:
            chunk = proc.stderr.read1(65536)  # type: ignore[attr-defined]
            if not chunk:
                break
            buffered += chunk
            for line in buffered.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
    raise AssertionError(f"no {prefix!r} line: {buffered.decode(errors='replace')[-2000:]}")


def test_the_printed_initiator_command_works_when_pasted(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    proc = net[0].popen(["kvctl", "bench", "transfer", "--role", "target", "--listen",
                         "0.0.0.0:7400", "--block-size", "64KiB,512KiB", "--batch-size", "16"])
    command = _stderr_line(proc, "On the initiator:")
    assert f"--peer {net[0].address}:7400" in command
    assert "0.0.0.0" not in command
    done = net[1].run([*shlex.split(command), "--iterations", "2", "--verify", "--json"],
                      timeout=120)
    stop(proc)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert {r["block_size_bytes"] for r in rows} == {64 << 10, 512 << 10}
    assert all(r["errors"] == 0 and r["verified"] for r in rows)


def test_target_on_a_wildcard_advertises_its_interface_address(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    proc, info = _target(net[0], *SMALL)
    stop(proc)
    assert info["peer"] == f"{net[0].address}:7400"
    assert info["address"].startswith(f"{net[0].address}:")
    assert info["metadata_url"] == f"http://{net[0].address}:7400"
    assert info["initiator"].startswith("kvctl bench transfer --role initiator --peer ")


def test_advertise_overrides_what_the_target_publishes(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    proc, info = _target(net[0], *SMALL, "--advertise", "kv-a.example")
    stop(proc)
    assert info["peer"] == "kv-a.example:7400"
    assert info["address"].startswith("kv-a.example:")


@pytest.mark.parametrize("who", ["target", "initiator"])
def test_a_token_on_one_side_only_is_a_clear_error_not_a_hang(nshosts: MakeHosts,
                                                              who: str) -> None:
    net = nshosts(2)
    with_token = {"KVCTL_TOKEN": TOKEN}
    proc, info = _target(net[0], *SMALL, env=with_token if who == "target" else None)
    started = time.monotonic()
    done = net[1].run(["kvctl", "bench", "transfer", "--role", "initiator", "--peer",
                       info["peer"], *SMALL, "-t", "tcp", "--iterations", "2"],
                      env=with_token if who == "initiator" else None, timeout=60)
    elapsed = time.monotonic() - started
    stop(proc)
    assert done.returncode != 0
    assert elapsed < 20, elapsed
    assert "Error:" in done.stderr
    assert "Hint:" in done.stderr
    assert "token" in done.stderr.lower(), done.stderr


def test_a_loopback_node_for_a_remote_master_is_refused(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    master = net[0].popen(["kvctl", "store", "master", "--listen", "0.0.0.0:50051",
                           "--json"])
    read_json_doc(master)
    done = net[1].run(["kvctl", "store", "node", "--master", f"{net[0].address}:50051",
                       "--capacity", "16MiB", "--node-listen", "127.0.0.1:0"], timeout=30)
    assert done.returncode == 2, done.stderr
    assert "--node-listen" in done.stderr
    assert "Hint:" in done.stderr
    # without --node-listen the node registers the address that reaches the master
    node = net[1].popen(["kvctl", "store", "node", "--master", f"{net[0].address}:50051",
                         "--capacity", "16MiB", "--json"])
    info = read_json_doc(node)
    assert info["endpoint"].startswith(f"{net[1].address}:")
    status = net[0].run(["kvctl", "store", "status", "--master", f"{net[0].address}:50051",
                         "--json"], timeout=30)
    stop(node)
    stop(master)
    nodes = json.loads(status.stdout)["nodes"]
    assert [n["endpoint"].rpartition(":")[0] for n in nodes] == [net[1].address]


def _bench(initiator: Host, target: Host, expect: float) -> dict[str, Any]:
    done = initiator.run(["kvctl", "bench", "transfer", "--role", "initiator", "--peer",
                          f"{target.address}:7400", *SMALL, "-t", "tcp", "--iterations", "6",
                          "--warmup", "1", "--expect-gbytes-per-s", str(expect), "--json"],
                         timeout=120)
    doc = json.loads(done.stdout)
    doc["exit_code"] = done.returncode
    return doc


def test_a_shaped_link_fails_exactly_the_rows_that_cross_it(nshosts: MakeHosts) -> None:
    net = nshosts(3)
    for host in net:  # a quarter of the others' rate on host C
        host.shape(rate_mbit=100 if host.index == 2 else 400)
    expect = 0.025  # GB/s: 400 Mbit/s is 0.05, 100 Mbit/s is 0.0125
    targets = {h.index: _target(h, *SMALL)[0] for h in (net[0], net[2])}
    try:
        fast = _bench(net[1], net[0], expect)      # B -> A: both links 400 Mbit/s
        into_slow = _bench(net[1], net[2], expect)  # B -> C: C's link is slow
        from_slow = _bench(net[2], net[0], expect)  # C -> A
    finally:
        for proc in targets.values():
            stop(proc)
    assert fast["exit_code"] == 0, fast["verdict"]
    assert not fast["verdict"]["shortfalls"]
    for doc in (into_slow, from_slow):
        assert doc["exit_code"] == 1
        missed = {s["label"] for s in doc["verdict"]["shortfalls"]}
        assert len(missed) == len(doc["rows"]) == 2, doc["verdict"]
        assert all(r["throughput_gbytes_per_s"] < expect for r in doc["rows"])


@pytest.mark.parametrize("who", ["master", "client"])
def test_store_token_on_one_side_only_is_a_clear_error(nshosts: MakeHosts, who: str) -> None:
    net = nshosts(2)
    with_token = {"KVCTL_TOKEN": TOKEN}
    master = net[0].popen(["kvctl", "store", "serve", "--listen", "0.0.0.0:50051",
                           "--capacity", "16MiB", "--json"],
                          env=with_token if who == "master" else None)
    read_json_doc(master)
    started = time.monotonic()
    client_env = with_token if who == "client" else None
    put = net[1].run(["kvctl", "store", "put", "k", "/etc/hostname", "--master",
                      f"{net[0].address}:50051"], env=client_env, timeout=60)
    node = net[1].run(["kvctl", "store", "node", "--master", f"{net[0].address}:50051",
                       "--capacity", "16MiB"], env=client_env, timeout=60)
    elapsed = time.monotonic() - started
    stop(master)
    for done in (put, node):
        assert done.returncode != 0
        assert "token" in done.stderr.lower(), done.stderr
        assert "Hint:" in done.stderr
    assert elapsed < 30, elapsed


def test_an_ipv6_wildcard_target_serves_ipv4_peers(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    proc = net[0].popen(["kvctl", "bench", "transfer", "--role", "target", "--listen",
                         "[::]:7400", "--json", *SMALL])
    info = read_json_doc(proc)
    done = net[1].run(["kvctl", "bench", "transfer", "--role", "initiator", "--peer",
                       f"{net[0].address}:7400", *SMALL, "-t", "tcp", "--iterations", "2",
                       "--verify"], timeout=60)
    stop(proc)
    assert info["peer"] == f"{net[0].address}:7400"
    assert done.returncode == 0, done.stderr


def test_the_initiator_keeps_its_own_buffers_off_the_network(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    proc, info = _target(net[0], *SMALL, "--advertise", "no-such-host.invalid")
    _, err = stop(proc)
    assert b"does not resolve here" in err
    proc, info = _target(net[0], *SMALL)
    done = net[1].run(["kvctl", "bench", "transfer", "--role", "initiator", "--peer",
                       info["peer"], *SMALL, "-t", "tcp", "--iterations", "2", "-v"],
                      timeout=60)
    stop(proc)
    assert done.returncode == 0, done.stderr
    assert "reachable from other hosts" not in done.stderr


#: Bytes the target's host receives once a sweep is under way: well past a connection's
#: handshake and the warmup batches of 8 x 64 KiB.
SWEEP_STARTED_BYTES = 32 << 20


def _bytes_received(host: Host) -> int:
    """Bytes ``host``'s ``eth0`` received so far (its counters, read from outside)."""
    done = subprocess.run(["ip", "-n", host.netns, "-j", "-s", "link", "show", "eth0"],
                          capture_output=True, text=True, check=True, timeout=10)
    return int(json.loads(done.stdout)[0]["stats64"]["rx"]["bytes"])


def _wait_for_bytes(host: Host, initiator: subprocess.Popen[bytes], count: int,
                    timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _bytes_received(host) < count:
        assert initiator.poll() is None, "the initiator ended before its sweep was under way"
        assert time.monotonic() < deadline, "the sweep's bytes never reached the target"
        time.sleep(0.05)


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_a_target_killed_mid_sweep_is_named_in_the_failed_rows(nshosts: MakeHosts,
                                                               token: str | None) -> None:
    """The rows after a target died say why their requests failed (the engine's cause:
    which target, refused or reset), not only how many; the run ends non-zero in bounded
    time. With a token on both sides as well (the connection is authenticated first)."""
    net = nshosts(2)
    env = {"KVCTL_TOKEN": token} if token else None
    proc, info = _target(net[0], "--block-size", "64KiB", "--batch-size", "8", env=env)
    start = _bytes_received(net[0])
    initiator = net[1].popen([*shlex.split(info["initiator"]), "--duration", "3s",
                              "--op", "write", "--json"], env=env)
    # Kill it once the sweep's WRITEs are flowing, past the connection (and the token's
    # handshake) and the warmup: a fixed 1.5 s came before the authenticated sweep had
    # started on a loaded machine, and the initiator printed no JSON.
    _wait_for_bytes(net[0], initiator, start + SWEEP_STARTED_BYTES)
    proc.kill()
    proc.wait(timeout=10)
    out, err = initiator.communicate(timeout=120)
    assert initiator.returncode != 0, err
    doc = json.loads(out)
    failed = [r for r in doc["rows"] if r["errors"]]
    assert failed, doc["rows"]
    assert all(net[0].address in (r["first_error"] or "") for r in failed), failed
    error = " ".join(line for line in err.decode().splitlines() if line.startswith("Error:"))
    assert "request(s) failed, first: " in error, err
    assert net[0].address in error, err
