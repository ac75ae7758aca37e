"""Shared-tier packs across namespaced hosts: many small write-through puts on host 1 end
in a few pack files on the shared directory; host 3 reads every object exact from them
after host 1's node is SIGKILLed, and again after the master is SIGKILLed and restarted
on its journal. The packs of a master killed with no state are purged by the next."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.fixtures.hosts import MakeHosts, stop
from tests.fixtures.nshosts import HostNet
from tests.multihost.test_shared_tier import (
    PORT,
    _master,
    _node,
    _wait_nodes,
    dfs,  # noqa: F401 - the fixture
)

#: put (``put``) or read and compare (``get``) COUNT objects of SIZE bytes, each from
#: its own seed, with a batched call; the ``get`` prints what the client's shared reader
#: did, as JSON.
CLIENT = """
import json, random, sys, time
from kvctl.store.client import StoreClient
master, what, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keys = [f"pk/{i}" for i in range(count)]
values = [random.Random(i).randbytes(size) for i in range(count)]
with StoreClient(master) as c:
    if what == "put":
        c.batch_put(list(zip(keys, values)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                "shared" in c.stat(k).tier for k in keys):
            time.sleep(0.05)
        print(json.dumps([c.stat(k).tier for k in keys]))
    else:
        got = c.batch_get(keys)
        bad = [k for k, g, v in zip(keys, got, values) if g != v]
        print(json.dumps({"bad": bad, "reads": c.shared.reads, "misses": c.shared.misses}))
"""


def test_small_puts_pack_and_every_object_reads_back_from_another_host(
        nshosts: MakeHosts, dfs: Path) -> None:  # noqa: F811
    net: HostNet = nshosts(3, shared=dfs)
    h1, h3 = net[0], net[2]
    master = f"{h1.address}:{PORT}"
    tier = dfs / "tier"
    env = {"KVCTL_STORE_SHARED_TIER_POLICY": "write-through"}
    args = ("--state", "/tmp/state", "--shared-tier-pack-below", "256KiB")
    mproc = _master(h1, tier, *args, env=env)
    node = _node(h1, master, "64MiB")
    _wait_nodes(h3, master, 1)
    count, size = 40, 16 << 10
    done = h1.run(["python", "-c", CLIENT, master, "put", str(count), str(size)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["dram+shared"] * count
    packs = sorted(p.name for p in tier.glob("pk/*.kvp"))
    assert 1 <= len(packs) <= 4, packs  # not 40 files
    assert not list(tier.glob("*/*.kvs"))  # no file of its own

    node.kill()  # SIGKILL the writer: its DRAM is gone
    node.wait(timeout=10)
    for _ in range(2):
        got = h3.run(["python", "-c", CLIENT, master, "get", str(count), str(size)],
                     timeout=120)
        assert got.returncode == 0, got.stderr
        doc = json.loads(got.stdout)
        assert doc == {"bad": [], "reads": count, "misses": 0}, doc
        mproc.kill()  # SIGKILL the master; its journal keeps the packs' records
        mproc.wait(timeout=10)
        mproc = _master(h1, tier, *args, env=env)
    assert sorted(p.name for p in tier.glob("pk/*.kvp")) == packs
    stop(mproc)


def test_a_killed_masters_packs_are_purged_by_the_next(nshosts: MakeHosts,
                                                        dfs: Path) -> None:  # noqa: F811
    net = nshosts(3, shared=dfs)
    h1, h2, h3 = net[0], net[1], net[2]
    master = f"{h1.address}:{PORT}"
    tier = dfs / "tier"
    env = {"KVCTL_STORE_SHARED_TIER_POLICY": "write-through",
           "KVCTL_STORE_SHARED_TIER_PACK_BELOW": "256KiB",
           "KVCTL_STORE_SHARED_TIER_ORPHAN_GRACE": "1s",
           "KVCTL_STORE_SHARED_TIER_SWEEP_INTERVAL": "0.5s"}
    mproc = _master(h1, tier, env=env)  # no state: its index dies with it
    node = _node(h2, master, "64MiB")
    _wait_nodes(h3, master, 1)
    done = h3.run(["python", "-c", CLIENT, master, "put", "20", str(8 << 10)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(tier.glob("pk/*.kvp"))
    mproc.kill()
    mproc.wait(timeout=10)
    stop(node)
    mproc = _master(h1, tier, env=env)
    deadline = time.monotonic() + 20
    while list(tier.glob("pk/*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(tier.glob("pk/*")), "orphan packs left"
    stop(mproc)
