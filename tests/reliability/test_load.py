"""Load: K concurrent clients x mixed put/get/exists/remove for T seconds against a master
and two storage nodes in separate processes.

Held to: zero errors, zero wrong bytes (values carry key + version, see
:func:`~tests.reliability.conftest.make_value`), every acknowledged object readable or
reported evicted (never silently gone), bounded memory (RSS) in every process; p50/p99
latency is printed for docs/reliability.md. The CI run is short (K=4, ~8 s); the soak
(K=16, 5 min) is marked ``slow``.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from kvctl.errors import KvctlError
from kvctl.store.client import StoreClient
from kvctl.store.errors import ObjectNotFoundError
from tests.reliability.conftest import StoreCluster, decode_value, make_value, wait_for

pytestmark = pytest.mark.integration

#: RSS growth allowed per process between warm-up and the end of the run, bytes.
RSS_GROWTH_BOUND = 64 << 20
PRESENT, REMOVED, EVICTED = "present", "removed", "evicted"
#: Removed after it had been evicted: the master may still answer "evicted" for it.
GONE = "gone"


@dataclasses.dataclass
class Tally:
    ops: int = 0
    evicted_seen: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    latency_us: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"put": [], "get": [], "exists": [], "remove": []})


def _client_loop(client: StoreClient, cid: int, keys: int, stop: threading.Event,
                 tally: Tally) -> dict[str, tuple[str, int]]:
    """Mixed ops on this client's own keys; returns each key's final (state, version)."""
    rng = random.Random(cid)
    state: dict[str, tuple[str, int]] = {}
    version = 0

    def timed(op: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            tally.latency_us[op].append((time.perf_counter() - t0) * 1e6)
            tally.ops += 1

    def evicted_or_error(key: str, what: str) -> None:
        """``key`` was acknowledged but is gone: it must be reported as evicted."""
        try:
            client.get(key)
            tally.errors.append(f"{key}: {what}, yet get returned bytes")
        except ObjectNotFoundError as exc:
            if not exc.evicted:
                tally.errors.append(f"{key}: acknowledged, {what}, not reported evicted")
            else:
                tally.evicted_seen += 1
                state[key] = (EVICTED, state[key][1])

    while not stop.is_set():
        key = f"c{cid}/{rng.randrange(keys)}"
        st, ver = state.get(key, (REMOVED, 0))
        roll = rng.random()
        try:
            if roll < 0.35:
                version += 1
                value = make_value(key, version, rng.randrange(1, 64) * 1024)
                timed("put", lambda k=key, v=value: client.put(k, v))
                state[key] = (PRESENT, version)
            elif roll < 0.80:
                try:
                    data = timed("get", lambda k=key: client.get(k))
                except ObjectNotFoundError as exc:
                    if st == PRESENT and not exc.evicted:
                        tally.errors.append(f"{key}: v{ver} acknowledged, NotFound (not evicted)")
                    elif st == PRESENT:
                        tally.evicted_seen += 1
                        state[key] = (EVICTED, ver)
                    elif st == REMOVED and exc.evicted:
                        tally.errors.append(f"{key}: removed, but reported evicted")
                    continue
                got = decode_value(key, data)  # type: ignore[arg-type]
                if st != PRESENT or got != ver:
                    tally.errors.append(f"{key}: got v{got}, expected {st} v{ver}")
            elif roll < 0.90:
                there = timed("exists", lambda k=key: client.exists(k))
                if there and st != PRESENT:
                    tally.errors.append(f"{key}: exists after being {st}")
                elif not there and st == PRESENT:
                    evicted_or_error(key, "exists says no")
            else:
                existed = timed("remove", lambda k=key: client.remove(k))
                if existed and st != PRESENT:
                    tally.errors.append(f"{key}: remove found it after being {st}")
                if not existed and st == PRESENT:
                    evicted_or_error(key, "remove found nothing")
                gone = state.get(key, (REMOVED, 0))[0] in (EVICTED, GONE)
                state[key] = (GONE if gone else REMOVED, ver)
        except AssertionError as exc:
            tally.errors.append(str(exc))
        except KvctlError as exc:
            tally.errors.append(f"{key}: {type(exc).__name__}: {exc.cause}")
    return state


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_load(cluster: StoreCluster, *, clients: int, duration_s: float,
             keys_per_client: int) -> dict[str, object]:
    """Run the mixed workload and check everything; returns the figures."""
    conns = [StoreClient(cluster.address, transport="tcp" if i % 2 else "auto")
             for i in range(clients)]
    tallies = [Tally() for _ in range(clients)]
    states: list[dict[str, tuple[str, int]]] = [{} for _ in range(clients)]
    stop = threading.Event()
    procs = {**cluster.processes(), "clients": None}

    def rss() -> dict[str, int]:
        out = {}
        for role, proc in procs.items():
            pid = proc.pid if proc is not None else psutil.Process().pid
            out[role] = int(psutil.Process(pid).memory_info().rss)
        return out

    def work(i: int) -> None:
        states[i] = _client_loop(conns[i], i, keys_per_client, stop, tallies[i])

    try:
        wait_for(lambda: len(conns[0].status().nodes) == 2, what="two nodes")
        threads = [threading.Thread(target=work, args=(i,), daemon=True)
                   for i in range(clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(min(2.0, duration_s / 4))  # warm-up: pools, mappings, first allocations
        rss_start = rss()
        peak = dict(rss_start)
        while time.monotonic() - started < duration_s:
            time.sleep(0.5)
            for role, value in rss().items():
                peak[role] = max(peak[role], value)
        stop.set()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - started
        assert not any(t.is_alive() for t in threads), "a client hung"
        rss_end = rss()
        errors = [e for t in tallies for e in t.errors]
        assert errors == [], errors[:10]
        # Final sweep: every acknowledged object is readable, exact, or reported evicted.
        checker = conns[0]
        evicted_final = present = 0
        lost: list[str] = []
        for state in states:
            for key, (st, ver) in state.items():
                try:
                    got = decode_value(key, checker.get(key))
                except ObjectNotFoundError as exc:
                    if st == PRESENT and not exc.evicted:
                        lost.append(f"{key}: v{ver} acknowledged, NotFound (not evicted)")
                    if st == REMOVED and exc.evicted:
                        lost.append(f"{key}: removed, but reported evicted")
                    evicted_final += st == PRESENT
                    continue
                assert st == PRESENT, f"{key}: readable after being {st}"
                assert got == ver, f"{key}: got v{got}, acknowledged v{ver}"
                present += 1
        assert lost == [], lost[:10]
        growth = {role: rss_end[role] - rss_start[role] for role in rss_start}
        for role, grew in growth.items():
            assert grew < RSS_GROWTH_BOUND, f"{role}: RSS grew {grew / 2**20:.1f} MiB"
        lat = [v for t in tallies for vals in t.latency_us.values() for v in vals]
        status = checker.status()
        report: dict[str, object] = {
            "clients": clients, "duration_s": round(elapsed, 1),
            "ops": sum(t.ops for t in tallies),
            "ops_per_s": round(sum(t.ops for t in tallies) / elapsed),
            "p50_us": round(_percentile(lat, 0.50)), "p99_us": round(_percentile(lat, 0.99)),
            **{f"{op}_p99_us": round(_percentile(
                [v for t in tallies for v in t.latency_us[op]], 0.99))
               for op in ("put", "get", "exists", "remove")},
            "errors": 0, "wrong_bytes": 0, "readable_at_end": present,
            "evicted_seen": sum(t.evicted_seen for t in tallies) + evicted_final,
            "master_evictions": status.evictions,
            "rss_growth_mib": {r: round(g / 2**20, 1) for r, g in growth.items()},
            "rss_peak_mib": {r: round(v / 2**20, 1) for r, v in peak.items()},
        }
        print(f"\nload: {report}")
        return report
    finally:
        stop.set()
        for c in conns:
            c.close()


def test_short_load_mixed_ops_two_nodes(store_cluster: Callable[..., StoreCluster]) -> None:
    """CI run: 4 clients, ~8 s, working set (~19 MiB) over 2 x 8 MiB of DRAM (evictions)."""
    cluster = store_cluster()
    cluster.start_master()
    cluster.start_nodes("a", "b", capacity="8MiB")
    report = run_load(cluster, clients=4, duration_s=8.0, keys_per_client=150)
    assert report["ops"] > 500  # type: ignore[operator]
    assert report["master_evictions"] > 0  # type: ignore[operator]  # eviction was exercised


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_sixteen_clients_five_minutes(store_cluster: Callable[..., StoreCluster]) -> None:
    """Soak: 16 clients for 5 minutes, same checks."""
    cluster = store_cluster()
    cluster.start_master()
    cluster.start_nodes("a", "b", capacity="32MiB")
    report = run_load(cluster, clients=16, duration_s=300.0, keys_per_client=200)
    assert report["ops"] > 10_000  # type: ignore[operator]
