"""Helpers of the cluster-job attacks: a real agent (stand-in work) on the test etcd.

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
from kvctl.cluster.protocol import KEYS, TARGET, ClusterKeys, HostRecord, TargetReady
from kvctl.metadata import MetadataClient

TOKEN = "cluster-jobs-attack-token-1"


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
