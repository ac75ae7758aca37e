"""Bad shared-tier files across namespaced hosts sharing one directory: a client on host 3
that finds an object's file flipped reports it; the master on host 1 checks the file
itself, drops the entry (journalled) and deletes the file; a SIGKILLed and restarted
master still knows it is gone; a client on host 2 reporting good files changes nothing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvctl.store.sharedtier.fileformat import file_name
from tests.fixtures.hosts import MakeHosts, stop
from tests.fixtures.nshosts import Host
from tests.multihost.test_shared_tier import (  # noqa: F401 - dfs is a fixture
    FILL,
    PORT,
    _get,
    _master,
    _node,
    _status,
    _wait_nodes,
    dfs,
)
from tests.store.test_shared_tier import damage_file

pytestmark = pytest.mark.integration
MiB = 1 << 20

#: Report KEY's file at its current version as bad, 50 times, from a raw connection.
HOSTILE = """
import sys
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
master, key = sys.argv[1:3]
with StoreClient(master) as c:
    version = c.stat(key).version
    with c._pool.connection() as conn:
        for _ in range(50):
            conn.send(p.SharedBad(keys=[key], versions=[version]))
    print(c.stat(key).tier)
"""


def test_a_flipped_file_is_reported_checked_and_dropped(nshosts: MakeHosts,
                                                        dfs: Path) -> None:  # noqa: F811
    net = nshosts(3, shared=dfs)
    h1, h2, h3 = net[0], net[1], net[2]
    master = f"{h1.address}:{PORT}"
    tier = dfs / "tier"
    mproc = _master(h1, tier, "--state", "/tmp/state")
    node = _node(h2, master)
    try:
        _wait_nodes(h3, master, 1)
        for key in ("bad", "good"):
            (h3.tmp / "v.bin").write_bytes(os.urandom(MiB))
            done = h3.run(["python", "-c", FILL, master, key, "/tmp/v.bin"], timeout=120)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == "shared", done.stdout
        # host 2 insists the good file is bad: the master reads it once, keeps it
        done = h2.run(["python", "-c", HOSTILE, master, "good"], timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "shared"

        bad = tier / file_name("bad", int(_stat(h3, master, "bad")["version"]))
        assert bad.exists()
        damage_file(bad, "flip")
        assert _get(h3, master, "bad").returncode != 0  # a miss, reported
        deadline = time.monotonic() + 20
        while _shared(h3, master)["bad_files"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        shared = _shared(h3, master)
        assert shared["bad_files"] == 1
        assert shared["errors"].get("corrupt") == 1
        assert shared["reports"] >= 51
        text = h1.run(["kvctl", "store", "status", "--master", master], timeout=60)
        assert "corrupt 1" in text.stdout, text.stdout
        deadline = time.monotonic() + 20
        while bad.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not bad.exists()
        assert _get(h3, master, "good").returncode == 0

        mproc.kill()  # the drop was journalled: a restarted master does not name it
        mproc.wait(timeout=10)
        mproc = _master(h1, tier, "--state", "/tmp/state")
        gone = h3.run(["kvctl", "store", "stat", "bad", "--master", master], timeout=60)
        assert gone.returncode != 0
        assert _get(h3, master, "good").returncode == 0
    finally:
        stop(node)
        stop(mproc)


def _stat(host: Host, master: str, key: str) -> dict[str, Any]:
    done = host.run(["kvctl", "store", "stat", key, "--master", master, "--json"],
                    timeout=60)
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _shared(host: Host, master: str) -> dict[str, Any]:
    shared = _status(host, master)["shared"]
    assert isinstance(shared, dict)
    return shared
