"""Agents and the coordinator on a real etcd, following it through its watch: jobs still
reach agents after etcd restarts, with its data or without it (a new, empty etcd)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import msgspec
import pytest

from kvctl.cluster.agent import Agent, JobContext
from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.protocol import DONE, KEYS, ClusterKeys, KeysParams
from kvctl.transfer.metadata import MetadataClient, open_metadata
from tests.cluster.test_protocol import record
from tests.fixtures.servers import ServerProcess

pytestmark = pytest.mark.integration


def echo(ctx: JobContext) -> None:
    ctx.params(KeysParams)


def one_job(client: MetadataClient, keys: ClusterKeys, host: str) -> float:
    """Post one job; seconds until its ``done`` status was seen."""
    with Coordinator(client, keys, token=None, ttl_s=3.0, poll_s=0.5) as coord:
        started = time.monotonic()
        ref = coord.submit(host, KEYS, KeysParams(profile="p", prompts_jsonl=""), hold_s=10)
        coord.wait([ref], timeout_s=20.0)
        assert ref.state == DONE, ref.error()
        return time.monotonic() - started


@pytest.mark.parametrize("wipe", [False, True], ids=["restart", "restart-empty"])
def test_jobs_reach_agents_after_etcd_restarts(spawn_etcd: Callable[[], ServerProcess],
                                               wipe: bool) -> None:
    server = spawn_etcd()
    cluster = f"w{secrets.token_hex(3)}"
    keys = ClusterKeys(cluster)
    # a poll every 30 s: only the watch can bring the jobs in time
    host = msgspec.structs.replace(record("h1", ttl_s=2.0), poll_s=30.0)
    with open_metadata(server.url, timeout_s=1.0) as client:
        agent = Agent(client, host, handlers={KEYS: echo}, cluster_id=cluster).start()
        try:
            assert one_job(client, keys, "h1") < 1.0
            server.restart(wipe=wipe)
            deadline = time.monotonic() + 20
            while not agent.healthy and time.monotonic() < deadline:
                time.sleep(0.1)  # the keeper re-registers (a wiped etcd lost the lease)
            time.sleep(0.5)
            assert one_job(client, keys, "h1") < 5.0
        finally:
            agent.close()
