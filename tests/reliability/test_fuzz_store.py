"""Bad input on the store's wire: master messages (kvctl/store/protocol.py, server.py) and
the node data path (a transfer-engine target, kvctl/store/node.py).

Properties: only typed errors (the master's catch-all never logs a crash); oversized frames
and msgpack headers that declare huge arrays allocate nothing; a real store still puts and
gets real bytes after every fuzzed connection to its master or its node.
"""

from __future__ import annotations

import os
import socket
import tracemalloc
import typing
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fuzz import fuzz_store
from fuzz._util import ErrorTrap, Pump
from fuzz.runner import CORPUS, run_harness
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from kvctl.transfer import protocol as tp

ENCODER = msgspec.msgpack.Encoder()
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


@pytest.fixture(scope="module")
def harness() -> Iterator[fuzz_store.StoreHarness]:
    h = fuzz_store.StoreHarness()
    yield h
    h.close()


def _requests() -> st.SearchStrategy[msgspec.Struct]:
    kinds = [cls for cls in typing.get_args(p.Request) if cls is not p.Heartbeat]
    # A heartbeat of a live node long-polls up to 5 s: keep the wait at zero.
    heartbeat = st.builds(p.Heartbeat, wait_s=st.just(0.0))
    return st.one_of(*[st.builds(cls) for cls in kinds], heartbeat)


def _encode(message: msgspec.Struct) -> bytes:
    try:
        return ENCODER.encode(message)
    except OverflowError:  # an int msgpack cannot carry: not a wire input
        assume(False)
        raise


def _chunked(payloads: list[bytes]) -> bytes:
    return b"".join(len(x).to_bytes(2, "little") + x for x in payloads)


@FAST
@given(messages=st.lists(_requests(), min_size=1, max_size=8))
def test_typed_requests_with_any_values_get_typed_answers(
        harness: fuzz_store.StoreHarness, messages: list[msgspec.Struct]) -> None:
    payloads = [_encode(m) for m in messages]
    assume(all(len(x) < 2**16 for x in payloads))
    harness.one_input(bytes([1]) + _chunked(payloads))  # raises on a logged crash


@FAST
@given(payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=6))
def test_arbitrary_msgpack_payloads_are_bad_requests(
        harness: fuzz_store.StoreHarness, payloads: list[bytes]) -> None:
    harness.one_input(bytes([1]) + _chunked(payloads))


