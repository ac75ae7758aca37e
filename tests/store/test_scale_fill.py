"""A store filled past a million objects loses none: not to a pause of its own longer than
the node timeout, not to a restart whose restore outlasts that timeout, not to etcd state.

Slow (minutes, gigabytes): ``pytest -m slow tests/store/test_scale_fill.py``. Each test runs
its servers as processes, as in production.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.store.client import StoreClient
from tests.fixtures.servers import free_port
from tests.store.conftest import wait_for
from tests.store.procs import NODE_TIMEOUT_S, Servers, StoreProc, servers

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MILLION = 1_000_000


def _server(log: Path, *args: str, env: dict[str, str] | None = None) -> StoreProc:
    # a restore of millions of objects comes before the card, and a stop may flush them
    return StoreProc(log, *args, env=env, card_within_s=600, stop_within_s=60)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Servers]:
    yield from servers(tmp_path)


def fill(client: StoreClient, n: int, prefix: str = "fill/") -> list[str]:
    keys = [f"{prefix}{i:08d}" for i in range(n)]
    value = b"x" * 1024
    for i in range(0, n, 512):
        result = client.batch_put([(k, value) for k in keys[i:i + 512]])
        assert result == [None] * len(result), [r for r in result if r][:3]
    client.status()  # acknowledged: the master answered on this connection since
    return keys


def missing(client: StoreClient, keys: list[str]) -> int:
    return sum(1 for i in range(0, len(keys), 4096)
               for ok in client.batch_exists(keys[i:i + 4096]) if not ok)


def test_a_million_objects_survive_a_stop_longer_than_the_node_timeout(
        procs: Servers, tmp_path: Path) -> None:
    """``kvctl store serve`` (master and node in one process, like the report that lost
    ~2x10^6 objects to a 2.96 s GC pause) holds a million objects; the whole process is
    stopped for three node timeouts and continued: its node is never dropped, 0 lost."""
    serve = _server(tmp_path / "serve.log", "serve", "--listen", f"127.0.0.1:{free_port()}",
                 "--capacity", "2GiB")
    procs.append(serve)
    address = str(serve.card["master"])
    with StoreClient(address, transport="tcp", timeout_s=120) as client:
        keys = fill(client, MILLION)
        assert missing(client, keys) == 0
        serve.signal(signal.SIGSTOP)
        time.sleep(3 * NODE_TIMEOUT_S)
        serve.signal(signal.SIGCONT)
        time.sleep(2 * NODE_TIMEOUT_S)  # housekeeping and heartbeats run again
        status = client.status()
        assert [n.state for n in status.nodes] == ["alive"]
        assert (status.objects, status.lost) == (MILLION, 0)
        assert missing(client, keys) == 0
        assert client.get(keys[123_456]) == b"x" * 1024


def test_a_million_objects_restart_from_the_journal_with_none_lost(
        procs: Servers, tmp_path: Path) -> None:
    """The master SIGKILLed with a million objects and restarted on its port: the restore
    takes longer than the node timeout, the node (which kept running) is re-adopted with
    every object (the old master lost 500,000 of 500,000 this way)."""
    port = free_port()
    state = tmp_path / "state"
    master = _server(tmp_path / "master.log", "master", "--listen", f"127.0.0.1:{port}",
                  "--state", str(state))
    procs.append(master)
    address = str(master.card["master"])
    procs.append(_server(tmp_path / "node.log", "node", "--master", address, "--node-id", "a",
                      "--capacity", "2GiB"))
    with StoreClient(address, transport="tcp", timeout_s=120) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        keys = fill(client, MILLION)
    master.signal(signal.SIGKILL)
    master.proc.wait(30)
    procs.remove(master)
    started = time.monotonic()
    restarted = _server(tmp_path / "master.log", "master", "--listen", f"127.0.0.1:{port}",
                     "--state", str(state))
    procs.append(restarted)
    with StoreClient(address, transport="tcp", timeout_s=120) as client:
        wait_for(lambda: [n.alive for n in client.status().nodes] == [True], timeout_s=120,
                 what="node re-adopted")
        took = time.monotonic() - started
        print(f"\nrestart of {MILLION:,} objects from the journal: {took:.1f} s")
        status = client.status()
        assert (status.objects, status.lost) == (MILLION, 0)
        assert missing(client, keys) == 0
        assert client.get(keys[999_999]) == b"x" * 1024


def test_etcd_state_fill_and_restart_lose_nothing(procs: Servers, tmp_path: Path,
                                                  etcd_url: str) -> None:
    """200,000 objects with etcd state and the client's default batching: the node is
    never suspect, the master restarts from etcd (paged loading) with every object."""
    port = free_port()
    env = {"KVCTL_CLUSTER_ID": f"slow-{os.getpid()}-{port}"}
    master = _server(tmp_path / "master.log", "master", "--listen", f"127.0.0.1:{port}",
                  "--state", etcd_url, env=env)
    procs.append(master)
    address = str(master.card["master"])
    procs.append(_server(tmp_path / "node.log", "node", "--master", address, "--node-id", "a",
                      "--capacity", "512MiB"))
    n = 200_000
    with StoreClient(address, transport="tcp", timeout_s=120) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        started = time.monotonic()
        keys = fill(client, n)
        rate = n / (time.monotonic() - started)
        assert [s.state for s in client.status().nodes] == ["alive"]
    master.signal(signal.SIGKILL)
    master.proc.wait(30)
    procs.remove(master)
    started = time.monotonic()
    procs.append(_server(tmp_path / "master.log", "master", "--listen", f"127.0.0.1:{port}",
                      "--state", etcd_url, env=env))
    with StoreClient(address, transport="tcp", timeout_s=120) as client:
        wait_for(lambda: [s.alive for s in client.status().nodes] == [True], timeout_s=120,
                 what="node re-adopted")
        print(f"\netcd state: {rate:,.0f} puts/s; restart of {n:,} objects "
              f"{time.monotonic() - started:.1f} s")
        status = client.status()
        assert (status.objects, status.lost) == (n, 0)
        assert missing(client, keys) == 0
