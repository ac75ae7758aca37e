"""An acknowledged put is durable, or it was never acknowledged.

A put returns only once the master has recorded it in its state (the commit or report asks
for an answer, ``ack``); a key the master does not take, or cannot record, fails the put;
a put that can never fit is refused before anything is evicted for it.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.errors import StoreFullError, StoreUnavailableError
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.node import StorageNode
from kvctl.store.rpc import MasterConnection
from kvctl.store.server import MasterServer
from kvctl.store.state import JournalState, NoState, journal
from tests.store.conftest import wait_for
from tests.store.test_master import Clock, node, put


class GatedState(NoState):
    """Keeps nothing, but acknowledges a change only once the test opens the gate (or
    answers ``problem``): stands for a slow or failing journal/etcd."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.problem: str | None = None
        self.waiting = 0
        self._local = threading.local()

    def put_object(self, record: object) -> None:  # type: ignore[override]
        self._local.dirty = True

    def delete_object(self, key: str) -> None:
        self._local.dirty = True

    def wait_for_key(self, key: str) -> None:  # a put of the same bytes waits like the first
        self._local.dirty = True

    def ack(self, timeout_s: float | None = None) -> str | None:
        if not getattr(self._local, "dirty", False):
            return None
        self._local.dirty = False
        self.waiting += 1
        self.gate.wait(10)
        self.waiting -= 1
        return self.problem


@pytest.fixture
def gated() -> Iterator[tuple[MasterServer, GatedState]]:
    state = GatedState()
    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=30), state=state))
    node_ = StorageNode(server.address, node_id="a", capacity_bytes=32 << 20, heartbeat_s=0.1)
    try:
        yield server, state
    finally:
        state.gate.set()
        node_.close()
        server.close()


@pytest.mark.parametrize("reserve_bytes", [16 << 20, 0], ids=["reservation", "master"])
def test_a_put_returns_only_once_its_commit_is_durable(
        gated: tuple[MasterServer, GatedState], reserve_bytes: int) -> None:
    """On the reservation path (PutAt) and the master path (Put + Commit) alike, ``put``
    waits for the state to take the change: before, the report and the commit had no
    answer and the put returned while the change was still on its way."""
    server, state = gated
    with StoreClient(server.address, reserve_bytes=reserve_bytes) as client:
        state.gate.set()
        client.put("warm", b"w" * 4096)  # connections, reservation, mappings
        state.gate.clear()
        done = threading.Event()

        def put() -> None:
            client.put("k", b"v" * 4096)
            done.set()

        t = threading.Thread(target=put, daemon=True)
        t.start()
        wait_for(lambda: state.waiting == 1, what="the master waiting for its state")
        time.sleep(0.2)
        assert not done.is_set(), "put returned before its commit was durable"
        state.gate.set()
        t.join(10)
        assert done.is_set()
        assert client.get("k") == b"v" * 4096


@pytest.mark.parametrize("reserve_bytes", [16 << 20, 0], ids=["reservation", "master"])
def test_a_put_the_state_cannot_record_fails(
        gated: tuple[MasterServer, GatedState], reserve_bytes: int) -> None:
    """The state refuses the change: the put raises, naming why (never an OK)."""
    server, state = gated
    with StoreClient(server.address, reserve_bytes=reserve_bytes, timeout_s=5) as client:
        state.gate.set()
        client.put("warm", b"w" * 4096)
        state.problem = "master state x: the change was not written (disk full)"
        with pytest.raises(StoreUnavailableError) as info:
            client.put("k", b"v" * 4096)
        assert "disk full" in info.value.cause