@pytest.mark.parametrize("raw", [
    p.Codec().frames._HEADER.pack(p.MAGIC, 1, 2**32 - 1),
    p.Codec().frames._HEADER.pack(p.MAGIC, 1, (4 << 20) + 1),
    # Frames of a few bytes whose msgpack headers declare 2**32-1 elements / bytes.
    p.Codec().frames._HEADER.pack(p.MAGIC, 1, 5) + b"\xdd\xff\xff\xff\xff",
    p.Codec().frames._HEADER.pack(p.MAGIC, 1, 5) + b"\xc6\xff\xff\xff\xff",
    p.Codec().frames._HEADER.pack(p.MAGIC, 1, 5) + b"\xdf\xff\xff\xff\xff",
], ids=["frame-2^32", "frame-over-limit", "array-2^32", "bin-2^32", "map-2^32"])
def test_declared_huge_sizes_allocate_nothing(harness: fuzz_store.StoreHarness,
                                              raw: bytes) -> None:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        harness.one_input(bytes([0]) + raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"peak {peak} bytes"
    harness.roundtrip()


@FAST
@given(login=st.binary(max_size=120))
def test_logins_without_the_token_are_refused(harness: fuzz_store.StoreHarness,
                                              login: bytes) -> None:
    harness.one_input(bytes([2]) + login)  # asserts Fail first and no state change


# ------------------------------------------------------------------ a real store


class RealStore:
    def __init__(self) -> None:
        settings_ = StoreSettings(listen="127.0.0.1:0", capacity=16 << 20)
        self.store = EmbeddedStore(settings_)
        self.client = StoreClient(self.store.address, transport="tcp", timeout_s=20)
        self.trap = ErrorTrap(["kvctl.store.server", "kvctl.store.master",
                               "kvctl.transfer.server"])
        # Fuzzed node frames include valid WRITEs of up to 16 bytes at offsets 0 and 1 MiB
        # (anyone may write registered memory when no token is set): the canary must sit
        # elsewhere, or a legitimate write corrupts it and the get rightly fails.
        self.client.put("pad", b"p" * 64)
        self.client.put("kept", b"k" * 5000)
        # Pinned: fuzzed puts and reservations may fill the store and evict (as any client
        # may); the canary must only show whether the store still serves.
        self.client.pin("kept")
        slot = self.store.server.core.get(p.Get(keys=["kept"], lease=False)).slots[0]
        assert isinstance(slot, p.GetSlot)
        where = slot.locations[0]
        assert all(where.offset >= at + 16 or where.offset + where.size <= at
                   for at in (0, 1 << 20)), where
        host, _, port = self.store.node.endpoint.rpartition(":")
        self.node = (host, int(port))
        host, _, port = self.store.address.rpartition(":")
        self.master = (host, int(port))

    def send(self, address: tuple[str, int], raw: bytes) -> None:
        sock = socket.create_connection(address, timeout=5)
        try:
            Pump(sock, raw).join()
        finally:
            sock.close()

    def still_serves(self) -> None:
        self.trap.check()
        assert self.client.get("kept") == b"k" * 5000
        key, value = f"check-{os.urandom(4).hex()}", os.urandom(3000)
        self.client.put(key, value)
        assert self.client.get(key) == value
        assert self.client.remove(key)

    def close(self) -> None:
        for name in ("kvctl.store.server", "kvctl.store.master", "kvctl.transfer.server"):
            __import__("logging").getLogger(name).removeHandler(self.trap)
        self.client.close()
        self.store.close()


@pytest.fixture(scope="module")
def real_store() -> Iterator[RealStore]:
    s = RealStore()
    yield s
    s.close()


def _store_frames(payloads: list[bytes]) -> bytes:
    frames = p.Codec().frames
    return b"".join(frames.encode_header(p.PROTOCOL_VERSION, len(x)) + x for x in payloads)


@st.composite
def _node_frames(draw: st.DrawFn) -> bytes:
    answer = tp.ANSWER.pack(tp.MAGIC, tp.VERSION, bytes(32), bytes(32))
    head = tp.HEADER.pack(draw(st.sampled_from([1, 2, 3, 4, 9])), 0, 0, 1,
                          draw(st.integers(0, 3)),
                          draw(st.sampled_from([0, 16, 2**40, 2**64 - 1])))
    entries = b"".join(tp.ENTRY.pack(draw(st.integers(0, 3)),
                                     draw(st.sampled_from([0, 1 << 20, 2**64 - 1])),
                                     draw(st.sampled_from([1, 16, 2**64 - 1])))
                       for _ in range(draw(st.integers(0, 3))))
    return answer + head + entries + draw(st.binary(max_size=64))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(target=st.sampled_from(["master-raw", "master-typed", "node"]), data=st.data())
def test_real_store_keeps_serving_after_fuzzed_connections(
        real_store: RealStore, target: str, data: st.DataObject) -> None:
    if target == "node":
        real_store.send(real_store.node, data.draw(st.one_of(_node_frames(),
                                                             st.binary(max_size=200))))
    elif target == "master-typed":
        messages = data.draw(st.lists(_requests(), min_size=1, max_size=4))
        real_store.send(real_store.master, _store_frames([_encode(m) for m in messages]))
    else:
        real_store.send(real_store.master, data.draw(st.binary(max_size=300)))
    real_store.still_serves()


# ------------------------------------------------------------------ corpus and atheris


def test_committed_corpus_replays_clean(harness: fuzz_store.StoreHarness) -> None:
    files = sorted((CORPUS / "store").iterdir())
    assert files
    for path in files:
        harness.one_input(path.read_bytes())
    harness.roundtrip()


def test_atheris_short_run_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the dev extra")
    result = run_harness("store", runs=len(list((CORPUS / "store").iterdir())) + 300,
                         max_time_s=10, scratch=tmp_path)
    assert result.returncode == 0, result.output
    assert not result.artifacts, result.output
    assert result.runs >= 100, result.output


@pytest.mark.slow
def test_atheris_long_run_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the dev extra")
    result = run_harness("store", runs=50_000, max_time_s=240, scratch=tmp_path)
    assert result.returncode == 0, result.output
    assert not result.artifacts, result.output
