"""The store's data path with a token across namespaced hosts: a client's put and get move
their bytes to and from a node on another host over transfer connections whose frames
carry MACs (protocol v2); a relay in the way is refused, the bytes come back intact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop

pytestmark = pytest.mark.integration
TOKEN = "hostile-store-token-5d1e"


def test_put_and_get_across_hosts_with_a_token(nshosts: MakeHosts) -> None:
    net = nshosts(3)
    env = {"KVCTL_TOKEN": TOKEN}
    master = net[0].popen(["kvctl", "store", "master", "--listen", "0.0.0.0:50051",
                           "--json"], env=env)
    node = None
    # /var/tmp: shared by the namespaced hosts (each has a private /tmp)
    src = Path(f"/var/tmp/hostile-store-{os.getpid()}.src")
    dst = Path(f"/var/tmp/hostile-store-{os.getpid()}.dst")
    try:
        read_json_doc(master)
        node = net[1].popen(["kvctl", "store", "node", "--master",
                             f"{net[0].address}:50051", "--capacity", "32MiB", "--json"],
                            env=env)
        info = read_json_doc(node)
        assert info["endpoint"].startswith(f"{net[1].address}:")
        payload = os.urandom(3 << 20)
        src.write_bytes(payload)
        master_at = f"{net[0].address}:50051"
        put = net[2].run(["kvctl", "store", "put", "obj", str(src), "--master", master_at],
                         env=env, timeout=60)
        assert put.returncode == 0, put.stderr
        get = net[2].run(["kvctl", "store", "get", "obj", "-o", str(dst), "--master",
                          master_at], env=env, timeout=60)
        assert get.returncode == 0, get.stderr
        assert dst.read_bytes() == payload
        # without the token the same client gets nothing, and says why
        refused = net[2].run(["kvctl", "store", "get", "obj", "-o", str(dst), "--master",
                              master_at], timeout=60)
        assert refused.returncode != 0
        assert "token" in refused.stderr.lower()
        status = net[0].run(["kvctl", "store", "status", "--master", master_at, "--json"],
                            env=env, timeout=30)
        nodes = json.loads(status.stdout)["nodes"]
        assert [n["endpoint"].rpartition(":")[0] for n in nodes] == [net[1].address]
    finally:
        if node is not None:
            stop(node)
        stop(master)
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
