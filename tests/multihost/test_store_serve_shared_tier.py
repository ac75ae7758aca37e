"""`kvctl store serve --shared-tier DIR` across namespaced hosts sharing DIR: an object
DRAM evicted into the tier is read by another host from the file, the tier's metrics are
scraped from that host, and after `store serve` is SIGKILLed and started again on its
journal the object still reads back, byte for byte."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host
from tests.multihost.test_shared_tier import FILL, MiB, _get, dfs  # noqa: F401 - fixture

pytestmark = pytest.mark.integration
PORT = 50071

SCRAPE = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
"""


def _serve(host: Host, tier: Path) -> tuple[subprocess.Popen[bytes], dict[str, object]]:
    proc = host.popen(["kvctl", "store", "serve", "--listen", f"{host.address}:{PORT}",
                       "--capacity", "8MiB", "--state", "/tmp/state", "--shared-tier",
                       str(tier), "--metrics-port", "0", "--json"])
    return proc, read_json_doc(proc)


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not scraped"
    return float(m.group(1))


def test_store_serve_tier_is_read_from_another_host_and_survives_a_kill(
        nshosts: MakeHosts, dfs: Path) -> None:  # noqa: F811 - the fixture
    net = nshosts(2, shared=dfs)
    h1, h2 = net[0], net[1]
    tier = dfs / "tier"
    proc, card = _serve(h1, tier)
    try:
        assert card["shared_tier"] == str(tier)
        master = str(card["master"])
        value = os.urandom(MiB + 77)
        (h2.tmp / "value.bin").write_bytes(value)
        done = h2.run(["python", "-c", FILL, master, "kv/x", "/tmp/value.bin"], timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "shared", done.stdout  # no DRAM copy: only the file
        got = _get(h2, master, "kv/x")
        assert got.returncode == 0, got.stderr
        assert (h2.tmp / "kv_x.out").read_bytes() == value
        scraped = h2.run(["python", "-c", SCRAPE, str(card["metrics"])], timeout=60)
        assert scraped.returncode == 0, scraped.stderr
        assert _sample(scraped.stdout, "kvctl_store_shared_tier_files") >= 1
        assert _sample(scraped.stdout, 'kvctl_store_objects{tier="shared"}') >= 1
        assert _sample(scraped.stdout, "kvctl_store_shared_tier_writes_total") >= 1

        proc.kill()  # master and node together; the journal keeps the index
        proc.wait(timeout=10)
        proc, card = _serve(h1, tier)
        (h2.tmp / "kv_x.out").unlink()
        got = _get(h2, str(card["master"]), "kv/x")
        assert got.returncode == 0, got.stderr
        assert (h2.tmp / "kv_x.out").read_bytes() == value
    finally:
        stop(proc)