def test_commit_and_report_answers_name_the_keys_not_taken() -> None:
    """A commit of a put whose allocation is gone, a report for a reservation that is gone,
    and a report for keys outside the reservation's unused space each get an answer naming
    those keys (before, they had none: the master logged and dropped them)."""
    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=1e6)))
    conn = MasterConnection(server.address)
    try:
        assert isinstance(conn.call(p.RegisterNode(
            node_id="a", epoch="E", segment="seg", endpoint="127.0.0.1:1", host_id="h",
            capacity_bytes=1 << 26)), p.Ok)
        reply = conn.call(p.Put(items=[p.PutItem("good", 100, 1)]))
        assert isinstance(reply, p.PutReply)
        slot = reply.slots[0]
        assert isinstance(slot, p.PutSlot)
        answer = conn.call(p.Commit(keys=["gone", "good"], versions=[12345, slot.version],
                                    ack=True))
        assert isinstance(answer, p.Acked), answer
        assert answer.refused == [0]
        assert "not committed" in answer.errors[0].cause
        assert conn.call(p.Exists(keys=["good", "gone"])) == p.Bools(values=[True, False])
        # Committing it again (a retry) is not an error.
        assert isinstance(conn.call(p.Commit(keys=["good"], versions=[slot.version],
                                             ack=True)), p.Ok)

        answer = conn.call(p.PutAt(reservation=99, keys=["r"], sizes=[10], checksums=[1],
                                   offsets=[0], ack=True))
        assert isinstance(answer, p.Acked)
        assert answer.refused == [0]
        assert "gone" in answer.errors[0].cause
        grant = conn.call(p.Reserve(size=1 << 20))
        assert isinstance(grant, p.Reservation)
        answer = conn.call(p.PutAt(reservation=grant.reservation, keys=["in", "out"],
                                   sizes=[10, 10], checksums=[1, 2],
                                   offsets=[0, grant.locations[0].size + 4096], ack=True))
        assert isinstance(answer, p.Acked)
        assert answer.refused == [1]
        assert conn.call(p.Exists(keys=["in", "out"])) == p.Bools(values=[True, False])
    finally:
        conn.close()
        server.close()


def test_a_commit_onto_a_node_gone_suspect_is_refused_and_released() -> None:
    """The node holding a put's only replica stops answering while the put is written:
    the commit is refused (its bytes would be unreadable) and its space released."""
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=3.0), clock=clock)
    node(core, "a")
    slot = core.put(p.Put(items=[p.PutItem("k", 1000, 7)]))[0]
    assert isinstance(slot, p.PutSlot)
    for _ in range(20):  # 5 s of silence, observed by the master
        clock.now += 0.25
        core.tick()
    assert core.status().nodes[0].state == "suspect"
    refused = core.commit(p.Commit(keys=["k"], versions=[slot.version], ack=True))
    assert [i for i, _ in refused] == [0]
    assert refused[0][1].code == "busy"
    assert "a (suspect)" in refused[0][1].cause
    assert core.exists(["k"]) == [False]
    assert core.node_usage()["a"][0] == 0


def test_a_put_that_can_never_fit_is_refused_up_front_evicting_nothing() -> None:
    """40 MiB into 32 MiB nodes, 2**40 bytes from a tenant, or 2 replicas of what only one
    node could hold: refused at once with the sizes, and not one object evicted (before,
    all 200 were evicted, then the put was refused for "leased, pinned or pending")."""
    core = MasterCore(MasterConfig())
    node(core, "a", 32 << 20)
    node(core, "b", 64 << 20)
    for i in range(200):
        assert isinstance(put(core, f"o{i}", 128 << 10, replicas=2), p.PutSlot)
    evictions = core.status().evictions
    cases = [(p.PutItem("big", 80 << 20, 1), 1), (p.PutItem("alice/huge", 1 << 40, 1), 1),
             (p.PutItem("pair", 40 << 20, 1), 2)]
    for item, replicas in cases:
        slot = core.put(p.Put(items=[item], replicas=replicas))[0]
        assert isinstance(slot, p.ErrorInfo), slot
        assert slot.code == "full"
        assert "can never fit" in slot.cause, slot.cause
        assert "64 MiB" in slot.cause, slot.cause
        assert "leased" not in slot.cause
    assert core.status().evictions == evictions == 0
    assert core.exists([f"o{i}" for i in range(200)]) == [True] * 200


def test_the_client_says_why_a_put_can_never_fit(tmp_path: Path) -> None:
    server = MasterServer(MasterCore(MasterConfig()))
    node_ = StorageNode(server.address, node_id="a", capacity_bytes=32 << 20, heartbeat_s=0.1)
    try:
        with StoreClient(server.address) as client:
            for i in range(20):
                client.put(f"o{i}", bytes(1 << 20))
            with pytest.raises(StoreFullError) as info:
                client.put("big", bytes(40 << 20))
            assert "can never fit" in info.value.cause
            assert client.batch_exists([f"o{i}" for i in range(20)]) == [True] * 20
    finally:
        node_.close()
        server.close()


