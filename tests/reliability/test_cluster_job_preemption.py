"""Pre-empted cluster jobs: a forgery written first at a job's key cannot shadow the genuine
job that lands there next.

Issue 27, item 2: job keys were predictable (``<run>-<seq>``) and the agent marked a job
id handled by the id alone, so a tokenless write of an unsigned job at the key of a
client's next job made the agent publish a *signed* ``refused`` for the client's run and
never run the genuine job. The agent now judges each value at a key (by its fingerprint,
which covers the signature), drops the forgery without an answer, and starts the genuine
job when it lands; job ids carry 64 random bits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

import kvctl.cluster.coordinator as coordinator_module
from kvctl.cluster.coordinator import Coordinator
from kvctl.cluster.protocol import DONE, KEYS, Job, KeysParams, raw, seal
from kvctl.metadata import MetadataClient, open_metadata
from tests.reliability.cluster_jobs import TOKEN, Work, dropped, new_cluster, start_agent
from tests.reliability.conftest import wait_for

pytestmark = pytest.mark.integration

PARAMS = KeysParams(profile="vllm", prompts_jsonl="")


@pytest.fixture
def etcd(etcd_url: str) -> Iterator[MetadataClient]:
    client = open_metadata(etcd_url)
    yield client
    client.close()


def test_a_forgery_at_the_next_jobs_key_does_not_shadow_it(
        etcd: MetadataClient, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster_id, keys = new_cluster()
    work = Work()
    agent = start_agent(etcd, cluster_id, "h0", work)
    run_id = "preempted"
    # the attacker knows the next job's id (as it could before: <run>-<seq>)
    monkeypatch.setattr(coordinator_module, "new_job_id", lambda run: f"{run}-1", raising=False)
    job_id = f"{run_id}-1"
    key = keys.job("h0", job_id)
    try:
        with Coordinator(etcd, keys, token=TOKEN, ttl_s=2.0, poll_s=0.05,
                         run_id=run_id) as coord:
            forged = Job(job_id=job_id, run_id=run_id, kind=KEYS, host="h0", issued_at=0.0,
                         hold_s=5.0, params=raw(PARAMS))
            seen = dropped(agent)
            etcd.put(key, seal(key, "job", forged, None))  # unsigned, written first
            wait_for(lambda: dropped(agent) > seen, timeout_s=5.0,
                     what="the agent to judge the forgery")
            ref = coord.submit("h0", KEYS, PARAMS, hold_s=30.0)  # lands on the forgery
            assert ref.key == key
            coord.wait([ref], timeout_s=10.0)
            assert ref.state == DONE, ref.error()
            assert work.runs(job_id) == 1
    finally:
        agent.close()


def test_job_ids_cannot_be_guessed(etcd: MetadataClient) -> None:
    _, keys = new_cluster()
    with Coordinator(etcd, keys, token=None, ttl_s=2.0, poll_s=0.05) as coord:
        assert re.fullmatch(r"[0-9a-f]{16}", coord.run_id)
        refs = [coord.submit("nobody", KEYS, PARAMS, hold_s=1.0) for _ in range(3)]
        coord.cancel(refs)
    tails = [r.job_id.removeprefix(f"{coord.run_id}-") for r in refs]
    assert all(re.fullmatch(r"[0-9a-f]{16}", t) for t in tails), tails
    assert len(set(tails)) == 3
