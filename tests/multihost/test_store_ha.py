"""Elected store masters on three namespaced hosts (issue 15.5).

Hosts A, B and C each run ``kvctl store master --state etcd://C:2379``, started at once;
host C also runs etcd, a storage node and the clients, all given every master
(``--master A:50051,B:50051,C:50051``). A 3 s lease (``KVCTL_STORE_HA_TTL``) keeps the test
short. Checked: exactly one master leads and the others write nothing; the leader
SIGKILLed under a 4-client put load loses no acknowledged object and no byte, and exactly
one standby takes over; a leader SIGSTOPped past its lease and resumed after the takeover
exits as deposed and leaves the new leader's records as they were.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host, HostNet

pytestmark = pytest.mark.integration

PORT = 50051
#: The leader's lease, seconds (KVCTL_TEST_HA_TTL=5 measures the default's takeover).
TTL_S = float(os.environ.get("KVCTL_TEST_HA_TTL", "3"))
ENV = {"KVCTL_STORE_HA_TTL": str(TTL_S), "KVCTL_STORE_NODE_TIMEOUT": "3"}


def _etcd(host: Host) -> subprocess.Popen[bytes]:
    peer = "http://127.0.0.1:2380"
    return host.popen([
        "etcd", "--name", "ha", "--data-dir", "/tmp/etcd-ha",
        "--listen-client-urls", f"http://{host.address}:2379",
        "--advertise-client-urls", f"http://{host.address}:2379",
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"ha={peer}", "--heartbeat-interval", "50",
        "--election-timeout", "500", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _master(host: Host, etcd: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return host.popen(["kvctl", "store", "master", "--listen", f"{host.address}:{PORT}",
                           "--state", etcd, "--json"], env=ENV, stderr=f.fileno())


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _records(net: HostNet, host: Host) -> int:
    """Object records in etcd, counted from host C (a range read through its JSON API)."""
    done = host.run([sys.executable, "-c", (
        "from kvctl.store.state.writebehind import read_state; "
        f"print(len(read_state('etcd://{net[2].address}:2379').objects))")], timeout=30)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def _readline(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "no line in time"
    return proc.stdout.readline()


def _leaders(logs: dict[int, Path]) -> list[int]:
    return [i for i, log in logs.items() if "leading as" in log.read_text()]


def test_elected_masters_on_three_hosts(nshosts: MakeHosts, tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    net = nshosts(3)
    c = net[2]
    etcd = f"etcd://{c.address}:2379"
    _etcd(c)
    logs = {h.index: tmp_path / f"master-{h.name}.log" for h in net}
    masters = {h.index: _master(h, etcd, logs[h.index]) for h in net}  # all at once
    every = ",".join(f"{h.address}:{PORT}" for h in net)

    # Exactly one of the three leads (its card); the others stand by, loading nothing.
    _wait(lambda: bool(_leaders(logs)), 60, "a leader")
    time.sleep(2 * TTL_S)  # the others had every chance to claim too
    assert len(_leaders(logs)) == 1, [log.read_text()[-500:] for log in logs.values()]
    first = _leaders(logs)[0]
    standbys = [i for i in logs if i != first]
    card = read_json_doc(masters[first], timeout_s=10)
    for i in standbys:
        assert "standby; leader is" in logs[i].read_text()

    node = c.popen(["kvctl", "store", "node", "--master", every, "--node-id", "c1",
                    "--capacity", "256MiB", "--json"], env=ENV)
    read_json_doc(node, timeout_s=30)

    load = c.popen([sys.executable, "-m", "tests.multihost._ha_load", every, "--threads",
                    "4", "--before", "3", "--after", "25"], env=ENV, stdin=subprocess.PIPE)
    assert _readline(load, 60).strip() == b"KILL"
    for i in standbys:
        assert "restored" not in logs[i].read_text()  # the standbys still loaded nothing
    masters[first].kill()
    masters[first].wait(10)
    assert load.stdin is not None
    load.stdin.write(b"\n")
    load.stdin.flush()
    out, err = load.communicate(timeout=120)
    assert load.returncode == 0, err.decode()[-3000:]
    doc = json.loads(out.decode().strip().splitlines()[-1])
    assert doc["lost"] == 0, doc
    assert doc["wrong"] == 0, doc
    assert doc["acked_after_kill"] >= 40, doc
    assert doc["takeover_s"] is not None, doc
    assert doc["takeover_s"] < 15, doc
    led = [i for i in _leaders(logs) if i != first]
    assert len(led) == 1, led  # one of the two standbys, not both
    second = led[0]
    second_card = read_json_doc(masters[second], timeout_s=10)
    assert int(second_card["term"]) > int(card["term"])
    print(f"\nSIGKILL under load, 3 masters on 3 hosts: {doc['acked']} puts acknowledged "
          f"({doc['acked_after_kill']} after the kill), {doc['failed']} refused cleanly, "
          f"0 lost, 0 wrong; first put through the new leader {doc['takeover_s']:.2f} s "
          f"after the kill, every client back after {doc['all_threads_back_s']:.2f} s")

    # The killed master comes back as a standby; the leader is SIGSTOPped past its lease.
    logs[first] = logs[first].with_suffix(".again.log")
    masters[first] = _master(net[first], etcd, logs[first])
    _wait(lambda: "standby; leader is" in logs[first].read_text(), 30, "standby again")
    time.sleep(1)  # the last puts' records (acknowledged: in etcd already)
    records = _records(net, c)
    assert records >= doc["acked"]  # and puts that failed at the client but landed
    masters[second].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    _wait(lambda: len(_leaders(logs)) == 2, 30, "a leader after the stop")
    took = time.monotonic() - stopped
    third = next(i for i in _leaders(logs) if i != second)
    assert int(read_json_doc(masters[third], timeout_s=10)["term"]) > \
        int(second_card["term"])
    masters[second].send_signal(signal.SIGCONT)
    assert masters[second].wait(20) == 3
    assert "deposed" in logs[second].read_text()
    time.sleep(1)
    assert _records(net, c) == records  # the woken leader deleted and rewrote nothing
    done = c.run(["kvctl", "store", "status", "--master", every, "--json"], env=ENV,
                 timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["objects"] == records
    print(f"SIGSTOPped leader: a standby led {took:.1f} s later; resumed, the old "
          f"leader exited deposed; {records} records untouched")
    for proc in (node, *masters.values()):
        stop(proc)