def test_the_journal_syncs_before_an_acknowledgement_and_shares_syncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every acknowledged change is fdatasync'ed first (a host crash loses nothing
    acknowledged); threads acknowledging at once share syncs; a failed sync fails the
    acknowledgement and stops writes until a snapshot, like a failed write."""
    synced: list[int] = []
    real = os.fdatasync
    fail = {"on": False}

    def fdatasync(fd: int) -> None:
        if fail["on"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        time.sleep(0.002)  # a disk's sync
        real(fd)
        synced.append(fd)

    monkeypatch.setattr(journal.os, "fdatasync", fdatasync)
    state = JournalState(tmp_path / "s")
    core = MasterCore(MasterConfig(node_timeout_s=1e6), state=state)
    node(core, "a", 1 << 26)
    assert state.ack() is None
    synced.clear()

    def put_acked(key: str) -> str | None:
        assert isinstance(put(core, key, 100), p.PutSlot)
        return state.ack()

    assert put_acked("one") is None
    assert len(synced) == 1
    errors: list[str | None] = []
    threads = [threading.Thread(target=lambda i=i: errors.extend(
        put_acked(f"t{i}-{j}") for j in range(20))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [None] * 160
    assert 1 <= len(synced) - 1 < 160, f"{len(synced) - 1} syncs for 160 acknowledgements"
    fail["on"] = True
    problem = put_acked("lost")
    assert problem is not None
    assert "Input/output error" in problem
    assert state.refusal() is not None
    fail["on"] = False
    core.close()
    restarted = MasterCore(state=JournalState(tmp_path / "s"))
    keys = ["one", *(f"t{i}-{j}" for i in range(8) for j in range(20))]
    assert restarted.exists(keys) == [True] * len(keys)
    restarted.close()


def test_a_tenants_answer_names_its_own_keys_by_their_index() -> None:
    """A tenant's commit or report naming keys outside its namespace: those are refused as
    ``forbidden`` by their index in the request it sent (the others are taken), so the
    answer never points at the wrong key."""
    from kvctl.store.tenants import parse_tenants

    server = MasterServer(MasterCore(MasterConfig(node_timeout_s=1e6)), token="admin-0123",
                          tenants=parse_tenants(["alpha=alpha-4567"]))
    admin = MasterConnection(server.address, token="admin-0123")
    alpha = MasterConnection(server.address, token="alpha-4567")
    try:
        assert isinstance(admin.call(p.RegisterNode(
            node_id="a", epoch="E", segment="seg", endpoint="127.0.0.1:1", host_id="h",
            capacity_bytes=1 << 26)), p.Ok)
        reply = alpha.call(p.Put(items=[p.PutItem("alpha/k", 100, 1)]))
        assert isinstance(reply, p.PutReply)
        slot = reply.slots[0]
        assert isinstance(slot, p.PutSlot)
        answer = alpha.call(p.Commit(keys=["beta/x", "alpha/k", "other"],
                                     versions=[1, slot.version, 2], ack=True))
        assert isinstance(answer, p.Acked), answer
        assert answer.refused == [0, 2]
        assert {e.code for e in answer.errors} == {"forbidden"}
        grant = alpha.call(p.Reserve(size=1 << 20))
        assert isinstance(grant, p.Reservation)
        answer = alpha.call(p.PutAt(reservation=grant.reservation, keys=["x", "alpha/r"],
                                    sizes=[10, 10], checksums=[1, 2], offsets=[0, 4096],
                                    ack=True))
        assert isinstance(answer, p.Acked), answer
        assert answer.refused == [0]
        assert admin.call(p.Exists(keys=["alpha/k", "alpha/r", "x"])) == p.Bools(
            values=[True, True, False])
    finally:
        alpha.close()
        admin.close()
        server.close()


def test_objects_of_every_master_run_survive_a_second_restart(tmp_path: Path) -> None:
    """Each master run the node registers with writes its record again (same epoch) into
    that run's journal segment; a later restore keeps the objects of the earlier runs on
    it (it replaced the node and dropped them all: the third run restored only the second
    run's objects, 480 of 3,888 acknowledged puts were lost after 3 SIGKILLs)."""
    keys: list[str] = []
    for run in range(3):
        core = MasterCore(MasterConfig(node_timeout_s=1e6), state=JournalState(tmp_path / "s"))
        assert core.exists(keys) == [True] * len(keys), f"run {run}"
        node(core, "a", 1 << 26)  # the same node, same epoch, registers again
        for i in range(10):
            assert isinstance(put(core, f"r{run}/{i}", 100), p.PutSlot)
            keys.append(f"r{run}/{i}")
        assert core.state.ack() is None
        core.close()
    core = MasterCore(state=JournalState(tmp_path / "s"))
    assert core.exists(keys) == [True] * 30
    assert core.stat("r0/0").replicas == ["a"]  # type: ignore[union-attr]
    core.close()
