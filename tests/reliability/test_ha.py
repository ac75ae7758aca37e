"""Masters on one etcd state elect a leader; a standby touches nothing, takes over when the
leader dies, and a deposed leader is fenced (issue 15.5).

Real processes and a real etcd on loopback, with a 3 s lease (``KVCTL_STORE_HA_TTL``) to keep
the tests short. The same on three namespaced hosts: ``tests/multihost/test_store_ha.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.metadata import open_metadata
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.leader import leader_key, read_leader
from kvctl.store.master.election import Election
from kvctl.store.state import MetadataState, NodeRecord, ObjectRecord, ReplicaRecord
from kvctl.store.state.writebehind import read_state
from tests.fixtures.servers import ServerProcess, free_port
from tests.reliability.conftest import ROOT, make_value, wait_for

pytestmark = pytest.mark.integration

TTL_S = 3.0  # a few seconds: short tests, yet a renewal survives a loaded CI machine


class Proc:
    """``kvctl store ARGS --json`` with its stdout card and its log read from the start
    (a standby prints no card until it leads)."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "store", *args, "--json"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**os.environ, "KVCTL_STORE_NODE_TIMEOUT": "3", **env})
        self.card: dict[str, object] | None = None
        self._err: list[str] = []
        self._out = ""
        self._threads = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._threads:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out += line.decode(errors="replace")
            if self.card is None:
                with contextlib.suppress(ValueError):
                    self.card = json.loads(self._out)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line.decode(errors="replace"))

    @property
    def log(self) -> str:
        return "".join(self._err)

    def wait_card(self, timeout_s: float = 30.0) -> dict[str, object]:
        wait_for(lambda: self.card is not None or self.proc.poll() is not None,
                 timeout_s=timeout_s, what=f"card of {self.args}")
        assert self.card is not None, self.log[-3000:]
        return self.card

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: str, env: dict[str, str]) -> Proc:
        proc = Proc(*args, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()
    for path in Path("/dev/shm").glob("kvctl-*"):  # SIGKILLed nodes leave theirs
        if any(str(p.proc.pid) in path.name for p in started):
            path.unlink(missing_ok=True)


def _records(etcd_url: str, cluster: str) -> dict[str, bytes]:
    """Every key of the store's state (its log, snapshots, records), leader keys aside."""
    prefix = f"kvctl/{cluster}/store/"
    with open_metadata(etcd_url) as meta:
        return {k: v for k, v in meta.list(prefix).items()
                if k not in (prefix + "leader", prefix + "term")}


def _objects(etcd_url: str, cluster: str) -> int:
    return len(read_state(etcd_url, cluster_id=cluster).objects)


def test_two_masters_at_once_one_leads_the_standby_touches_nothing_then_takes_over(
        etcd_url: str, procs: Callable[..., Proc]) -> None:
    """Two masters started at the same moment on one etcd state: exactly one prints its
    card and serves; the other refuses connections, loads and writes nothing while the
    leader lives (every record stays), and takes over once the leader is SIGKILLed. A
    client and a node given both addresses follow; every acknowledged object stays
    readable."""
    cluster = f"ha-{secrets.token_hex(4)}"
    env = {"KVCTL_CLUSTER_ID": cluster, "KVCTL_STORE_HA_TTL": str(TTL_S)}
    ports = [free_port(), free_port()]
    both = ",".join(f"127.0.0.1:{p}" for p in ports)
    masters = [procs("master", "--listen", f"127.0.0.1:{p}", "--state", etcd_url, env=env)
               for p in ports]
    wait_for(lambda: any(m.card for m in masters), timeout_s=30, what="a leader")
    time.sleep(2 * TTL_S)  # the other had every chance to claim too
    leaders = [m for m in masters if m.card]
    assert len(leaders) == 1, [m.log[-800:] for m in masters]
    leader, standby = leaders[0], next(m for m in masters if not m.card)
    assert "standby; leader is 127.0.0.1:" in standby.log, standby.log
    term = int(str(leader.card["term"]))  # type: ignore[index]
    info = read_leader(etcd_url, cluster_id=cluster)
    assert info is not None
    assert info.term == term
    assert info.address == str(leader.card["master"])  # type: ignore[index]

    procs("node", "--master", both, "--node-id", "n1", "--capacity", "64MiB",
          env=env).wait_card()
    values = {f"k{i}": make_value(f"k{i}", 1, 3000 + 37 * i) for i in range(40)}
    with StoreClient(both, timeout_s=5) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        for key, value in values.items():
            client.put(key, value)
        client.remove("k39")
        del values["k39"]
        assert client.batch_exists(list(values)) == [True] * len(values)
        wait_for(lambda: _objects(etcd_url, cluster) == len(values), timeout_s=10,
                 what="records in etcd")
        before = _records(etcd_url, cluster)
        time.sleep(2 * TTL_S)  # a standby that loaded and judged the state would act now
        assert _records(etcd_url, cluster) == before
        assert "restored" not in standby.log
        assert standby.card is None

        leader.proc.kill()
        leader.proc.wait(10)
        killed = time.monotonic()
        # Calls wait for the takeover; a put fails cleanly until the node is back.
        wait_for(lambda: _put(client, "after-kill", b"new leader"), timeout_s=20,
                 what="a put through the new leader")
        took = time.monotonic() - killed
        standby.wait_card(5)
        assert int(str(standby.card["term"])) > term  # type: ignore[index]
        assert "taking over without waiting" in standby.log  # same host, pid gone
        wait_for(lambda: [n.alive for n in client.status().nodes] == [True], timeout_s=15,
                 what="node registered with the new leader")
        for key, value in values.items():
            assert client.get(key) == value
        assert client.get("after-kill") == b"new leader"
    # A client may also find the leader through etcd instead of a list of masters.
    with StoreClient(f"{etcd_url}?cluster={cluster}", timeout_s=5) as found:
        assert found.get("k0") == values["k0"]
        assert found.leader == str(standby.card["master"])  # type: ignore[index]
        print(f"\ntakeover on this host (leader SIGKILLed, pid gone): first put after "
              f"{took:.2f} s")


def test_sigstopped_leader_is_fenced_after_takeover_and_exits(
        etcd_url: str, procs: Callable[..., Proc]) -> None:
    """The leader is SIGSTOPped past its lease: the standby takes over after the TTL, and
    the new leader's puts and removes land. SIGCONT: the old leader learns it was
    deposed before it answers, says so, exits non-zero, and nothing it held in memory
    overwrites or deletes the new leader's records."""
    cluster = f"ha-{secrets.token_hex(4)}"
    env = {"KVCTL_CLUSTER_ID": cluster, "KVCTL_STORE_HA_TTL": str(TTL_S)}
    ports = [free_port(), free_port()]
    both = ",".join(f"127.0.0.1:{p}" for p in ports)
    first = procs("master", "--listen", f"127.0.0.1:{ports[0]}", "--state", etcd_url,
                  env=env)
    first.wait_card()
    second = procs("master", "--listen", f"127.0.0.1:{ports[1]}", "--state", etcd_url,
                   env=env)
    wait_for(lambda: "standby" in second.log, what="standby")
    # This node finds the leader through etcd (the clients are given both addresses).
    procs("node", "--master", f"{etcd_url}?cluster={cluster}", "--node-id", "n1",
          "--capacity", "64MiB", env=env).wait_card()
    with StoreClient(both, timeout_s=3, reserve_bytes=0) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        for i in range(20):
            client.put(f"old{i}", make_value(f"old{i}", 1, 2000 + i))

        first.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        second.wait_card(TTL_S * 3 + 10)
        took = time.monotonic() - stopped
        # It waited for the lease: the leader's pid lives. The lease is renewed every TTL/3,
        # so at the SIGSTOP between 2/3 TTL and a whole TTL of it was left (2.49 s was
        # seen under load against the old TTL - 0.5 bound, a margin the design never gave).
        assert took >= TTL_S * 2 / 3 - 0.1
        # The client's connection to the stopped leader times out, then it moves on.
        took_put = wait_for(lambda: _put(client, "new0", b"from the new leader"),
                            timeout_s=20, what="a put through the new leader")
        wait_for(lambda: [n.alive for n in client.status().nodes] == [True], timeout_s=15,
                 what="node with the new leader")
        for i in range(10):
            client.put(f"old{i}", make_value(f"old{i}", 2, 2100 + i))  # overwritten
        for i in range(10, 15):
            client.remove(f"old{i}")
        wait_for(lambda: _objects(etcd_url, cluster) == 16, timeout_s=10,
                 what="the new leader's records")
        before = _records(etcd_url, cluster)

        first.proc.send_signal(signal.SIGCONT)
        first.proc.wait(15)
        assert first.proc.returncode == 3, first.log[-2000:]
        assert "deposed" in first.log, first.log[-2000:]
        time.sleep(1)
        assert _records(etcd_url, cluster) == before
        assert client.get("new0") == b"from the new leader"
        for i in range(10):
            assert client.get(f"old{i}") == make_value(f"old{i}", 2, 2100 + i)
        for i in range(15, 20):
            assert client.get(f"old{i}") == make_value(f"old{i}", 1, 2000 + i)
        assert client.batch_exists([f"old{i}" for i in range(10, 15)]) == [False] * 5
    print(f"\nSIGSTOPped leader: standby led after {took:.1f} s, first put through it "
          f"{took_put:.1f} s later")


def _put(client: StoreClient, key: str, value: bytes) -> bool:
    try:
        client.put(key, value)
    except StoreUnavailableError:
        return False
    return True


def test_a_deposed_leaders_writes_are_fenced(etcd_url: str) -> None:
    """In process: a leader whose key another master claimed writes nothing more (its
    transaction carries its term), its acknowledgements fail, it refuses new puts, and
    it is told it was deposed; the new leader's records are untouched."""
    cluster = f"ha-{secrets.token_hex(4)}"
    old = Election(etcd_url, address="127.0.0.1:1", cluster_id=cluster, ttl_s=TTL_S)
    assert old.campaign(threading.Event())
    why: list[str] = []
    old.on_deposed(why.append)
    state = MetadataState(etcd_url, cluster_id=cluster, fence=old.fence,
                          on_fenced=old.depose)
    node = NodeRecord("n", "E", "seg", "127.0.0.1:2", "h", 1 << 20, 0, "off")
    state.put_node(node)
    state.put_object(ObjectRecord("k", 10, 1, 1, [ReplicaRecord("n", 0, 10, "E")], []))
    assert state.ack() is None

    # Another master takes the key (as after the old one's lease ran out).
    with open_metadata(etcd_url) as meta:
        assert meta.delete(leader_key(cluster))
    new = Election(etcd_url, address="127.0.0.1:3", cluster_id=cluster, ttl_s=TTL_S)
    assert new.campaign(threading.Event())
    assert new.term > old.term
    fresh = MetadataState(etcd_url, cluster_id=cluster, fence=new.fence)
    fresh.put_object(ObjectRecord("k", 10, 7, 2, [ReplicaRecord("n", 0, 10, "E")], []))
    assert fresh.ack() is None

    state.delete_object("k")
    state.put_object(ObjectRecord("zombie", 10, 1, 3, [], []))
    problem = state.ack(timeout_s=5)
    assert problem is not None
    assert "another master leads now" in problem
    assert state.refusal() is not None
    wait_for(lambda: bool(why), timeout_s=5, what="the deposed callback")
    assert old.check() is not None
    loaded = fresh.load()
    assert [(o.key, o.checksum) for o in loaded.objects] == [("k", 7)]
    assert [n.node_id for n in loaded.nodes] == ["n"]
    assert new.check() is None
    for closing in (state, fresh, old, new):
        closing.close()


def test_a_lone_leader_outlives_an_etcd_stall_longer_than_its_lease(
        spawn_etcd: Callable[[], ServerProcess], procs: Callable[..., Proc]) -> None:
    """etcd SIGSTOPped for twice the lease: the leader keeps answering gets meanwhile
    (its puts fail), and once etcd answers it renews, or takes its lapsed key back in the
    same term since no other master claimed: it keeps serving, no restart."""
    etcd = spawn_etcd()
    env = {"KVCTL_CLUSTER_ID": f"ha-{secrets.token_hex(4)}", "KVCTL_STORE_HA_TTL": str(TTL_S)}
    master = procs("master", "--listen", "127.0.0.1:0", "--state", etcd.url, env=env)
    address = str(master.wait_card()["master"])
    procs("node", "--master", address, "--node-id", "n1", "--capacity", "32MiB",
          env=env).wait_card()
    with StoreClient(address, timeout_s=5) as client:
        wait_for(lambda: _put(client, "before", b"kept"), timeout_s=15, what="a put")
        os.kill(etcd.pid, signal.SIGSTOP)
        try:
            stalled = time.monotonic()
            while time.monotonic() - stalled < 3 * TTL_S:
                started = time.monotonic()
                assert client.get("before") == b"kept"
                assert time.monotonic() - started < 1.0  # reads never wait for etcd
                time.sleep(0.25)
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        wait_for(lambda: _put(client, "after", b"stall"), timeout_s=20,
                 what="puts again after the stall")
        assert client.get("after") == b"stall"
        # Whichever etcd does first on SIGCONT: expire the lease (the key is taken back
        # in the same term) or take the renewal.
        wait_for(lambda: "leading again in the same term" in master.log
                 or "lease renewed again" in master.log, timeout_s=10,
                 what="the lease renewed or taken back")
        assert client.get("before") == b"kept"
    assert master.proc.poll() is None, master.log[-2000:]
    assert "deposed" not in master.log


def test_a_standby_started_alone_leads_at_once(etcd_url: str,
                                               procs: Callable[..., Proc]) -> None:
    """A master that resigns (SIGTERM) hands over at once: the standby leads within
    about one poll, not a whole lease."""
    cluster = f"ha-{secrets.token_hex(4)}"
    env = {"KVCTL_CLUSTER_ID": cluster, "KVCTL_STORE_HA_TTL": "10"}
    first = procs("master", "--listen", "127.0.0.1:0", "--state", etcd_url, env=env)
    first.wait_card()
    second = procs("master", "--listen", "127.0.0.1:0", "--state", etcd_url, env=env)
    wait_for(lambda: "standby" in second.log, what="standby")
    first.proc.terminate()
    stopped = time.monotonic()
    second.wait_card(10)
    assert time.monotonic() - stopped < 5  # not the 10 s lease
    assert first.proc.wait(10) == 0


def test_several_masters_skip_a_dead_or_foreign_address_and_name_it() -> None:
    """A client given several masters connects to the one that is a kvctl master: a
    refused port and a server speaking something else are passed over (and named when
    nothing else answers), never written to."""
    from kvctl.store.errors import ProtocolError
    from kvctl.store.master import MasterCore
    from kvctl.store.server import MasterServer

    foreign = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def babble() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = foreign.accept()
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    got.append(conn.recv(65536))
                conn.close()

    threading.Thread(target=babble, daemon=True).start()
    refused = f"127.0.0.1:{free_port()}"
    other = f"127.0.0.1:{foreign.getsockname()[1]}"
    with MasterServer(MasterCore()) as server:
        started = time.monotonic()
        with StoreClient(f"{refused},{other},{server.address}", timeout_s=5) as client:
            assert client.leader == server.address
            assert client.status().objects == 0
        assert time.monotonic() - started < 5
        with pytest.raises(ProtocolError, match=other):
            StoreClient(f"{refused},{other}", timeout_s=5)
    foreign.close()
    assert all(b"put" not in data.lower() for data in got)


def _serve_refused(etcd_url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kvctl store serve`` on ``etcd_url`` run to its end (it must refuse to start)."""
    return subprocess.run(
        [sys.executable, "-m", "kvctl", "store", "serve", "--listen",
         f"127.0.0.1:{free_port()}", "--state", etcd_url, "--capacity", "16MiB"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **env})


def test_store_serve_on_etcd_state_leads_it_or_refuses_to_start(
        etcd_url: str, procs: Callable[..., Proc]) -> None:
    """``kvctl store serve`` (master and node in one process) on etcd state used to take no
    part in the election: an elected master beside it wrote the same state unfenced. Now
    it claims the lead at once: a master started after it stands by; a second serve, or a
    serve while a master leads, exits naming the leader; once serve stops, the standby
    takes over the records serve wrote."""
    cluster = f"ha-serve-{secrets.token_hex(4)}"
    env = {"KVCTL_CLUSTER_ID": cluster, "KVCTL_STORE_HA_TTL": str(TTL_S)}
    serve = procs("serve", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                  "--capacity", "32MiB", env=env)
    address = str(serve.wait_card()["master"])
    info = read_leader(etcd_url, cluster_id=cluster)
    assert info is not None
    assert info.address == address
    with StoreClient(address, timeout_s=5) as client:
        client.put("by-serve", b"written under serve's term")
    standby = procs("master", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                    env=env)
    wait_for(lambda: "standby; leader is" in standby.log, timeout_s=20, what="standby")
    second = _serve_refused(etcd_url, env)
    assert second.returncode == 3, second.stderr
    assert address in second.stderr, second.stderr
    assert "a second master would write the same state unfenced" in second.stderr
    assert "Hint:" in second.stderr
    assert standby.card is None
    serve.stop()  # resigns: the standby takes over at its next read
    card = standby.wait_card(20)
    assert int(str(card["term"])) > info.term
    assert _objects(etcd_url, cluster) == 1
    # The elected master leads now: serve refuses, naming it.
    again = _serve_refused(etcd_url, env)
    assert again.returncode == 3, again.stderr
    assert str(card["master"]) in again.stderr
