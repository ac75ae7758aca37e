"""Master state on a metadata service (etcd): a second master takes over the objects."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.store import protocol as p
from kvctl.store.master import MasterCore
from kvctl.store.state import JournalState, MetadataState, known_schemes, open_state
from kvctl.store.state.base import StateBackend, register_state


@pytest.mark.integration
def test_standby_master_loads_state_from_etcd(etcd_url: str) -> None:
    cluster = f"store-{secrets.token_hex(4)}"
    first = MasterCore(state=MetadataState(etcd_url, cluster_id=cluster))
    assert first.register_node(p.RegisterNode(
        node_id="a", epoch="E", segment="a.seg", endpoint="127.0.0.1:1", host_id="h",
        capacity_bytes=1 << 20)) is None
    for i in range(5):
        slot = first.put(p.Put(items=[p.PutItem(f"k{i}", 1000, i)]))[0]
        assert isinstance(slot, p.PutSlot)
        first.commit(p.Commit(keys=[f"k{i}"], versions=[slot.version]))
    first.remove(["k4"])
    first.close()  # the active master is gone

    standby = MasterCore(state=MetadataState(etcd_url, cluster_id=cluster))
    assert standby.exists([f"k{i}" for i in range(5)]) == [True] * 4 + [False]
    assert standby.register_node(p.RegisterNode(
        node_id="a", epoch="E", segment="a.seg", endpoint="127.0.0.1:1", host_id="h",
        capacity_bytes=1 << 20)) is None
    got = standby.get(p.Get(keys=["k2"])).slots[0]
    assert isinstance(got, p.GetSlot)
    assert got.checksum == 2
    standby.close()


def test_open_state_choices() -> None:
    assert open_state("none").description == "none"
    with pytest.raises(UsageError, match="unknown metadata scheme"):
        open_state("bogus://x")


def test_open_state_picks_the_backend_its_scheme_registered(tmp_path: Path) -> None:
    """file:// (and a bare directory) is the journal's, every other metadata scheme the
    metadata state's; an unknown scheme names the known ones; a scheme taken stays taken."""
    assert known_schemes() == ["etcd", "file", "http", "memory", "redis"]
    for spec in (f"file://{tmp_path / 'a'}", str(tmp_path / "b")):
        state = open_state(spec)
        try:
            assert isinstance(state, JournalState)
        finally:
            state.close()
    state = open_state("memory://", cluster_id="c1")
    try:
        assert isinstance(state, MetadataState)
        assert state.description == "metadata memory://"
    finally:
        state.close()
    with pytest.raises(UsageError, match="unknown metadata scheme 'bogus'") as caught:
        open_state("bogus://x")
    assert caught.value.hint == "known schemes: etcd, file, http, memory, redis"

    def other(spec: str, cluster_id: str, token: str | None) -> StateBackend:
        raise AssertionError("file:// is the journal's")

    register_state("file")(other)
    state = open_state(f"file://{tmp_path / 'c'}")
    state.close()
    assert isinstance(state, JournalState)
