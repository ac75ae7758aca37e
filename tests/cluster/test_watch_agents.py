"""Agents and the coordinator on a real etcd, following it through its watch: jobs still
reach agents after etcd restarts, with its data or without it (a new, empty etcd), and a
dead client's jobs stop as soon as its lease expires."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable

import msgspec
import pytest

from kvctl.cluster.agent import Agent, JobContext
from kvctl.cluster.coordinator import WAIT_READY, Coordinator
from kvctl.cluster.protocol import (
    DONE,
    KEYS,
    READY,
    TARGET,
    ClusterKeys,
    KeysParams,
    TargetParams,
    TargetReady,
)
from kvctl.metadata import MetadataClient, MetadataError, open_metadata
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
            while time.monotonic() < deadline:  # the keeper re-registers (a wiped etcd
                with contextlib.suppress(MetadataError):  # lost the lease and the keys)
                    if client.get(keys.alive("h1")) is not None:
                        break
                time.sleep(0.1)
            assert one_job(client, keys, "h1") < 5.0
        finally:
            agent.close()


def test_a_dead_clients_serving_job_stops_when_its_lease_expires(
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    """etcd pushes the expiry of the client's lease as the job's deletion: the agent stops
    serving without waiting for a poll (it would poll every 30 s)."""
    server = spawn_etcd()
    ended = threading.Event()

    def serve(ctx: JobContext) -> None:
        ctx.ready(TargetReady(peer="x:1", address="x", engines=["kvctl"]))
        ctx.hold()
        ended.set()

    host = msgspec.structs.replace(record("h1", ttl_s=2.0), poll_s=30.0)
    with open_metadata(server.url, timeout_s=1.0) as client:
        agent = Agent(client, host, handlers={TARGET: serve}).start()
        try:
            coord = Coordinator(client, ClusterKeys(), token=None, ttl_s=2.0).start()
            ref = coord.submit("h1", TARGET, TargetParams(region_bytes=1, engines=["kvctl"],
                                                          transports=["tcp"]), hold_s=60)
            assert coord.wait([ref], want=WAIT_READY, timeout_s=10.0)
            assert ref.state == READY
            keeper = coord._keeper  # the client dies: its lease is no longer renewed
            assert keeper is not None
            keeper._stop.set()
            keeper._wake.set()
            died = time.monotonic()
            assert ended.wait(15.0)
            # etcd's whole-second TTL, and up to a second more (1.5 x the election timeout)
            assert time.monotonic() - died < 2.0 + 2.0 + 1.0
        finally:
            agent.close()
