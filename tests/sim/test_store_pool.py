"""``kvctl sim pool --store``: the pool cells replayed against a real embedded kvctl store."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvctl.sim.run import simulate_pool
from kvctl.sim.settings import SimSettings
from kvctl.sim.store_pool import KEY_ROOT, StorePoolRun
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from tests.fixtures.cli import CliResult
from tests.fixtures.servers import free_port

Kvctl = Callable[..., CliResult]
SMALL = ("--sessions", "20", "--local-blocks", "100,50", "--seed", "3")


@pytest.fixture
def store() -> Iterator[EmbeddedStore]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=32 << 20)) as s:
        yield s


def _sim_objects(address: str) -> int:
    with StoreClient(address, staging_bytes=1 << 20) as c:
        objects, truncated = c.list(KEY_ROOT)
        assert not truncated
        return len(objects)


def test_store_replay_matches_the_in_memory_pool(kvctl: Kvctl, store: EmbeddedStore) -> None:
    memory = kvctl("sim", "pool", *SMALL, "--json")
    assert memory.exit_code == 0, memory.stderr
    r = kvctl("sim", "pool", *SMALL, "--store", store.address, "--json")
    assert r.exit_code == 0, r.stderr
    doc, mem = r.json(), memory.json()
    assert doc["cells"] == mem["cells"]  # ample capacity: same hits, same fractions
    pool_hits = [c["pool_hit_tokens"] for c in doc["cells"] if c["pool_blocks"]]
    assert len(pool_hits) == 4
    assert all(h > 0 for h in pool_hits)  # the store really served hits
    assert doc["workload"]["pool_backend"] == "kvctl-store"
    assert mem["store"] is None
    s = doc["store"]
    assert s["store"] == store.address
    assert s["prefix"] == f"kvctl-sim/{s['run_id']}/"
    assert s["cells"] == 4
    assert s["keys_written"] > 0
    assert s["keys_removed"] == s["keys_written"]  # nothing evicted, everything removed
    assert s["keys_left"] == 0
    assert s["read_misses"] == 0
    assert s["exists_calls"] > 0
    assert s["put_calls"] > 0
    assert _sim_objects(store.address) == 0


def test_keep_leaves_the_run_keys(kvctl: Kvctl, store: EmbeddedStore) -> None:
    r = kvctl("sim", "pool", "--sessions", "8", "--local-blocks", "50", "--store",
              store.address, "--keep", "--json")
    assert r.exit_code == 0, r.stderr
    s = r.json()["store"]
    assert s["kept"] is True
    assert s["keys_removed"] == 0
    assert s["keys_left"] == s["keys_written"] > 0
    assert _sim_objects(store.address) == s["keys_written"]


def test_small_store_evicts_and_the_run_still_cleans_up() -> None:
    settings = SimSettings(sessions=20, local_blocks=(50,), seed=3)
    memory = simulate_pool(settings)
    # Room for about 300 placeholder blocks: the store's LRU evicts during the replay.
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=64 * 320)) as small:
        with StorePoolRun(small.address) as run:
            report = simulate_pool(settings, pool_factory=run.factory)
        summary = run.close()
        with StoreClient(small.address, staging_bytes=1 << 20) as c:
            evictions = c.status().evictions
            assert c.list(KEY_ROOT)[0] == []
    assert run.capacity_blocks < 320
    assert evictions > 0
    assert summary.keys_left == 0
    assert summary.keys_removed < summary.keys_written  # evicted keys were already gone
    pooled = [c for c in report.cells if c.pool_blocks]
    unbounded = [c for c in memory.cells if c.pool_blocks]
    # A pool that forgets blocks can only hit less than the in-memory pool that kept them.
    assert sum(c.pool_hit_tokens for c in pooled) < sum(c.pool_hit_tokens for c in unbounded)


def test_pool_cells_do_not_see_each_other(store: EmbeddedStore) -> None:
    with StorePoolRun(store.address, run_id="unit") as run:
        first = run.factory(0)
        first.insert_many([b"\x01" * 32, b"\x02" * 32])
        assert first.contains_many([b"\x01" * 32, b"\x03" * 32, b"\x02" * 32]) == [
            True, False, True]
        first.read_many([b"\x01" * 32])
        second = run.factory(0)  # removes the first cell's keys
        assert second.prefix == "kvctl-sim/unit/c1/"
        assert second.contains_many([b"\x01" * 32]) == [False]
        assert first.contains_many([b"\x01" * 32]) == [False]
        second.insert_many([b"\x01" * 32])
        with StoreClient(store.address, staging_bytes=1 << 20) as other:
            other.remove(f"kvctl-sim/unit/c1/{'01' * 32}")  # gone behind the run's back
        second.read_many([b"\x01" * 32])
    summary = run.close()
    assert summary.read_misses == 1
    assert summary.keys_written == 3
    assert summary.keys_left == 0


def test_unreachable_store_and_bad_flags(kvctl: Kvctl) -> None:
    r = kvctl("sim", "pool", *SMALL, "--store", f"127.0.0.1:{free_port()}")
    assert r.exit_code == 3
    assert "cannot reach the store master" in r.stderr
    assert "Hint:" in r.stderr
    r = kvctl("sim", "pool", *SMALL, "--keep")
    assert r.exit_code == 2
    assert "--keep needs --store" in r.stderr


def test_table_names_the_store(kvctl: Kvctl, store: EmbeddedStore) -> None:
    r = kvctl("sim", "pool", "--sessions", "8", "--local-blocks", "50", "--store",
              store.address)
    assert r.exit_code == 0, r.stderr
    assert f"pool: the kvctl store at {store.address}" in r.stdout
    assert "round trips" in r.stdout
    assert ", 0 left)" in r.stdout
