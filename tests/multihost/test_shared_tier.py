"""The shared tier across namespaced hosts: three hosts share one directory (the
"distributed file system"), their /tmp and /dev/shm stay private.

- A put on host 1's node, evicted to the shared tier, outlives that node (SIGKILL): host 3
  gets the exact bytes, from the file, and again after the master is SIGKILLed and
  restarted on its journal with no node at all.
- A host that mounts the tier elsewhere reads it through its path map.
- Files of a master killed with no state are orphans: the next master purges them.
- ``kvctl store smoke`` from host 3 passes its shared-tier check against host 1's master.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host, HostNet

pytestmark = pytest.mark.integration
PORT = 50061
MiB = 1 << 20

#: A client run on a host: put KEY from FILE, then 12 MiB of filler through an 8 MiB node.
FILL = """
import os, sys, time
from kvctl.store.client import StoreClient
master, key, path = sys.argv[1:4]
with StoreClient(master) as c:
    c.put(key, open(path, "rb").read())
    for i in range(12):
        c.put(f"fill-{i}", os.urandom(1 << 20))
    deadline = time.monotonic() + 20
    while c.stat(key).tier != "shared" and time.monotonic() < deadline:
        time.sleep(0.05)
    print(c.stat(key).tier)
"""


@pytest.fixture
def dfs() -> Iterator[Path]:
    """The shared directory (outside /tmp: every host binds its own over /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="kvctl-dfs-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _master(host: Host, tier: Path, *extra: str, env: dict[str, str] | None = None
            ) -> subprocess.Popen[bytes]:
    """A master with ``tier`` as its shared tier (set as an operator's environment would:
    ``KVCTL_STORE_SHARED_TIER``, the ``--shared-tier`` setting)."""
    proc = host.popen(["kvctl", "store", "master", "--listen", f"{host.address}:{PORT}",
                       "--json", *extra],
                      env={"KVCTL_STORE_SHARED_TIER": str(tier), **(env or {})})
    read_json_doc(proc)
    return proc


def _node(host: Host, master: str, capacity: str = "8MiB") -> subprocess.Popen[bytes]:
    return host.popen(["kvctl", "store", "node", "--master", master, "--capacity", capacity,
                       "--node-id", f"node-{host.name}", "--json"])


def _status(host: Host, master: str, env: dict[str, str] | None = None) -> dict[str, object]:
    done = host.run(["kvctl", "store", "status", "--master", master, "--json"], env=env,
                    timeout=60)
    assert done.returncode == 0, done.stderr
    doc: dict[str, object] = json.loads(done.stdout)
    return doc


