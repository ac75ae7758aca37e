"""Helpers of the cluster-job attacks: a real agent (stand-in work) on the test etcd.

``python -m tests.reliability.cluster_jobs --runs 2`` measures a genuine job behind
:data:`JUNK` junk jobs (and on an idle agent) against an etcd of its own: the figures of
docs/reliability.md ("Junk cluster jobs").

Each test takes a cluster id of its own, so the shared etcd of the worker keeps them apart.
The helpers work on the kvctl before issue 27 too (features it lacks are looked up, not
assumed), so the same tests measure the attacks before and after the fix.
"""

from __future__ import annotations

import inspect
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from kvctl.cluster.agent import Agent, JobContext
from kvctl.cluster.protocol import (
    KEYS,
    TARGET,
    ClusterKeys,
    HostRecord,
    Job,
    KeysParams,
    TargetReady,
    raw,
    seal,
)
from kvctl.metadata import MetadataClient

TOKEN = "cluster-jobs-attack-token-1"
PARAMS = KeysParams(profile="vllm", prompts_jsonl="")
#: Junk jobs of the flood (issue 27 item 3).
JUNK = 3000


class Work:
    """Stand-in handlers that count what they ran and when it started."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []  # (job id, time.monotonic())
        self.ended: list[str] = []
        self.lock = threading.Lock()

    def keys(self, ctx: JobContext) -> dict[str, Any]:
        with self.lock:
            self.started.append((ctx.job.job_id, time.monotonic()))
        return {"ok": True}

    def target(self, ctx: JobContext) -> None:
        with self.lock:
            self.started.append((ctx.job.job_id, time.monotonic()))
        try:
            ctx.ready(TargetReady(peer="127.0.0.1:9", address="127.0.0.1", engines=["kvctl"]))
            ctx.hold()
        finally:
            with self.lock:
                self.ended.append(ctx.job.job_id)

    def runs(self, job_id: str) -> int:
        with self.lock:
            return sum(1 for j, _ in self.started if j == job_id)

    def handlers(self) -> dict[str, Callable[[JobContext], Any]]:
        return {KEYS: self.keys, TARGET: self.target}


def new_cluster() -> tuple[str, ClusterKeys]:
    """A cluster id of the test's own, and its keys."""
    cluster_id = f"attack{secrets.token_hex(4)}"
    return cluster_id, ClusterKeys(cluster_id)


def record(name: str) -> HostRecord:
    return HostRecord(hostname=name, agent_id=secrets.token_hex(6), version="0.1.0", pid=1,
                      started_at=time.time(), address="127.0.0.1", addresses=["127.0.0.1"],
                      lease_ttl_s=5.0, poll_s=0.05)


def start_agent(client: MetadataClient, cluster_id: str, name: str, work: Work, *,
                token: str | None = TOKEN, clock_skew_s: float | None = None) -> Agent:
    extra: dict[str, Any] = {}
    if clock_skew_s is not None and "clock_skew_s" in inspect.signature(Agent).parameters:
        extra["clock_skew_s"] = clock_skew_s
    return Agent(client, record(name), handlers=work.handlers(), token=token,
                 cluster_id=cluster_id, **extra).start()


def dropped(agent: Agent) -> int:
    """Jobs the agent left unanswered (refused ones, on a kvctl without drops)."""
    return int(getattr(agent, "dropped", 0)) + int(agent.refused)


def statuses(client: MetadataClient, keys: ClusterKeys) -> dict[str, bytes]:
    return client.list(keys.root + "status/")


def junk_job(keys_root: str, i: int, host: str) -> tuple[str, bytes]:
    """Junk job ``i``: a third each unsigned, signed with a made-up token, not a document."""
    key = f"{keys_root}jobs/{host}/junk-{i}"
    job = Job(job_id=f"junk-{i}", run_id="junk", kind=KEYS, host=host, issued_at=0.0,
              hold_s=3600.0, params=raw(PARAMS))
    if i % 3 == 0:
        return key, seal(key, "job", job, None)
    if i % 3 == 1:
        return key, seal(key, "job", job, "a-token-the-attacker-made-up")
    return key, b"\x00junk" * (i % 7 + 1)


def _started_ms(work: Work, job_id: str, posted: float) -> float:
    return (dict(work.started)[job_id] - posted) * 1000


def _measure(client: MetadataClient, runs: int) -> list[str]:
    from kvctl.cluster.coordinator import Coordinator

    lines = []
    for n in range(runs):
        cluster_id, keys = new_cluster()
        work = Work()
        agent = start_agent(client, cluster_id, "h0", work)
        try:
            with Coordinator(client, keys, token=TOKEN, ttl_s=5.0, poll_s=0.05) as coord:
                for i in range(JUNK):
                    client.put(*junk_job(keys.root, i, "h0"))
                posted = time.monotonic()
                ref = coord.submit("h0", KEYS, PARAMS, hold_s=120.0)
                coord.wait([ref], timeout_s=120.0)
                junk = len(statuses(client, keys)) - 1
                late = (f"{_started_ms(work, ref.job_id, posted):.1f}" if work.runs(ref.job_id)
                        else "never")
            idle = []
            with Coordinator(client, keys, token=TOKEN, ttl_s=5.0, poll_s=0.05) as coord:
                for _ in range(10):
                    posted = time.monotonic()
                    ref = coord.submit("h0", KEYS, PARAMS, hold_s=10.0)
                    coord.wait([ref], timeout_s=10.0)
                    idle.append(_started_ms(work, ref.job_id, posted))
                    coord.cancel([ref])
            lines.append(f"run {n}: genuine job started {late} ms after {JUNK} junk jobs; "
                         f"{junk} junk statuses; idle agent median "
                         f"{sorted(idle)[len(idle) // 2]:.1f} ms")
        finally:
            agent.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    import tempfile
    from pathlib import Path

    from kvctl.metadata import open_metadata
    from tests.fixtures.servers import make_etcd

    parser = argparse.ArgumentParser(description="a genuine job behind junk jobs")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = make_etcd(Path(tmp))
        server.start()
        try:
            client = open_metadata(server.url)
            try:
                for line in _measure(client, args.runs):
                    sys.stdout.write(line + "\n")
            finally:
                client.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
