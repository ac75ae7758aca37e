"""A cluster on namespaced hosts: etcd on the first host, ``kvctl agent`` on every host.

The commands are docs/cluster.md's, as written there for the tests (only the addresses
change: ``10.0.0.N`` is namespaced host N); :data:`ETCD` and :data:`AGENT` are checked
against the page by ``test_the_docs_show_the_commands_the_tests_run``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tests.fixtures.hosts import read_json_doc, stop
from tests.fixtures.nshosts import REPO, Host, HostNet

DOC = REPO / "docs" / "cluster.md"
ETCD = ("etcd --data-dir /tmp/kvctl-etcd --listen-client-urls http://10.0.0.1:2379 "
        "--advertise-client-urls http://10.0.0.1:2379")
AGENT = "kvctl agent --metadata etcd://10.0.0.1:2379 --ttl 3s --poll 0.2s"
#: The sweep of each pair in the tests: small blocks, short timed phases.
SWEEP = ["--block-size", "64KiB", "--batch-size", "4", "--duration", "0.4s",
         "--warmup", "1"]
TTL_S = 3.0
#: Token bucket of a shaped link: 40 ms at 50 Mbit/s.
BURST_BYTES = 256 << 10


def doc_line(text: str, net: HostNet) -> list[str]:
    """A documented command with the docs' addresses replaced by the hosts' own."""
    return shlex.split(text.replace("10.0.0.1", net[0].address))


class NsCluster:
    """etcd on host 1 and an agent per host; :meth:`close` stops everything."""

    def __init__(self, net: HostNet, *, agents: Sequence[int] | None = None) -> None:
        self.net = net
        self.url = f"etcd://{net[0].address}:2379"
        self.etcd = net[0].popen(doc_line(ETCD, net), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        self._wait_etcd()
        self.agents: dict[tuple[int, str], subprocess.Popen[bytes]] = {}
        started = [(i, self.spawn_agent(i)) for i in
                   (agents if agents is not None else range(len(net)))]
        for index, proc in started:  # started together, waited for one by one
            read_json_doc(proc, timeout_s=60)
            self.agents[(index, "")] = proc

    def _wait_etcd(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.etcd.poll() is not None:
                raise AssertionError(f"etcd exited {self.etcd.returncode}")
            done = self.net[0].run(["python3", "-c", (
                "import urllib.request,sys;"
                f"urllib.request.urlopen('http://{self.net[0].address}:2379/health',"
                "timeout=1);")], timeout=10)
            if done.returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError("etcd did not come up")

    def host(self, index: int) -> Host:
        return self.net[index]

    def spawn_agent(self, index: int, *, env: Mapping[str, str] | None = None,
                    cluster: str = "") -> subprocess.Popen[bytes]:
        """Start host ``index``'s agent (its registration is its first JSON document)."""
        extra = {"KVCTL_CLUSTER_ID": cluster} if cluster else {}
        return self.net[index].popen([*doc_line(AGENT, self.net), "--json"],
                                     env={**extra, **(env or {})})

    def start_agent(self, index: int, *, env: Mapping[str, str] | None = None,
                    cluster: str = "") -> subprocess.Popen[bytes]:
        """Start host ``index``'s agent and wait until it has registered."""
        proc = self.spawn_agent(index, env=env, cluster=cluster)
        read_json_doc(proc, timeout_s=30)
        self.agents[(index, cluster)] = proc
        return proc

    def stop_agent(self, index: int, cluster: str = "") -> None:
        proc = self.agents.pop((index, cluster), None)
        if proc is not None:
            stop(proc)

    def kvctl(self, index: int, args: Sequence[str], *, env: Mapping[str, str] | None = None,
              timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        """``kvctl ARGS --metadata URL`` on host ``index``, to completion."""
        return self.net[index].run(["kvctl", *args, "--metadata", self.url], env=env,
                                   timeout=timeout)

    def shape(self, rates_mbit: Mapping[int, float], *, burst_bytes: int = BURST_BYTES
              ) -> None:
        """Each host's link at its rate, both directions (``tc tbf`` as
        :meth:`Host.shape`, with a bucket of ``burst_bytes``: a sender the shared CPUs hold
        up for a few milliseconds catches up instead of losing that time)."""
        for host in self.net:
            rate = rates_mbit.get(host.index)
            for ns, dev in ((host.netns, "eth0"), (host.switch_ns, host.switch_port)):
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, check=False)
                if rate is not None:
                    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                                    "handle", "10:", "tbf", "rate", f"{rate}mbit", "burst",
                                    str(burst_bytes), "latency", "200ms"],
                                   capture_output=True, check=True)

    def close(self) -> None:
        for key in list(self.agents):
            self.stop_agent(*key)
        stop(self.etcd)


def bench_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON document of a ``cluster bench --json`` run (with its exit code)."""
    try:
        doc: dict[str, Any] = json.loads(done.stdout)
    except ValueError as exc:
        raise AssertionError(f"exit {done.returncode}; stdout {done.stdout[-2000:]!r}; "
                             f"stderr {done.stderr[-3000:]}") from exc
    doc["exit_code"] = done.returncode
    doc["stderr"] = done.stderr
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.cluster.nscluster figures DIR``: the run docs/cluster.md shows.

    Five namespaced hosts at 50 Mbit/s, h3 at a quarter of that; writes the bench's table
    (``cluster-bench.txt``), JSON (``cluster-bench.json``) and heatmap (``cluster-heatmap.png``)
    into DIR. Needs root, iproute2 and etcd, as the tests do.
    """
    import sys
    import tempfile
    from pathlib import Path

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "figures":
        sys.stderr.write("usage: python -m tests.cluster.nscluster figures DIR\n")
        return 2
    out = Path(args[1]).resolve()
    with tempfile.TemporaryDirectory() as tmp, HostNet(5, Path(tmp), shared=out) as net:
        cluster = NsCluster(net)
        try:
            cluster.shape({i: 12.5 if i == 2 else 50 for i in range(5)})
            table = cluster.kvctl(0, ["cluster", "bench", *SWEEP,
                                      "--plot", str(out / "cluster-heatmap.png")])
            (out / "cluster-bench.txt").write_text(table.stdout + table.stderr)
            doc = cluster.kvctl(0, ["cluster", "bench", *SWEEP, "--json"])
            (out / "cluster-bench.json").write_text(doc.stdout)
        finally:
            cluster.close()
    sys.stdout.write(table.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
