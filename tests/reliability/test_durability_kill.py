"""The master SIGKILLed again and again under batch puts (client reservations on, state in a
journal): every put that returned is there, exact, after the restarts; puts in flight fail
(or, if they made it to the journal, are there too), never partial bytes.

The master and node are separate processes (``store_cluster``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.errors import KvctlError
from kvctl.store.client import StoreClient
from tests.reliability.conftest import StoreCluster, decode_value, make_value, wait_for

pytestmark = pytest.mark.integration


def test_master_sigkilled_under_batch_puts_loses_no_acknowledged_put(
        store_cluster: Callable[..., StoreCluster], tmp_path: Path) -> None:
    cluster = store_cluster()
    cluster.start_master(state=str(tmp_path / "state"))
    cluster.start_nodes("a", capacity="128MiB")
    acked: list[list[str]] = [[], []]
    failed = [0, 0]
    stop = threading.Event()

    def writer(n: int) -> None:
        with StoreClient(cluster.address, timeout_s=5) as client:
            batch = 0
            while not stop.is_set():
                keys = [f"w{n}/{batch}/{i}" for i in range(16)]
                batch += 1
                try:
                    errors = client.batch_put([(k, make_value(k, 1, 4096)) for k in keys])
                except KvctlError:
                    failed[n] += len(keys)
                    time.sleep(0.05)
                    continue
                for key, err in zip(keys, errors, strict=True):
                    if err is None:
                        acked[n].append(key)
                    else:
                        failed[n] += 1
                if any(errors):
                    time.sleep(0.05)  # the master is restarting

    threads = [threading.Thread(target=writer, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            before = sum(map(len, acked))
            wait_for(lambda before=before: sum(map(len, acked)) > before + 200,  # type: ignore[misc]
                     timeout_s=30, what="puts acknowledged before the kill")
            cluster.restart_master()  # SIGKILL mid-batch, the same journal
    finally:
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a writer hung"
    keys = [k for part in acked for k in part]
    with StoreClient(cluster.address) as client:
        wait_for(lambda: [n.state for n in client.status().nodes] == ["alive"],
                 timeout_s=15, what="node re-registered")
        got = client.batch_get(keys)
    lost = [k for k, g in zip(keys, got, strict=True) if not isinstance(g, bytes)]
    assert lost == [], f"{len(lost)} of {len(keys)} acknowledged puts lost: {lost[:5]}"
    assert all(decode_value(k, g) == 1 for k, g in zip(keys, got, strict=True))
    print(f"\nmaster SIGKILLed 3x under batch puts: {len(keys)} acknowledged, "
          f"{sum(failed)} failed, 0 lost")