def _wait_nodes(host: Host, master: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nodes = _status(host, master)["nodes"]
        assert isinstance(nodes, list)
        if sum(1 for n in nodes if n["alive"]) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{count} nodes did not register with {master}")


def _get(host: Host, master: str, key: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    out = key.replace("/", "_")
    return host.run(["kvctl", "store", "get", key, "-o", f"/tmp/{out}.out", "--master",
                     master], env=env, timeout=60)


def test_an_object_outlives_its_node_and_the_master(nshosts: MakeHosts, dfs: Path) -> None:
    net: HostNet = nshosts(3, shared=dfs)
    h1, h3 = net[0], net[2]
    master = f"{h1.address}:{PORT}"
    tier = dfs / "tier"
    mproc = _master(h1, tier, "--state", "/tmp/state")
    node = _node(h1, master)
    _wait_nodes(h3, master, 1)
    value = os.urandom(MiB + 123)
    (h1.tmp / "value.bin").write_bytes(value)
    done = h1.run(["python", "-c", FILL, master, "kv/blk", "/tmp/value.bin"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "shared", done.stdout  # evicted, written back
    assert list(tier.glob("*/*.kvs"))  # the file is on the shared directory

    node.kill()  # SIGKILL the node that wrote it: its DRAM is gone
    node.wait(timeout=10)
    got = _get(h3, master, "kv/blk")
    assert got.returncode == 0, got.stderr
    assert (h3.tmp / "kv_blk.out").read_bytes() == value

    mproc.kill()  # SIGKILL the master; its journal keeps the index
    mproc.wait(timeout=10)
    mproc = _master(h1, tier, "--state", "/tmp/state")
    (h3.tmp / "kv_blk.out").unlink()
    got = _get(h3, master, "kv/blk")
    assert got.returncode == 0, got.stderr
    assert (h3.tmp / "kv_blk.out").read_bytes() == value
    status = _status(h3, master)
    shared = status["shared"]
    assert isinstance(shared, dict)
    assert shared["files"] >= 1
    assert shared["root"] == str(tier)
    # kv/blk is only in the shared tier: counted there, and the tiers add up (issue 30: the
    # tier-only objects were in no tier of the summary)
    tiers = status["tiers"]
    assert isinstance(tiers, dict)
    assert tiers["shared"] >= 1, tiers
    assert sum(tiers.values()) == status["objects"], (tiers, status["objects"])
    # the SIGKILLed node's own objects (DRAM only, on it: restored, not back) are
    # unreadable now, not "0 lost" and nowhere else
    assert status["unreadable"] == tiers["dram"], (status["unreadable"], tiers)
    assert status["lost"] == 0
    text = h3.run(["kvctl", "store", "status", "--master", master], timeout=60)
    assert f"shared {tiers['shared']})" in text.stdout, text.stdout
    assert f"{status['unreadable']} unreadable now" in text.stdout, text.stdout
    assert "on 0 alive nodes + " in text.stdout, text.stdout  # node-h1's DRAM, apart

    # Host 3 mounts the tier elsewhere (and sees nothing at the master's path): its map.
    elsewhere = Path(f"{dfs}-h3")
    elsewhere.mkdir()
    try:
        mounted = h3.sh(f"mount --bind {dfs} {elsewhere} && mount -t tmpfs tmpfs {dfs}")
        assert mounted.returncode == 0, mounted.stderr
        (h3.tmp / "kv_blk.out").unlink()
        assert _get(h3, master, "kv/blk").returncode == 1  # not found there: a miss
        mapped = {"KVCTL_STORE_SHARED_TIER_MAP": f"{dfs}={elsewhere}"}
        got = _get(h3, master, "kv/blk", env=mapped)
        assert got.returncode == 0, got.stderr
        assert (h3.tmp / "kv_blk.out").read_bytes() == value
    finally:
        h3.sh(f"umount {dfs}; umount {elsewhere}")
        elsewhere.rmdir()
    stop(mproc)


def test_a_killed_masters_orphans_are_purged(nshosts: MakeHosts, dfs: Path) -> None:
    net = nshosts(3, shared=dfs)
    h1, h2, h3 = net[0], net[1], net[2]
    master = f"{h1.address}:{PORT}"
    tier = dfs / "tier"
    fast = {"KVCTL_STORE_SHARED_TIER_ORPHAN_GRACE": "1s",
            "KVCTL_STORE_SHARED_TIER_SWEEP_INTERVAL": "0.5s"}
    mproc = _master(h1, tier, env=fast)  # no state: its index dies with it
    node = _node(h2, master)
    _wait_nodes(h3, master, 1)
    (h3.tmp / "v.bin").write_bytes(os.urandom(MiB))
    done = h3.run(["python", "-c", FILL, master, "k", "/tmp/v.bin"], timeout=120)
    assert done.returncode == 0, done.stderr
    files = list(tier.glob("*/*.kvs"))
    assert files
    mproc.kill()
    mproc.wait(timeout=10)
    stop(node)
    mproc = _master(h1, tier, env=fast)
    deadline = time.monotonic() + 20
    while list(tier.glob("*/*.kvs")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(tier.glob("*/*.kvs")), "orphans left"
    shared = _status(h3, master)["shared"]
    assert isinstance(shared, dict)
    assert shared["purged"] >= len(files)
    assert shared["files"] == 0
    stop(mproc)


def test_smoke_from_another_host_passes_its_shared_tier_check(nshosts: MakeHosts,
                                                               dfs: Path) -> None:
    net = nshosts(3, shared=dfs)
    h1, h2, h3 = net[0], net[1], net[2]
    master = f"{h1.address}:{PORT}"
    mproc = _master(h1, dfs / "tier", env={"KVCTL_STORE_SHARED_TIER_POLICY": "write-through"})
    nodes = [_node(h1, master, "32MiB"), _node(h2, master, "32MiB")]
    _wait_nodes(h3, master, 2)
    done = h3.run(["kvctl", "store", "smoke", "--master", master, "--json"], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["shared-tier"]["status"] == "pass", checks["shared-tier"]
    assert "read from this host" in checks["shared-tier"]["detail"]
    for proc in (*nodes, mproc):
        stop(proc)


def test_a_shared_directory_under_tmp_is_refused(nshosts: MakeHosts) -> None:
    # every host binds its own directory over /tmp: one under it would not be shared
    with pytest.raises(ValueError, match="under /tmp"):
        nshosts(1, shared=Path("/tmp/kvctl-dfs-not-shared"))


def test_doctor_on_hosts_sharing_a_local_disk_says_shared_not_this_host_only(
        nshosts: MakeHosts, dfs: Path) -> None:
    # issue 30.6: on h4 the doctor said 'a local file system, seen by this host only' and, in
    # the same run, 'read and verified the probes of h1, h2, h3'
    net = nshosts(4, shared=dfs)
    rows: dict[str, dict[str, str]] = {}
    for host in net:
        done = host.run(["kvctl", "doctor", "env", "--shared-tier", str(dfs), "--json"],
                        timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = {c["name"]: c for c in json.loads(done.stdout)["components"]}
        if host.name == "h1":
            assert "not known to be shared" in rows["shared-tier"]["detail"]
    assert "read and verified the probes of h1" in rows["shared-tier-visibility"]["detail"]
    assert rows["shared-tier"]["detail"] == (f"{dfs}: a directory, shared with h1, h2, h3 "
                                             "(their probes were read and verified here)")
    mount = rows["shared-tier-mount"]["detail"]
    assert "this host only" not in mount, mount
    assert "h1, h2, h3" in mount or "network or distributed" in mount, mount
