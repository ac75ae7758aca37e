"""Bad input on the transfer wire (kvctl/transfer/protocol.py, server.py, net/framing.py).

Properties: only typed errors; no read or write outside registered buffers (guard bytes
around every buffer stay intact whatever offsets and lengths frames carry, 2**64-1
included); a declared length of 2**40 allocates nothing; the target keeps serving a
well-formed engine after every fuzzed connection.
"""

from __future__ import annotations

import os
import socket
import struct
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import fuzz_transfer
from fuzz._util import Pump
from fuzz.runner import CORPUS, run_harness
from kvctl.transfer import OpCode, TransferEngine, TransferRequest
from kvctl.transfer import protocol as p

GUARD = 512
BUF = 8192

# Offsets and lengths around every edge, and values that overflow u64 arithmetic or read as
# negative when signed (2**63 .. 2**64-1).
EDGES = [0, 1, BUF - 1, BUF, BUF + 1, GUARD, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
         2**63 - 1, 2**63, 2**64 - BUF, 2**64 - 2, 2**64 - 1]
u64 = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**64 - 1))
u32 = st.one_of(st.sampled_from([0, 1, 2, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


@pytest.fixture(scope="module")
def harness() -> Iterator[fuzz_transfer.TransferHarness]:
    h = fuzz_transfer.TransferHarness()
    yield h
    h.close()


class GuardedTarget:
    """A real TransferEngine serving one buffer that sits between two guard regions, and an
    initiator engine that checks the target still serves after each fuzzed connection."""

    def __init__(self) -> None:
        url = f"memory://{uuid.uuid4().hex}"
        self.arena = bytearray(GUARD + BUF + GUARD)
        self.front = fuzz_transfer.canary(GUARD, 1)
        self.back = fuzz_transfer.canary(GUARD, 2)
        self.arena[:GUARD] = self.front
        self.arena[GUARD + BUF:] = self.back
        self.target = TransferEngine("rel-target", metadata=url)
        self.target.register_memory("rel-guarded", [memoryview(self.arena)[GUARD:GUARD + BUF]])
        info = self.target.lookup("rel-guarded")
        self.seg_id = info.seg_id
        host, _, port = info.addresses[0].rpartition(":")
        self.address = (host, int(port))
        self.initiator = TransferEngine("rel-initiator", metadata=url, transport="tcp")
        self.local = bytearray(BUF)
        self.initiator.register_memory("rel-local", [self.local])

    def guards_intact(self) -> bool:
        return (self.arena[:GUARD] == self.front
                and self.arena[GUARD + BUF:] == self.back)

    def still_serves(self) -> None:
        data = os.urandom(256)
        self.local[:256] = data
        self.initiator.transfer([TransferRequest(OpCode.WRITE, "rel-local", 0, "rel-guarded",
                                                 4096, 256)], timeout_s=20)
        self.local[:256] = bytes(256)
        self.initiator.transfer([TransferRequest(OpCode.READ, "rel-local", 0, "rel-guarded",
                                                 4096, 256)], timeout_s=20)
        assert bytes(self.local[:256]) == data

    def send(self, raw: bytes, *, handshake: bool = True) -> bytes:
        """One raw connection: (valid handshake +) ``raw``, half-close, read to the end."""
        def answer(sock: socket.socket) -> bytes:
            sock.settimeout(5)
            hello = b""
            while len(hello) < p.HELLO.size:
                chunk = sock.recv(p.HELLO.size - len(hello))
                if not chunk:
                    return b""
                hello += chunk
            return p.ANSWER.pack(p.MAGIC, p.VERSION, bytes(32), bytes(32)) if handshake else b""

        sock = socket.create_connection(self.address, timeout=5)
        try:
            reply = Pump(sock, raw, answer).join()
        finally:
            sock.close()
        if not handshake or not reply:  # a reset (unread junk at close) can eat the reply
            return reply
        assert p.VERDICT.unpack_from(reply)[1] == p.Verdict.OK
        return reply[p.VERDICT.size:]

    def close(self) -> None:
        self.initiator.close()
        self.target.close()


@pytest.fixture(scope="module")
def guarded() -> Iterator[GuardedTarget]:
    g = GuardedTarget()
    yield g
    g.close()


def _frame(ftype: int, entries: list[tuple[int, int, int]], payload: bytes,
           declared: int | None) -> bytes:
    size = len(payload) if declared is None else declared
    return (p.HEADER.pack(ftype, 0, 0, 1, len(entries), size)
            + b"".join(p.ENTRY.pack(*e) for e in entries) + payload)


@st.composite
def frames(draw: st.DrawFn, seg_id: int) -> bytes:
    ftype = draw(st.sampled_from([p.FrameType.READ, p.FrameType.WRITE, p.FrameType.WRITE,
                                  p.FrameType.NOTIFY, p.FrameType.PING, 0, 5, 0x80, 0xFF]))
    n = draw(st.integers(0, 4))
    entries = [(draw(st.sampled_from([seg_id, seg_id, 0, seg_id + 1, 2**32 - 1])),
                draw(u64), draw(u64 if draw(st.booleans()) else st.integers(0, 64)))
               for _ in range(n)]
    payload = draw(st.binary(max_size=300))
    declared = draw(st.one_of(st.none(), u64))
    if ftype == p.FrameType.WRITE and draw(st.booleans()):
        # Sizes that add up, so the server gets as far as checking each range.
        small = [(s, o, len(payload) // max(n, 1)) for s, o, _ in entries]
        payload = payload[: sum(e[2] for e in small)]
        return _frame(ftype, small, payload, None)
    if ftype == p.FrameType.NOTIFY and payload:
        payload = struct.pack("<H", draw(st.integers(0, 2**16 - 1))) + payload
    return _frame(ftype, entries, payload, declared)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_frames_stay_inside_buffers_and_target_keeps_serving(
        guarded: GuardedTarget, data: st.DataObject) -> None:
    raw = b"".join(data.draw(st.lists(frames(guarded.seg_id), min_size=1, max_size=5)))
    guarded.send(raw)
    assert guarded.guards_intact(), "a fuzzed frame wrote outside the registered buffer"
    guarded.still_serves()


@pytest.mark.parametrize("offset", [BUF - 8, BUF, 2**63, 2**64 - 8, 2**64 - 1])
@pytest.mark.parametrize("length", [16, 2**64 - 1])
def test_out_of_range_is_answered_and_the_connection_stays_usable(
        guarded: GuardedTarget, offset: int, length: int) -> None:
    write = _frame(p.FrameType.WRITE, [(guarded.seg_id, offset, 16)], b"X" * 16, None)
    read = _frame(p.FrameType.READ, [(guarded.seg_id, offset, length)], b"", None)
    ping = _frame(p.FrameType.PING, [], b"", None)
    reply = guarded.send(write + read + ping)
    heads = [p.HEADER.unpack_from(reply, i) for i in _resp_offsets(reply)]
    statuses = [h[1] for h in heads]
    assert statuses == [p.WireStatus.OUT_OF_RANGE, p.WireStatus.OUT_OF_RANGE, p.WireStatus.OK]
    assert guarded.guards_intact()


def _resp_offsets(reply: bytes) -> list[int]:
    out, i = [], 0
    while i + p.HEADER.size <= len(reply):
        out.append(i)
        i += p.HEADER.size + p.HEADER.unpack_from(reply, i)[5]
    return out


@pytest.mark.parametrize("raw", [
    _frame(p.FrameType.WRITE, [(1, 0, 2**40)], b"", 2**40),
    _frame(p.FrameType.NOTIFY, [], b"", 2**40),
    _frame(p.FrameType.READ, [(1, 0, 2**40)], b"", None),
    _frame(p.FrameType.READ, [(1, 0, 1 << 16)] * 2, b"", None),
    p.HEADER.pack(p.FrameType.WRITE, 0, 0, 1, p.MAX_ENTRIES, 2**64 - 1),
], ids=["write-2^40", "notify-2^40", "read-2^40", "read-over-frame-limit", "max-entries"])
def test_declared_huge_lengths_allocate_nothing(harness: fuzz_transfer.TransferHarness,
                                                raw: bytes) -> None:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        harness.one_input(bytes([0]) + raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The most a connection may hold: one frame's entry table (MAX_ENTRIES x 20 B) plus the
    # frame limit of this server (64 KiB); nothing near the 2**40 bytes declared.
    assert peak < p.MAX_ENTRIES * p.ENTRY.size + (4 << 20), f"peak {peak} bytes"
    harness.check_guards()
    harness.roundtrip()


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=st.binary(min_size=0, max_size=80), tail=st.binary(max_size=64))
def test_handshake_answers_without_the_token_are_refused(
        harness: fuzz_transfer.TransferHarness, answer: bytes, tail: bytes) -> None:
    harness.one_input(bytes([2]) + answer + tail)  # asserts no OK verdict, memory untouched


def _corpus(name: str) -> list[Path]:
    files = sorted((CORPUS / name).iterdir())
    assert files, f"empty corpus {CORPUS / name}"
    return files


def test_committed_corpus_replays_clean(harness: fuzz_transfer.TransferHarness) -> None:
    for path in _corpus("transfer"):
        harness.one_input(path.read_bytes())
    harness.check_guards()
    harness.roundtrip()


def test_atheris_short_run_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the dev extra")
    result = run_harness("transfer", runs=len(_corpus("transfer")) + 300, max_time_s=10,
                         scratch=tmp_path)
    assert result.returncode == 0, result.output
    assert not result.artifacts, result.output
    assert result.runs >= 100, result.output


@pytest.mark.slow
def test_atheris_long_run_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the dev extra")
    result = run_harness("transfer", runs=50_000, max_time_s=240, scratch=tmp_path)
    assert result.returncode == 0, result.output
    assert not result.artifacts, result.output
