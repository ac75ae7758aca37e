"""Replayed cluster jobs: a signed job copied back after its run ended never runs again.

Issue 27, item 1: a party with read/write access to the metadata service but no token
copied a signed job it saw back to its key after the run ended, and 3 of 3 copies ran again
(each answered by a signed ``done``); a copied serving job stayed up for its whole hold
time. A job is now bound to its run: its signed body names the run's nonce and an expiry,
the agent starts it only while the run's signed, renewed record is live, never starts the
same value twice, and stops a running job whose run record is gone.

All against the real etcd the tests start (``etcd_url``), an agent with the token, stand-in
work (:mod:`tests.reliability.cluster_jobs`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.protocol import DONE, KEYS, READY, TARGET, KeysParams, TargetParams
from kvctl.metadata import MetadataClient, open_metadata
from tests.reliability.cluster_jobs import TOKEN, Work, dropped, new_cluster, start_agent, statuses
from tests.reliability.conftest import wait_for

pytestmark = pytest.mark.integration

PARAMS = KeysParams(profile="vllm", prompts_jsonl="")
REPLAYS = 3


@pytest.fixture
def etcd(etcd_url: str) -> Iterator[MetadataClient]:
    client = open_metadata(etcd_url)
    yield client
    client.close()


def _settle(agent: object, work: Work, job_id: str, runs: int, seen: int) -> None:
    """Wait until the agent judged the copy: it ran it again, or left it unanswered."""
    wait_for(lambda: work.runs(job_id) > runs or dropped(agent) > seen,  # type: ignore[arg-type]
             timeout_s=5.0, what="the agent to judge the copied job")


def test_a_job_copied_back_after_its_run_ended_never_runs_again(etcd: MetadataClient) -> None:
    cluster_id, keys = new_cluster()
    work = Work()
    agent = start_agent(etcd, cluster_id, "h0", work)
    try:
        with Coordinator(etcd, keys, token=TOKEN, ttl_s=2.0, poll_s=0.05) as coord:
            ref = coord.submit("h0", KEYS, PARAMS, hold_s=30.0)
            coord.wait([ref], timeout_s=10.0)
            assert ref.state == DONE, ref.error()
            copied = etcd.get(ref.key)
            assert copied is not None
            coord.cancel([ref])
            wait_for(lambda: not statuses(etcd, keys), timeout_s=5.0,
                     what="the agent to withdraw the status")
        for _ in range(REPLAYS):  # the run is over: copy the signed job back, three times
            runs, seen = work.runs(ref.job_id), dropped(agent)
            etcd.put(ref.key, copied)
            _settle(agent, work, ref.job_id, runs, seen)
            etcd.delete(ref.key)
        # ... and at another job id, and for another host (the signature names the key)
        other = keys.job("h0", ref.job_id + "0")
        seen = dropped(agent)
        etcd.put(other, copied)
        wait_for(lambda: dropped(agent) > seen or len(work.started) > 1, timeout_s=5.0,
                 what="the agent to judge the job at another key")
        etcd.delete(other)
        assert work.runs(ref.job_id) == 1, f"{work.runs(ref.job_id) - 1} of {REPLAYS} ran again"
        assert len(work.started) == 1
        assert statuses(etcd, keys) == {}  # no status, signed or not, for any copy
    finally:
        agent.close()


def test_a_copy_of_the_job_and_its_run_record_expires(etcd: MetadataClient) -> None:
    """An agent restarted after the run (it remembers nothing) still refuses the copies,
    even with the run's last record copied back too: that record expired."""
    cluster_id, keys = new_cluster()
    work = Work()
    agent = start_agent(etcd, cluster_id, "h0", work, clock_skew_s=0.2)
    try:
        with Coordinator(etcd, keys, token=TOKEN, ttl_s=1.0, poll_s=0.05) as coord:
            ref = coord.submit("h0", KEYS, PARAMS, hold_s=30.0)  # the job itself not expired
            coord.wait([ref], timeout_s=10.0)
            assert ref.state == DONE, ref.error()
            copied = etcd.get(ref.key)
            run_key = keys.root + f"runs/{coord.run_id}"
            run_copy = etcd.get(run_key)
            assert copied is not None
        agent.close()
        if run_copy is not None:  # the copied record's own expiry passes
            expires_at = json.loads(run_copy)["body"]["expires_at"]
            wait_for(lambda: time.time() > expires_at + 0.3, timeout_s=5.0,
                     what="the copied run record to expire")
        agent = start_agent(etcd, cluster_id, "h0", work, clock_skew_s=0.2)
        if run_copy is not None:
            etcd.put(run_key, run_copy)
        seen = dropped(agent)
        etcd.put(ref.key, copied)
        _settle(agent, work, ref.job_id, 1, seen)
        assert work.runs(ref.job_id) == 1
        assert statuses(etcd, keys) == {}
    finally:
        agent.close()


def test_a_serving_job_whose_run_is_gone_is_stopped(etcd: MetadataClient) -> None:
    """The job's key is re-put without the run's lease (so it outlives the run), then the
    run ends: the target stops within a run check, not after its 60 s hold."""
    cluster_id, keys = new_cluster()
    work = Work()
    agent = start_agent(etcd, cluster_id, "h0", work)
    try:
        coord = Coordinator(etcd, keys, token=TOKEN, ttl_s=2.0, poll_s=0.05).start()
        try:
            ref = coord.submit("h0", TARGET, TargetParams(region_bytes=4096, engines=["kvctl"],
                                                          transports=["tcp"]), hold_s=60.0)
            coord.wait([ref], want="ready", timeout_s=10.0)
            assert ref.state == READY, ref.error()
            value = etcd.get(ref.key)
            assert value is not None
            etcd.put(ref.key, value)  # same bytes, no lease: it stays after the run
        finally:
            coord.close()
        ended = time.monotonic()
        wait_for(lambda: ref.job_id in work.ended, timeout_s=8.0,
                 what="the agent to stop the serving job of a run that ended")
        assert time.monotonic() - ended < 8.0
        assert work.runs(ref.job_id) == 1
        assert etcd.get(ref.key) is not None  # it was the run, not the key, that stopped it
    finally:
        agent.close()
