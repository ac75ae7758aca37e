"""Store nodes named after their host by default (issue 30.8: they were ``node-xxxxxx``):
two default-named nodes on h2 and one on h3 register as three live nodes, ``h2-…`` twice
(distinct) and ``h3-…``; an explicit ``--node-id`` is kept."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host

pytestmark = pytest.mark.integration
PORT = 50071


def _node(host: Host, master: str, *extra: str) -> subprocess.Popen[bytes]:
    return host.popen(["kvctl", "store", "node", "--master", master, "--capacity", "8MiB",
                       "--json", *extra])


def test_default_node_names_follow_the_host_and_stay_distinct(nshosts: MakeHosts) -> None:
    net = nshosts(3)
    h1, h2, h3 = net[0], net[1], net[2]
    master = f"{h1.address}:{PORT}"
    mproc = h1.popen(["kvctl", "store", "master", "--listen", master, "--json"])
    read_json_doc(mproc)
    procs = [_node(h2, master), _node(h2, master), _node(h3, master),
             _node(h3, master, "--node-id", "chosen")]
    names = [str(read_json_doc(proc)["node_id"]) for proc in procs]
    assert re.fullmatch(r"h2-[0-9a-f]{6}", names[0]), names
    assert re.fullmatch(r"h2-[0-9a-f]{6}", names[1]), names
    assert re.fullmatch(r"h3-[0-9a-f]{6}", names[2]), names
    assert names[3] == "chosen"
    assert len(set(names)) == 4
    deadline = time.monotonic() + 30
    alive: set[str] = set()
    while time.monotonic() < deadline and alive != set(names):
        done = h3.run(["kvctl", "store", "status", "--master", master, "--json"], timeout=60)
        assert done.returncode == 0, done.stderr
        alive = {n["node_id"] for n in json.loads(done.stdout)["nodes"] if n["alive"]}
    assert alive == set(names)
    for proc in (*procs, mproc):
        stop(proc)
