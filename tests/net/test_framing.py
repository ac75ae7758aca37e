"""FrameReader: frames through a read-ahead buffer, whatever way the bytes arrive."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kvctl.net.framing import (
    ConnectionClosedError,
    FrameCodec,
    FrameError,
    FrameReader,
    Poller,
    set_io_timeouts,
    set_send_timeout,
)

CODEC = FrameCodec(b"TEST", max_payload_bytes=1 << 20)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def frame(kind: int, payload: bytes) -> bytes:
    return CODEC.encode_header(kind, len(payload)) + payload


@pytest.mark.parametrize("spin_s", [0.0, 0.001])
def test_frames_in_one_write_and_split_anywhere(pair: tuple[socket.socket, socket.socket],
                                                spin_s: float) -> None:
    a, b = pair
    payloads = [b"", b"x", os.urandom(100), os.urandom(70_000), os.urandom(5)]
    wire = b"".join(frame(i, pl) for i, pl in enumerate(payloads)) + b"tail-bytes"
    reader = FrameReader(b, CODEC, buffer_bytes=64, spin_s=spin_s)

    def send() -> None:  # in pieces of awkward sizes, with pauses between some
        for i in range(0, len(wire), 37):
            a.sendall(wire[i:i + 37])
            if i % 370 == 0:
                time.sleep(0.001)

    t = threading.Thread(target=send)
    t.start()
    for i, pl in enumerate(payloads):
        got = reader.recv()
        assert (got.kind, got.payload) == (i, pl)
    rest = [memoryview(bytearray(4)), memoryview(bytearray(6))]
    reader.recv_into_views(rest)  # raw bytes after a frame: buffered ones first
    assert bytes(rest[0]) + bytes(rest[1]) == b"tail-bytes"
    assert reader.buffered == 0
    t.join()


def test_raw_bytes_behind_a_frame_larger_than_the_buffer(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = os.urandom(300_000)
    reader = FrameReader(b, CODEC, buffer_bytes=1024)
    t = threading.Thread(target=a.sendall, args=(frame(7, b"reply") + data,))
    t.start()
    assert reader.recv().payload == b"reply"
    views = [memoryview(bytearray(1000)), memoryview(bytearray(len(data) - 1000))]
    reader.recv_into_views(views)
    assert bytes(views[0]) + bytes(views[1]) == data
    t.join()


def test_bad_magic_oversize_and_close(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    reader = FrameReader(b, CODEC)
    a.sendall(b"NOPE" + bytes(8))
    with pytest.raises(FrameError, match="magic"):
        reader.recv()
    a2, b2 = socket.socketpair()
    with a2, b2:
        r2 = FrameReader(b2, CODEC)
        a2.sendall(FrameCodec(b"TEST", max_payload_bytes=4 << 20).encode_header(1, 2 << 20))
        with pytest.raises(FrameError, match="limit"):
            r2.recv()
    a3, b3 = socket.socketpair()
    with b3:
        r3 = FrameReader(b3, CODEC)
        a3.sendall(frame(1, b"abcdef")[:-2])  # cut inside the payload
        a3.close()
        with pytest.raises(ConnectionClosedError):
            r3.recv()


def test_spin_then_block_and_kernel_timeout(pair: tuple[socket.socket, socket.socket]
                                            ) -> None:
    a, b = pair
    set_io_timeouts(b, 0.2)
    reader = FrameReader(b, CODEC, spin_s=0.0005)
    threading.Timer(0.05, a.sendall, args=(frame(3, b"late"),)).start()
    assert reader.recv().payload == b"late"  # arrived after the spin: the block waited
    start = time.monotonic()
    with pytest.raises(BlockingIOError):  # nothing comes: the kernel timeout ends the wait
        reader.recv()
    assert 0.15 < time.monotonic() - start < 2


def test_polling_backs_off_when_replies_are_slow(pair: tuple[socket.socket, socket.socket]
                                                 ) -> None:
    """A poll that misses (the reply came later) makes the next waits block at once, for
    longer after each miss in a row; a poll that hits starts over."""
    a, b = pair
    reader = FrameReader(b, CODEC, spin_s=0.0002)
    for expected_skip in (2, 4):
        threading.Timer(0.02, a.sendall, args=(frame(1, b"slow"),)).start()
        assert reader.recv().payload == b"slow"
        assert reader.poller.skip == expected_skip
        for _ in range(expected_skip):  # these block without polling
            a.sendall(frame(1, b"x"))
            reader.recv()
        assert reader.poller.skip == 0
    a.sendall(frame(1, b"fast"))  # already there: the poll hits
    assert reader.recv().payload == b"fast"
    assert (reader.poller.misses, reader.poller.skip) == (0, 0)


def test_poller_fills_exactly_and_reports_a_closed_peer(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    poller = Poller(0.0005)
    threading.Timer(0.01, a.sendall, args=(b"abc",)).start()
    threading.Timer(0.05, a.sendall, args=(b"defgh",)).start()
    view = memoryview(bytearray(8))
    poller.recv_exact_into(b, view)  # polled for the first bytes, blocked for the rest
    assert bytes(view) == b"abcdefgh"
    a.close()
    with pytest.raises(ConnectionClosedError):
        poller.recv_exact_into(b, memoryview(bytearray(4)))


@pytest.mark.parametrize("seconds", [0.0, -0.5, 0.0000001])
def test_tiny_zero_or_negative_timeouts_are_the_shortest_not_infinite(
        pair: tuple[socket.socket, socket.socket], seconds: float) -> None:
    """A zero timeval means "wait forever" and a negative one is refused by the kernel:
    both are clamped to 1 ms."""
    _, b = pair
    set_io_timeouts(b, seconds)
    set_send_timeout(b, seconds)
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sec, usec = struct.unpack("@ll", b.getsockopt(socket.SOL_SOCKET, opt, 16))
        assert (sec, usec) != (0, 0)
        assert sec * 1e6 + usec <= 5000
