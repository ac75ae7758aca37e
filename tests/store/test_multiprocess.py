"""Master, nodes and clients in separate processes: failover on SIGKILL, master restart."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.rpc import MasterConnection
from tests.fixtures.servers import free_port
from tests.store.conftest import wait_for
from tests.store.procs import Servers, servers

pytestmark = pytest.mark.integration


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Servers]:
    yield from servers(tmp_path)


def test_sigkill_node_mid_workload_fails_over(procs: Servers) -> None:
    master = procs.start("master", "--listen", "127.0.0.1:0")
    address = str(master.card["master"])
    a = procs.start("node", "--master", address, "--node-id", "a", "--capacity", "64MiB")
    procs.start("node", "--master", address, "--node-id", "b", "--capacity", "64MiB")
    values = {f"k{i}": os.urandom(64 * 1024 + i) for i in range(40)}
    with StoreClient(address, replicas=2, transport="tcp") as client:
        wait_for(lambda: len(client.status().nodes) == 2, what="two nodes")
        for key, value in list(values.items())[:20]:
            client.put(key, value)
        first = [client.stat(k).replicas[0] for k in list(values)[:20]]
        assert "a" in first  # some reads must start at the node about to die
        a.kill()  # mid-workload: the next reads still see "a" in the locations
        got = client.batch_get(list(values)[:20])
        assert got == [values[k] for k in list(values)[:20]]
        # The master notices the silence: a is suspect (kept, no reads routed to it);
        # objects stay readable from b.
        wait_for(lambda: [(n.node_id, n.alive) for n in client.status().nodes]
                 == [("a", False), ("b", True)], timeout_s=10, what="node a suspect")
        assert client.batch_get(list(values)[:20]) == [values[k] for k in list(values)[:20]]
        # The operator removes it (kvctl store node rm): its copies go.
        conn = MasterConnection(address)
        try:
            assert isinstance(conn.call(p.DropNode(node_id="a")), p.Ok)
        finally:
            conn.close()
        wait_for(lambda: [n.node_id for n in client.status().nodes] == ["b"],
                 timeout_s=10, what="node a dropped")
        assert client.stat("k0").replicas == ["b"]
        with StoreClient(address, replicas=1) as single:
            for key, value in list(values.items())[20:]:
                single.put(key, value)
            assert single.get("k39") == values["k39"]


def test_client_in_another_process_sees_puts(procs: Servers, tmp_path: Path) -> None:
    master = procs.start("serve", "--listen", "127.0.0.1:0", "--capacity", "32MiB")
    address = str(master.card["master"])
    data = os.urandom(1 << 20)
    with StoreClient(address) as client:
        client.put("shared", data)
    out = tmp_path / "got"
    r = subprocess.run([sys.executable, "-m", "kvctl", "store", "get", "shared", "-o", str(out),
                        "--master", address], capture_output=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    r = subprocess.run([sys.executable, "-m", "kvctl", "store", "get", "nope", "--master",
                        address], capture_output=True, timeout=60, check=False)
    assert r.returncode == 1
    assert b"is not in the store" in r.stderr


def test_master_restart_keeps_objects(procs: Servers, tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "master-state"
    master = procs.start("master", "--listen", f"127.0.0.1:{port}", "--state", str(state))
    address = str(master.card["master"])
    procs.start("node", "--master", address, "--node-id", "a", "--capacity", "32MiB")
    values = {f"k{i}": os.urandom(10_000 + i) for i in range(10)}
    with StoreClient(address) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        for key, value in values.items():
            client.put(key, value)
        client.remove("k9")
        wait_for(lambda: client.exists("k8"), what="commit of k8")
    master.kill()
    procs.remove(master)
    procs.start("master", "--listen", f"127.0.0.1:{port}", "--state", str(state))
    with StoreClient(address) as client:
        assert client.exists("k0")
        # The node reconnects by itself and its objects are adopted, not lost.
        wait_for(lambda: [n.alive for n in client.status().nodes] == [True], timeout_s=15,
                 what="node re-registered")
        for key, value in values.items():
            if key == "k9":
                with pytest.raises(ObjectNotFoundError):
                    client.get(key)
            else:
                assert client.get(key) == value
        client.put("after", b"restart")
        assert client.get("after") == b"restart"
