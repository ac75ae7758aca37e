"""Faults injected on purpose: the store loses nothing it acknowledged and never returns
wrong bytes; nothing hangs.

Each test names the promise it checks. Values carry their own key and version
(:func:`~tests.reliability.conftest.make_value`), so every byte a get returns is verified
exactly. Faults proven elsewhere are listed in docs/reliability.md.
"""

from __future__ import annotations

import errno
import os
import random
import secrets
import select
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError, StoreUnavailableError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.server import MasterServer
from kvctl.store.state.writebehind import read_state
from kvctl.transfer import OpCode, SegmentNotFoundError, TransferEngine, TransferRequest
from kvctl.transfer.paths import RetryPolicy
from tests.fixtures.cli import CliResult
from tests.fixtures.servers import ServerProcess
from tests.reliability.conftest import (
    NODE_TIMEOUT_S,
    StoreCluster,
    TruncatingProxy,
    decode_value,
    kept_logging,
    make_value,
    wait_for,
)

pytestmark = pytest.mark.integration


class Ledger:
    """What one writer thread did to its own keys: acknowledged and attempted versions."""

    def __init__(self) -> None:
        self.acked: dict[str, int] = {}
        self.attempted: dict[str, set[int]] = {}
        self.lock = threading.Lock()


def _writer(client: StoreClient, prefix: str, ledger: Ledger, stop: threading.Event,
            errors: list[str], counts: dict[str, int]) -> None:
    """put / get on ``prefix`` keys until ``stop``; any wrong byte or untyped error is kept."""
    rng = random.Random(prefix)
    version = 0
    while not stop.is_set():
        key = f"{prefix}/{rng.randrange(24)}"
        try:
            if rng.random() < 0.5:
                version += 1
                with ledger.lock:
                    ledger.attempted.setdefault(key, set()).add(version)
                try:
                    client.put(key, make_value(key, version, rng.randrange(1, 96) * 1024))
                except StoreUnavailableError:
                    counts["put_failed"] += 1  # refused cleanly; checked below
                    continue
                with ledger.lock:
                    ledger.acked[key] = version
                counts["put"] += 1
            else:
                with ledger.lock:
                    acked = ledger.acked.get(key)
                try:
                    got = decode_value(key, client.get(key))
                except ObjectNotFoundError:
                    if acked is not None:
                        errors.append(f"{key}: acknowledged v{acked} but NotFound")
                    continue
                with ledger.lock:
                    tried = ledger.attempted.get(key, set())
                if got not in tried or (acked is not None and got < acked):
                    errors.append(f"{key}: got v{got}, acknowledged v{acked}, tried {tried}")
                counts["get"] += 1
        except AssertionError as exc:
            errors.append(str(exc))
        except KvctlError as exc:
            errors.append(f"{key}: {type(exc).__name__}: {exc.cause}")


