"""``kvctl store serve`` on etcd state, which leads at once or refuses (standby.lead_now),
against etcd stopped at its start, serves racing for one state, a SIGKILLed serve and
an etcd stall while an elected master stands by.

A refused serve logged "standby; leader is ...; taking over once its lease expires"
right before its Error: it never stands by. Real etcd and processes, a 3 s lease.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.leader import read_leader
from tests.fixtures.servers import ServerProcess, free_port
from tests.reliability.conftest import ROOT, wait_for
from tests.reliability.test_ha import TTL_S, Proc, procs  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration


def _env() -> dict[str, str]:
    return {"KVCTL_CLUSTER_ID": f"hx-serve-{secrets.token_hex(4)}",
            "KVCTL_STORE_HA_TTL": str(TTL_S)}


def _serve_argv(etcd_url: str) -> list[str]:
    return [sys.executable, "-m", "kvctl", "store", "serve", "--listen",
            f"127.0.0.1:{free_port()}", "--state", etcd_url, "--capacity", "16MiB"]


def _serve_to_end(etcd_url: str, env: dict[str, str], timeout_s: float = 60
                  ) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(_serve_argv(etcd_url), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, check=False, env={**os.environ, **env})
    return done, time.monotonic() - started


def test_a_refused_serve_names_the_leader_and_says_nothing_of_standing_by(
        etcd_url: str, procs: Callable[..., Proc]) -> None:  # noqa: F811
    env = _env()
    master = procs("master", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                   env=env)
    card = master.wait_card()
    refused, _ = _serve_to_end(etcd_url, env)
    assert refused.returncode == 3, refused.stderr
    assert str(card["master"]) in refused.stderr
    assert "Error:" in refused.stderr
    assert "Hint:" in refused.stderr
    assert "standby" not in refused.stderr, refused.stderr
    assert f"until its {TTL_S:g} s lease runs out" in refused.stderr  # a dead leader's


def test_serve_on_a_stopped_etcd_exits_with_an_error_in_bounded_time(
        spawn_etcd: Callable[[], ServerProcess]) -> None:
    etcd = spawn_etcd()
    pid = etcd._proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        refused, took = _serve_to_end(etcd.url, _env())
    finally:
        os.kill(pid, signal.SIGCONT)
    assert refused.returncode == 3, refused.stderr
    assert took < 30
    assert "cannot take the lead" in refused.stderr
    assert "Hint:" in refused.stderr


def test_serves_racing_for_one_state_one_leads(etcd_url: str) -> None:
    env = _env()
    racers = [subprocess.Popen([*_serve_argv(etcd_url), "--json"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, **env}) for _ in range(3)]
    try:
        wait_for(lambda: sum(r.poll() is not None for r in racers) >= 2, timeout_s=40,
                 what="two of three serves refused")
        time.sleep(1)
        alive = [r for r in racers if r.poll() is None]
        assert len(alive) == 1
        assert sorted(r.returncode for r in racers if r not in alive) == [3, 3]
        info = read_leader(etcd_url, cluster_id=env["KVCTL_CLUSTER_ID"])
        assert info is not None
        assert info.pid == alive[0].pid
    finally:
        for r in racers:
            if r.poll() is None:
                r.kill()
            r.wait(10)


def test_a_sigkilled_serves_acknowledged_puts_are_in_the_state_the_standby_leads(
        etcd_url: str, procs: Callable[..., Proc]) -> None:  # noqa: F811
    env = _env()
    serve = procs("serve", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                  "--capacity", "16MiB", env=env)
    address = str(serve.wait_card()["master"])
    with StoreClient(address, timeout_s=5) as client:
        for i in range(20):
            client.put(f"k{i}", bytes([i]) * 3000)
    standby = procs("master", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                    env=env)
    wait_for(lambda: "standby; leader is" in standby.log, timeout_s=20, what="standby")
    serve.proc.send_signal(signal.SIGKILL)
    serve.proc.wait(10)
    card = standby.wait_card(3 * TTL_S + 10)  # at once: the leader's pid is gone here
    with StoreClient(str(card["master"]), timeout_s=5) as client:
        assert client.batch_exists([f"k{i}" for i in range(20)]) == [True] * 20
        # Their bytes died with serve's node: an error that says so, never bytes.
        with pytest.raises(StoreUnavailableError):
            client.get("k3")


def test_a_listener_registered_after_the_leadership_ended_is_told_at_once(
        etcd_url: str) -> None:
    """store serve registers its on_deposed listener after starting its node: deposed
    before that (etcd stalled past the lease while the node started, another master
    claimed), the listener was never called and serve went on running deposed."""
    from kvctl.store.master.election import Election

    election = Election(etcd_url, address="127.0.0.1:1", cluster_id=_env()["KVCTL_CLUSTER_ID"],
                        ttl_s=TTL_S)
    try:
        assert election.try_once(standby=False)
        early: list[str] = []
        election.on_deposed(early.append)
        election.depose("another master claimed")
        election.depose("again")  # once only
        late: list[str] = []
        election.on_deposed(late.append)
        assert early == ["another master claimed"]
        assert late == ["another master claimed"]
    finally:
        election.close()


def test_a_sigkilled_serves_puts_with_tier_copies_are_read_from_them_after_takeover(
        etcd_url: str, procs: Callable[..., Proc], tmp_path: Path) -> None:  # noqa: F811
    """Acknowledged puts outlive a SIGKILLed serve when the shared tier holds them: the
    master that takes over the state reads the same directory and clients get the bytes."""
    env = _env()
    tier = str(tmp_path / "tier")
    serve = procs("serve", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                  "--capacity", "16MiB", "--shared-tier", tier, "--shared-tier-policy",
                  "write-through", env=env)
    values = {f"k{i}": os.urandom(5000 + i) for i in range(12)}
    with StoreClient(str(serve.wait_card()["master"]), timeout_s=5) as client:
        client.batch_put(list(values.items()))
        wait_for(lambda: all("shared" in client.stat(k).tier for k in values),
                 timeout_s=20, what="write-through copies")
    standby = procs("master", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd_url,
                    "--shared-tier", tier, env=env)
    wait_for(lambda: "standby; leader is" in standby.log, timeout_s=20, what="standby")
    serve.proc.send_signal(signal.SIGKILL)
    serve.proc.wait(10)
    card = standby.wait_card(3 * TTL_S + 10)
    with StoreClient(str(card["master"]), timeout_s=5) as client:
        assert client.batch_get(list(values)) == list(values.values())


def test_a_put_refused_during_an_etcd_stall_says_the_master_keeps_it(
        spawn_etcd: Callable[[], ServerProcess], procs: Callable[..., Proc]  # noqa: F811
        ) -> None:
    """etcd SIGSTOPped past serve's lease while a master stands by: a put meanwhile is not
    acknowledged, and its error says the master keeps it. It said 'takes no writes' (the
    answer of a second try through the master), though the first was recorded and became
    durable once etcd answered. Then either serve leads on (nobody claimed in time) or
    the standby takes over and serve exits 3, deposed; the state holds every put."""
    from kvctl.store.state.writebehind import read_state

    etcd = spawn_etcd()
    pid = etcd._proc.pid  # type: ignore[union-attr]
    env = _env()
    serve = procs("serve", "--listen", f"127.0.0.1:{free_port()}", "--state", etcd.url,
                  "--capacity", "16MiB", env=env)
    with StoreClient(str(serve.wait_card()["master"]), timeout_s=5) as client:
        for i in range(5):
            client.put(f"k{i}", b"v" * 1000)
        standby = procs("master", "--listen", f"127.0.0.1:{free_port()}", "--state",
                        etcd.url, env=env)
        wait_for(lambda: "standby; leader is" in standby.log, timeout_s=20, what="standby")
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(TTL_S + 1)
            with pytest.raises(StoreUnavailableError) as refused:
                client.put("during", b"x" * 1000)
            assert "it is written once the service takes it" in refused.value.cause
            assert "takes no writes" not in refused.value.cause
        finally:
            os.kill(pid, signal.SIGCONT)
    want = {f"k{i}" for i in range(5)} | {"during"}
    wait_for(lambda: want <= {o.key for o in read_state(
        etcd.url, cluster_id=env["KVCTL_CLUSTER_ID"]).objects}, timeout_s=20,
        what="every put in etcd")
    time.sleep(TTL_S)
    if standby.card is not None:  # the standby claimed first: serve stops, deposed
        wait_for(lambda: serve.proc.poll() is not None, timeout_s=3 * TTL_S + 10,
                 what="serve exiting, deposed")
        assert serve.proc.returncode == 3, serve.log[-2000:]
        assert "deposed" in serve.log
    else:
        assert serve.proc.poll() is None, serve.log[-2000:]
