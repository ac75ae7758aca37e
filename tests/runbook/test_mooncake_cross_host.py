"""``mooncake-cluster.yaml`` across hosts, as examples/runbooks/README.md shows it: a real
``mooncake_master`` and a storage process on host A, the runbook and ``kvctl store status``
on host B, on namespaced hosts (own network, /dev/shm, /tmp and hostname each). The commands
run are the README's, with only the host addresses replaced."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.hosts import MakeHosts, read_json_doc, stop
from tests.fixtures.nshosts import Host

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
README = REPO / "examples" / "runbooks" / "README.md"
GUIDE = REPO / "docs" / "operator-guide.md"
DOC_A, DOC_B = "10.0.0.1", "10.0.0.2"

# Polls A's HTTP endpoint from another host until it answers (argv[3] "up") or a segment is
# mounted ("storage"), bounded by argv[2] seconds; then prints /get_segments_detail.
WAIT_FOR = """
import json, sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while True:
    try:
        with urllib.request.urlopen(url + "/get_segments_detail", timeout=2) as r:
            doc = json.load(r)
        if sys.argv[3] == "up" or doc["segments"]:
            print(json.dumps(doc)); break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"{url}: not {sys.argv[3]} in time")
    time.sleep(0.1)
"""

# Runs on A beside the master: every segment name the master reports, polled every 50 ms
# until stopped (one line per name, when first seen).
WATCH_SEGMENTS = """
import json, sys, time, urllib.request
seen = set()
while True:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/get_segments_detail", timeout=2) as r:
            for s in json.load(r)["segments"]:
                if s["segment_name"] not in seen:
                    seen.add(s["segment_name"]); print(s["segment_name"], flush=True)
    except OSError:
        pass
    time.sleep(0.05)
"""

ALL_KEYS = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/get_all_keys", timeout=5) as r:
    print(r.read().decode())
"""


def _documented() -> list[str]:
    """The command lines of the README's ``mooncake-cluster.yaml`` block (comments and
    blank lines dropped)."""
    text = README.read_text()
    section = text[text.index("## `mooncake-cluster.yaml`"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "no bash block in the README's mooncake-cluster section"
    return [line for line in block.group(1).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_operator_guide_shows_the_same_commands() -> None:
    guide = GUIDE.read_text()
    section = guide[guide.index("## 6. A production Mooncake cluster"):]
    for line in _documented():
        assert f"\n{line}\n" in section, line


def _line(starts: str, a: Host, b: Host) -> str:
    """The documented line that starts with ``starts``, with the hosts' addresses."""
    found = [line for line in _documented() if line.startswith(starts)]
    assert len(found) == 1, (starts, _documented())
    return found[0].replace(DOC_A, a.address).replace(DOC_B, b.address)


def _python(host: Host, script: str, *args: str, timeout: float = 60.0
            ) -> subprocess.CompletedProcess[str]:
    return host.run([sys.executable, "-c", script, *args], timeout=timeout)


def test_mooncake_cluster_runbook_from_another_host(nshosts: MakeHosts) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeUnavailableError, find_mooncake_binary

    try:
        bindir = find_mooncake_binary("mooncake_master").parent
        find_mooncake_binary("mooncake_client")
    except MooncakeUnavailableError as exc:
        pytest.skip(f"Mooncake binaries unavailable: {exc.cause}")
    if shutil.which("kvctl", path=str(Path(sys.executable).parent)) is None:
        pytest.skip(f"no kvctl console script next to {sys.executable} (pip install -e .)")
    net = nshosts(2)
    a, b = net[0], net[1]
    path = {"PATH": f"{bindir}:{a.env()['PATH']}"}
    master = a.popen(["sh", "-c", _line("mooncake_master ", a, b)], env=path,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = f"http://{a.address}:9003"
    # The storage process needs the master up: start it once A's HTTP endpoint answers.
    ready = _python(b, WAIT_FOR, metrics, "20", "up")
    assert ready.returncode == 0, ready.stderr
    storage = a.popen(["sh", "-c", _line("MC_TCP_BIND_ADDRESS=", a, b)], env=path,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready = _python(b, WAIT_FOR, metrics, "30", "storage")
    assert ready.returncode == 0, ready.stderr
    (segment,) = [s["segment_name"] for s in json.loads(ready.stdout)["segments"]]
    assert segment.startswith(f"{a.address}:")
    watcher = a.popen([sys.executable, "-c", WATCH_SEGMENTS, metrics])
    try:
        target = a.popen(["sh", "-c", _line("kvctl bench transfer ", a, b) + " --json"])
        read_json_doc(target, timeout_s=60)
        runbook = _line("MOONCAKE_MASTER=", a, b)
        assert runbook == (f"MOONCAKE_MASTER={a.address}:50051 MOONCAKE_BENCH_PEER="
                           f"{a.address}:7400 kvctl runbook "
                           "examples/runbooks/mooncake-cluster.yaml")
        done = b.sh(runbook + " --json", timeout=300)
        status = b.sh(_line("kvctl store status ", a, b) + " --json", timeout=60)
    finally:
        seen, _ = stop(watcher)
    assert master.poll() is None
    assert storage.poll() is None

    assert done.stdout, done.stderr
    found: dict[str, dict[str, Any]] = {r["check"]: r for r in json.loads(done.stdout)["results"]}
    for check in ("storage", "client-only", "single", "batch", "concurrent", "exists-remove",
                  "cleanup"):
        assert found[f"mooncake store: {check}"]["verdict"] == "pass", (check, found)
    assert segment in found["mooncake store: storage"]["measured"]
    assert f"objects were on segment(s) {segment} (" in found["mooncake store: cleanup"][
        "measured"]
    # The transfer step crossed to host A's Mooncake target, over tcp, verified.
    transfer = [r for name, r in found.items() if name.startswith("mooncake transfer: ")]
    assert len(transfer) == 4, found
    for row in transfer:
        assert row["verdict"] == "pass", row
        assert row["measured"].endswith(", verified")
        assert a.address in row["details"]["path"], row
        assert row["details"]["transport"] == "tcp", row

    # Host B mounted nothing into A's pool at any moment, and left no key behind.
    assert seen.decode().split() == [segment], seen
    keys = _python(b, ALL_KEYS, metrics)
    assert keys.returncode == 0, keys.stderr
    assert not [k for k in keys.stdout.split() if k.startswith("smoke/")]

    assert status.returncode == 0, status.stdout + status.stderr
    doc = json.loads(status.stdout)
    assert doc["kind"] == "store.status"
    assert doc["backend"] == "mooncake"
    assert doc["health"] == "ok"
    assert doc["capacity_bytes"] == 4 << 30
    assert [s["name"] for s in doc["segments"]] == [segment]
    assert shlex.split(_line("kvctl store status ", a, b))[-1] == f"{a.address}:50051"