def test_node_sigkill_mid_workload_loses_nothing_acknowledged(
        store_cluster: Callable[..., StoreCluster]) -> None:
    """A node SIGKILLed under puts and gets: reads fail over to the other replica, every
    acknowledged object stays readable with its exact bytes, puts in flight are committed or
    revoked (never half-visible), and the master stops routing to the dead node."""
    cluster = store_cluster()
    cluster.start_master()
    cluster.start_nodes("a", "b")
    clients = [StoreClient(cluster.address, replicas=2, transport="tcp", timeout_s=5)
               for _ in range(3)]
    ledgers = [Ledger() for _ in clients]
    errors: list[str] = []
    counts = {"put": 0, "get": 0, "put_failed": 0}
    stop = threading.Event()
    try:
        wait_for(lambda: len(clients[0].status().nodes) == 2, what="two nodes")
        threads = [threading.Thread(target=_writer, args=(c, f"w{i}", ledgers[i], stop, errors,
                                                          counts), daemon=True)
                   for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        wait_for(lambda: counts["put"] >= 60, timeout_s=20, what="60 puts before the kill")
        cluster.nodes["a"].kill()
        killed_at = time.monotonic()
        before = counts["get"]
        # Keep the workload running through the failure and the master noticing it.
        # The master notices: a silent node is suspect (no placements, reads elsewhere; its
        # objects kept until its grace ends), not yet dropped.
        wait_for(lambda: [n.node_id for n in clients[0].status().nodes if n.alive] == ["b"],
                 timeout_s=NODE_TIMEOUT_S + 8, what="node a declared suspect")
        wait_for(lambda: counts["get"] >= before + 30, timeout_s=20, what="gets after kill")
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert errors == [], errors[:10]
        assert counts["put_failed"] >= 0
        # Afterwards: every key is exactly its acknowledged version (or a revoked put's
        # predecessor), read from b; the master places nothing on a (suspect, not live).
        checker = clients[0]
        assert [n.node_id for n in checker.status().nodes if n.alive] == ["b"]
        for ledger in ledgers:
            for key, acked in ledger.acked.items():
                got = decode_value(key, checker.get(key))
                assert got >= acked, (key, got, acked)
                assert got in ledger.attempted[key], (key, got, acked)
                assert "b" in checker.stat(key).replicas
        print(f"\nnode kill: {counts['put']} puts, {counts['get']} gets, "
              f"{counts['put_failed']} puts refused, dead after "
              f"{time.monotonic() - killed_at:.1f} s; 0 wrong bytes")
    finally:
        stop.set()
        for c in clients:
            c.close()


@pytest.mark.parametrize("state", ["journal", "etcd"])
def test_master_sigkill_restart_same_client_keeps_working(
        store_cluster: Callable[..., StoreCluster], tmp_path: Path, state: str,
        request: pytest.FixtureRequest) -> None:
    """The master SIGKILLed and restarted on its port: objects and node registrations come
    back from its state (journal directory or etcd), and the same StoreClient object works
    again with no operator action and no failed call."""
    env: dict[str, str] = {}
    if state == "etcd":
        spec = request.getfixturevalue("etcd_url")
        env["KVCTL_CLUSTER_ID"] = f"rel-{secrets.token_hex(4)}"
    else:
        spec = str(tmp_path / "master-state")
    cluster = store_cluster(env)
    cluster.start_master(state=spec)
    cluster.start_nodes("a", "b")
    values = {f"k{i}": make_value(f"k{i}", 1, 20_000 + 997 * i) for i in range(30)}
    with StoreClient(cluster.address, replicas=2) as client:
        wait_for(lambda: len(client.status().nodes) == 2, what="two nodes")
        for key, value in values.items():
            client.put(key, value)
        client.remove("k29")
        # Acknowledged: the put returned and the master answered for it since.
        assert client.batch_exists(list(values)) == [True] * 29 + [False]

        cluster.master.kill()  # type: ignore[union-attr]
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            client.get("k0")  # a typed, prompt failure while the master is down
        assert time.monotonic() - started < 5
        cluster.start_master(state=spec, port=cluster.port)

        # The very next call on the same client object succeeds.
        assert client.batch_exists(list(values)) == [True] * 29 + [False]
        wait_for(lambda: sorted((n.node_id, n.alive) for n in client.status().nodes)
                 == [("a", True), ("b", True)], timeout_s=15, what="nodes re-registered")
        for key, value in values.items():
            if key == "k29":
                with pytest.raises(ObjectNotFoundError):
                    client.get(key)
            else:
                assert client.get(key) == value
                assert sorted(client.stat(key).replicas) == ["a", "b"]
        client.put("after", b"restart")
        assert client.get("after") == b"restart"


def test_stalled_node_times_out_and_reads_fail_over(
        store_cluster: Callable[..., StoreCluster]) -> None:
    """A node that stalls (SIGSTOP: sockets open, nothing answers): reads time out on it and
    are served from the other replica within a bounded time; puts fail with a cause instead
    of hanging; after SIGCONT the node rejoins."""
    cluster = store_cluster()
    cluster.start_master()
    cluster.start_nodes("a", "b")
    timeout_s = 1.0
    values = {f"s{i}": make_value(f"s{i}", 1, 64 * 1024) for i in range(12)}
    with StoreClient(cluster.address, replicas=2, transport="tcp", timeout_s=timeout_s) as c:
        wait_for(lambda: len(c.status().nodes) == 2, what="two nodes")
        for key, value in values.items():
            c.put(key, value)
        # Stall the node every read tries first: each must time out there, then fail over.
        stalled = c.stat("s0").replicas[0]
        other = "b" if stalled == "a" else "a"
        assert all(c.stat(key).replicas[0] == stalled for key in values)
        cluster.nodes[stalled].suspend()
        try:
            started = time.monotonic()
            got = c.batch_get(list(values))
            took = time.monotonic() - started
            assert got == list(values.values())  # every one, exact, from the other node
            assert took < 4 * timeout_s + 2, f"reads took {took:.1f} s"
            print(f"\nstalled node: {len(values)} keys read in {took:.1f} s "
                  f"(timeout {timeout_s} s)")
            started = time.monotonic()
            result = c.batch_put([("new", make_value("new", 1, 4096))])
            assert isinstance(result[0], StoreUnavailableError), result
            assert time.monotonic() - started < 4 * timeout_s + 2
            wait_for(lambda: [n.node_id for n in c.status().nodes if n.alive] == [other],
                     timeout_s=NODE_TIMEOUT_S + 5, what="stalled node declared suspect")
        finally:
            cluster.nodes[stalled].resume()
        wait_for(lambda: sorted(n.node_id for n in c.status().nodes if n.alive) == ["a", "b"],
                 timeout_s=15, what="stalled node back after SIGCONT")
        c.put("new", make_value("new", 2, 4096))
        assert decode_value("new", c.get("new")) == 2


def test_cut_connections_fail_after_retries_with_a_cause_within_timeout() -> None:
    """Every connection to the target is cut mid-payload: each slice is retried on another
    path, and after the retry limit the request fails naming why, within its timeout."""
    url = f"memory://{secrets.token_hex(6)}"
    size = 1 << 20
    proxy = TruncatingProxy(("127.0.0.1", 1), cut_after=200_000)
    try:
        with TransferEngine("cut-t", url, advertise=[proxy.address]) as tgt:
            tgt.register_segment("via-proxy", size)
            host, _, port = (tgt.address or "").rpartition(":")
            proxy.upstream = (host, int(port))
            with TransferEngine("cut-i", url, transport="tcp", connections_per_peer=2,
                                timeout_s=5, retry=RetryPolicy(max_retries=2)) as ini:
                ini.register_segment("local", size)
                ini.local_view("local")[:] = os.urandom(size)
                started = time.monotonic()
                batch = ini.allocate_batch(1)
                ini.submit(batch, [TransferRequest(OpCode.WRITE, "local", 0, "via-proxy",
                                                   0, size)])
                result = ini.wait(batch, 10)
                took = time.monotonic() - started
                assert result.failed == 1, result
                assert "after 3 attempt(s)" in (result.first_cause or ""), result
                assert proxy.cuts >= 3  # one cut per attempt
                assert took < 5, f"failing took {took:.1f} s"
                ini.free_batch(batch)
    finally:
        proxy.close()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB file system (tmpfs): writes past it fail with ENOSPC."""
    mount = tmp_path / "ssd"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                       capture_output=True, check=False, timeout=10)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs (needs root/CAP_SYS_ADMIN): "
                    f"{r.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False,
                       timeout=10)


def test_full_disk_pauses_offload_and_dram_keeps_serving(
        tiny_disk: Path, kvctl: Callable[..., CliResult]) -> None:
    """The SSD tier's disk fills up: the node reports it, status shows the tier ``full``,
    puts and gets keep working from DRAM with exact bytes, and offload resumes once a write
    fits again."""
    server = MasterServer(MasterCore(MasterConfig(ssd_full_retry_s=0.3)))
    node = StorageNode(server.address, node_id="a", capacity_bytes=32 << 20, ssd_dir=tiny_disk,
                       heartbeat_s=0.1)
    try:
        with StoreClient(server.address) as client:
            values = {f"f{i}": make_value(f"f{i}", 1, 512 * 1024) for i in range(12)}
            for key, value in values.items():  # 6 MiB through a 2 MiB disk
                client.put(key, value)
            wait_for(lambda: client.status().nodes[0].ssd_state == "full", timeout_s=10,
                     what="SSD tier reported full")
            st = client.status().nodes[0]
            assert "No space left on device" in st.ssd_error
            assert 0 < st.ssd_objects < len(values)
            with kept_logging():
                r = kvctl("store", "status", "--master", server.address, "--json")
                assert r.exit_code == 0, r.stderr
                assert r.json()["nodes"][0]["ssd_state"] == "full"
                r = kvctl("store", "status", "--master", server.address)
                assert "SSD tier full" in r.stdout
            # DRAM keeps serving: more puts, and every object readable, exact.
            for i in range(12, 20):
                values[f"f{i}"] = make_value(f"f{i}", 1, 256 * 1024)
                client.put(f"f{i}", values[f"f{i}"])
            for key, value in values.items():
                assert client.get(key) == value
            assert not any(p.name.endswith(".tmp") for p in tiny_disk.rglob("*"))
            # Room again (objects with SSD copies removed): the next offload succeeds.
            on_ssd = [k for k in values if "ssd" in client.stat(k).tier]
            client.batch_remove(on_ssd)
            time.sleep(0.4)  # past ssd_full_retry_s: the next commit retries the disk
            client.put("later", make_value("later", 1, 64 * 1024))
            wait_for(lambda: client.status().nodes[0].ssd_state == "ok", timeout_s=10,
                     what="SSD tier back to ok")
            wait_for(lambda: client.stat("later").tier == "dram+ssd", what="offload resumed")
    finally:
        node.close()
        server.close()
    with pytest.raises(OSError) as info:  # the disk really is that small
        (tiny_disk / "big").write_bytes(bytes(3 << 20))
    assert info.value.errno == errno.ENOSPC


def test_store_master_on_etcd_survives_an_etcd_restart(
        store_cluster: Callable[..., StoreCluster],
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """etcd (the master's state) stops and comes back. An acknowledged write is durable, so
    while etcd is down puts fail at once (never a silent drop) and gets keep being served;
    once etcd answers, writes work again, every acknowledged put is in etcd the moment it
    returns, and a master restarted afterwards finds exactly what was acknowledged. With
    client reservations on (the default): their reports wait for etcd like commits."""
    etcd = spawn_etcd()
    cluster_id = f"rel-{secrets.token_hex(4)}"
    cluster = store_cluster({"KVCTL_CLUSTER_ID": cluster_id})
    cluster.start_master(state=etcd.url)
    cluster.start_nodes("a")
    def stored() -> set[str]:
        return {o.key for o in read_state(etcd.url, cluster_id=cluster_id).objects}

    with StoreClient(cluster.address) as client:
        wait_for(lambda: len(client.status().nodes) == 1, what="node")
        client.put("before", make_value("before", 1, 10_000))
        assert "before" in stored()  # durable once put returned
        etcd.stop()
        started = time.monotonic()

        def put_during() -> None:
            for i in range(5):
                client.put(f"during{i}", make_value(f"during{i}", 1, 10_000 + i))

        with pytest.raises(StoreUnavailableError) as info:  # not durable: not acknowledged
            put_during()
        assert "etcd" in info.value.cause  # "not durable" or "takes no writes", naming etcd
        assert time.monotonic() - started < 15
        assert client.get("before") == make_value("before", 1, 10_000)  # reads go on
        etcd.start()

        def writable() -> bool:
            try:
                client.put("after", make_value("after", 1, 10_001))
            except StoreUnavailableError:
                return False
            return True

        took = wait_for(writable, timeout_s=20, what="writes accepted again")
        print(f"\netcd restart: writes accepted {took:.1f} s after etcd was back")
        assert {"before", "after"} <= stored()
        for i in range(20):  # each one in etcd the moment its put returns
            client.put(f"more{i}", make_value(f"more{i}", 1, 4096 + i))
            assert f"more{i}" in stored()
    cluster.restart_master()
    with StoreClient(cluster.address) as client:
        wait_for(lambda: [n.alive for n in client.status().nodes] == [True], timeout_s=15,
                 what="node re-registered")
        assert client.get("before") == make_value("before", 1, 10_000)
        assert client.get("after") == make_value("after", 1, 10_001)
        assert [decode_value(f"more{i}", client.get(f"more{i}")) for i in range(20)] == \
            [1] * 20


@pytest.mark.parametrize("kind", ["etcd", "redis"])
def test_engine_segments_republished_after_metadata_restart(
        kind: str, request: pytest.FixtureRequest) -> None:
    """The metadata service restarts and forgets everything: the engine's LeaseKeeper
    publishes its segments again, and a peer finds and reads them."""
    server: ServerProcess = request.getfixturevalue(f"spawn_{kind}")()
    cluster = f"rel-{secrets.token_hex(4)}"
    with TransferEngine("pub", server.url, cluster_id=cluster, lease_ttl_s=1.0) as owner, \
            TransferEngine("peer", server.url, cluster_id=cluster, transport="tcp") as peer:
        owner.register_segment("pub.seg", 4096)
        owner.local_view("pub.seg")[:5] = b"hello"
        server.restart(wipe=True)

        def found() -> bool:
            try:
                peer.refresh_segment("pub.seg")
            except (SegmentNotFoundError, KvctlError):
                return False
            return True

        took = wait_for(found, timeout_s=10, what="segment published again")
        peer.register_segment("local", 4096)
        peer.transfer([TransferRequest(OpCode.READ, "local", 0, "pub.seg", 0, 5)], timeout_s=5)
        assert bytes(peer.local_view("local")[:5]) == b"hello"
        print(f"\n{kind} restart: segment back after {took:.1f} s")


def test_desynchronised_connection_never_steers_a_read() -> None:
    """A pooled connection holding a reply nobody asked for (as after a master error on a
    no-reply message) is not used: a get never takes another key's locations for its own."""
    server = MasterServer(MasterCore())
    node = StorageNode(server.address, node_id="a", capacity_bytes=8 << 20, heartbeat_s=0.1)
    try:
        with StoreClient(server.address) as c:
            c.put("x", b"x-bytes")
            c.put("y", b"y-bytes")
            with c._pool.connection() as conn:
                conn.send(p.Get(keys=["y"], lease=False))  # a reply nobody will read
                sock = conn._sock
            wait_for(lambda: bool(select.select([sock], [], [], 0)[0]), what="stray reply")
            assert c.get("x") == b"x-bytes"
            assert c.get("y") == b"y-bytes"
    finally:
        node.close()
        server.close()
