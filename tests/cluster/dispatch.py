"""Job dispatch latency on namespaced hosts: etcd on host 1, ``kvctl agent`` on host 2, a
client on host 1 posting small jobs one at a time.

``python -m tests.cluster.dispatch [--jobs N] [--poll 0.5s] [--code DIR]`` prints, as JSON,
etcd's range reads per second while the agent sits idle (from etcd's own metrics) and, per
job: ``round_trip_ms`` (the client posts a ``keys`` job until it sees the agent's
``done`` status) and ``status_ms`` (post until the agent wrote that status: pickup plus the
small job itself, on the hosts' shared clock). ``--code DIR`` runs the agent and the client
from another checkout (``git worktree add DIR COMMIT``), to compare with the code before
watches. Needs root, iproute2 and etcd, as the tests do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.cluster.nscluster import NsCluster
from tests.fixtures.hosts import read_json_doc
from tests.fixtures.nshosts import HostNet

CLIENT = r"""
import json, sys, time
from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.protocol import KEYS, ClusterKeys, KeysParams
from kvctl.cluster.runbook import builtin_prompts
from kvctl.metadata import open_metadata

url, host, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
params = KeysParams(profile="kvctl:sha256", prompts_jsonl=builtin_prompts())
with open_metadata(url) as client, Coordinator(client, ClusterKeys(), token=None) as c:
    for i in range(count):
        posted = time.time()
        ref = c.submit(host, KEYS, params, hold_s=30)
        c.wait([ref], timeout_s=30)
        seen = time.time()
        ok = ref.status is not None and ref.status.state == "done"
        rows.append({"ok": ok, "round_trip_ms": (seen - posted) * 1e3,
                     "status_ms": ((ref.status.updated_at - posted) * 1e3) if ok else None})
        c.cancel([ref])
        time.sleep(0.05 + (i % 7) * 0.037)  # post at every phase of a poll
print(json.dumps(rows))
"""


def start_agent(cluster: NsCluster, index: int, poll: str,
                env: dict[str, str] | None = None) -> None:
    """An agent on host ``index`` polling (where it must) every ``poll``; waits until it
    has registered."""
    agent = cluster.net[index].popen(["kvctl", "agent", "--metadata", cluster.url, "--ttl",
                                      "10s", "--poll", poll, "--json"], env=env)
    cluster.agents[(index, "")] = agent
    read_json_doc(agent, timeout_s=60)


def post_jobs(cluster: NsCluster, client: int, agent: int, count: int,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``count`` keys jobs from host ``client`` to host ``agent``'s agent, one at a time."""
    done = cluster.net[client].run(["python3", "-c", CLIENT, cluster.url,
                                    cluster.net[agent].name, str(count)], env=env, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"client failed: {done.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


METRICS = r"""
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
def total(kind, method):
    return sum(float(m[3]) for m in re.finditer(
        r'^grpc_server_(handled|started)_total\{([^}]*)\} (\S+)$', text, re.M)
        if m[1] == kind and f'grpc_method="{method}"' in m[2] and 'etcdserverpb' in m[2])
print(total("handled", "Range"), total("started", "Watch"))
"""


def etcd_counts(cluster: NsCluster) -> tuple[float, float]:
    """etcd's count of range reads served and watch streams started so far."""
    done = cluster.net[0].run(["python3", "-c", METRICS,
                               f"http://{cluster.net[0].address}:2379/metrics"], timeout=30)
    ranges, watches = done.stdout.split()
    return float(ranges), float(watches)


def idle_reads(cluster: NsCluster, seconds: float) -> dict[str, float]:
    """Range reads and watch streams per second etcd serves while the agents sit idle."""
    import time

    before = etcd_counts(cluster)
    time.sleep(seconds)
    after = etcd_counts(cluster)
    return {"range_reads_per_s": round((after[0] - before[0]) / seconds, 1),
            "watch_streams_started_per_s": round((after[1] - before[1]) / seconds, 2)}


def summary(values: list[float]) -> dict[str, float]:
    """Median, p90 and max, in the unit given, to 0.1."""
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 1),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
            "max": round(ordered[-1], 1)}


def measure(count: int, poll: str, code: Path | None) -> dict[str, Any]:
    """Run the measurement on two fresh namespaced hosts."""
    env = {"PYTHONPATH": str(code)} if code is not None else None
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, HostNet(2, Path(tmp)) as net:
        cluster = NsCluster(net, agents=[])
        try:
            start_agent(cluster, 1, poll, env)
            idle = idle_reads(cluster, 10.0)
            rows = post_jobs(cluster, 0, 1, count, env)
        finally:
            cluster.close()
    trips = [r["round_trip_ms"] for r in rows if r["ok"]]
    status = [r["status_ms"] for r in rows if r["ok"]]
    return {"jobs": len(rows), "ok": len(trips), "agent_poll": poll,
            "code": str(code) if code else "this checkout",
            "round_trip_ms": summary(trips), "status_ms": summary(status),
            "idle_agent": idle}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.dispatch")
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--poll", default="0.5s", help="the agent's --poll")
    parser.add_argument("--code", type=Path, default=None, help="another checkout to run")
    args = parser.parse_args(argv)
    sys.stdout.write(json.dumps(measure(args.jobs, args.poll, args.code), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
