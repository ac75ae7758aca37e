"""Batched gets against the shared tier under hostile calls and a node that dies.

A read-only buffer given to get_into/batch_get_into raised a bare BufferError out of the
tier's file read (and, for a DRAM object, a StoreUnavailableError blaming the node); it is
a BadRequestError before anything is read. A node that dies (closed, the master not yet
told) under a batch mixing its objects, tier-only objects, duplicates and missing keys:
every object with a file is served from it, byte for byte.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvctl.store.client import StoreClient
from kvctl.store.errors import (
    BadRequestError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from kvctl.store.sharedtier import reader as reader_mod
from tests.store.conftest import wait_for
from tests.store.test_shared_tier import SharedCluster


def test_read_only_buffers_and_a_node_dying_under_a_mixed_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_mod, "MIN_SHARE_S", 1e-12)  # threads for any batch
    c = SharedCluster(tmp_path / "dfs", policy="write-through")
    try:
        first = c.node(16 << 20)
        with StoreClient(c.address, transport="tcp") as client:  # no same-host mapping
            client.shared.threads = 3
            tier = {f"t{i}": os.urandom(20_000 + i) for i in range(6)}
            client.batch_put(list(tier.items()))
            wait_for(lambda: all("shared" in client.stat(k).tier for k in tier),
                     what="write-through copies")
            client.drop_node(first.node_id)  # only the files hold these now
            second = c.node(16 << 20)
            both = {f"b{i}": os.urandom(30_000 + i) for i in range(6)}
            client.batch_put(list(both.items()))
            wait_for(lambda: all("shared" in client.stat(k).tier for k in both),
                     what="write-through copies")
            for key in ("t0", "b0"):
                with pytest.raises(BadRequestError, match="read-only"):
                    client.get_into(key, bytes(40_000))
            with pytest.raises(BadRequestError, match=r"buffer 1 .*read-only"):
                client.batch_get_into(["t0", "b0"], [bytearray(40_000), b"\0" * 40_000])
            second.close()  # dies: the master still names its DRAM copies for a while
            want = {**tier, **both}
            keys = ["b0", "t0", "nope", "b1", "t1", "b0", "t1", "b2", "t2", "b3", "b4",
                    "t3", "b5", "t4", "t5", "nope"]
            reads = client.shared.reads
            got = client.batch_get(keys)
            for key, g in zip(keys, got, strict=True):
                if key == "nope":
                    assert isinstance(g, ObjectNotFoundError)
                else:
                    assert g == want[key], (key, g)
            assert client.shared.reads - reads > 7  # (7 tier-only): DRAM ones fell back
            bufs = [bytearray(40_000) for _ in keys]
            sizes = client.batch_get_into(keys, bufs)
            for key, n, buf in zip(keys, sizes, bufs, strict=True):
                if key == "nope":
                    assert isinstance(n, ObjectNotFoundError)
                else:
                    assert n == len(want[key]), (key, n)
                    assert buf[:n] == want[key], key
    finally:
        c.close()


def test_a_get_whose_client_is_closed_under_it_says_so(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """close() from another thread while a get waits for the master's answer: the get
    failed with 'store master at ... did not answer (Bad file descriptor)', blaming a
    master that was fine."""
    from kvctl.store import rpc

    c = SharedCluster(tmp_path / "dfs")
    try:
        c.node(4 << 20)
        client = StoreClient(c.address)
        client.put("k", b"v" * 100)
        real_recv = rpc.MasterConnection.recv

        def closed_meanwhile(conn: rpc.MasterConnection, *a: Any, **kw: Any) -> Any:
            closer = threading.Thread(target=client.close)
            closer.start()
            closer.join(10)
            return real_recv(conn, *a, **kw)

        monkeypatch.setattr(rpc.MasterConnection, "recv", closed_meanwhile)
        with pytest.raises(StoreError, match="closed") as err:
            client.get("k")
        assert not isinstance(err.value, StoreUnavailableError), err.value
    finally:
        c.close()
