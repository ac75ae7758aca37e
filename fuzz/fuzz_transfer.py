"""Fuzz the transfer target server (``kvctl/transfer/server.py``: handshake and READ/WRITE/
NOTIFY/PING dispatch over ``kvctl/transfer/protocol.py`` frames and ``kvctl/net/framing.py``).

Each input is one connection, served in-process by the real ``TargetServer`` connection
handler over a socketpair. The first byte picks the mode:

- 0: a valid handshake, then the rest of the input as request frames;
- 1: the rest of the input as the handshake answer and whatever follows (no token);
- 2: the same against a server that requires a token (the input never knows it).

Properties checked after every input:

- the handler returns or raises only the typed errors it handles (FrameError, OSError): any
  other exception propagates here and is a crash;
- guard regions around every registered buffer are unchanged (no write outside a buffer),
  whatever offsets and lengths the frames carry (2**64-1 included);
- mode 2: the server never answers VERDICT OK and the buffers' contents are untouched;
- the connection ends within a deadline (no hang).

Every ``CHECK_EVERY`` inputs (and on demand) a well-formed client completes a WRITE and READ
through the server's real listener: the server keeps serving.

Run: ``python -m fuzz.fuzz_transfer -runs=100000 fuzz/corpus/transfer`` (see fuzz/README.md).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Any

from fuzz._util import FuzzFinding, Pump, TcpPair

GUARD_BYTES = 256
SINGLE_BYTES = 4096
MULTI_BYTES = (1024, 512)
MAX_FRAME_BYTES = 64 << 10
TOKEN = "fuzz-transfer-" + os.urandom(8).hex()
CHECK_EVERY = 64


def canary(n: int, salt: int) -> bytes:
    """Guard bytes: a pattern no zeroing or stray copy reproduces by accident."""
    return bytes(((i * 131) + salt * 17 + 7) & 0xFF or 1 for i in range(n))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise FuzzFinding(f"server closed before sending {n} greeting bytes")
        buf += chunk
    return bytes(buf)


class TransferHarness:
    """A guarded arena with two segments (one single-buffer, one two-buffer) served by an
    open and a token-protected :class:`TargetServer`."""

    def __init__(self) -> None:
        from kvctl.transfer import protocol as p
        from kvctl.transfer.segments import wrap_memory
        from kvctl.transfer.server import TargetServer

        self.p = p
        sizes = (SINGLE_BYTES, *MULTI_BYTES)
        # arena = guard | buf0 | guard | buf1 | guard | buf2 | guard
        self.arena = bytearray(GUARD_BYTES * (len(sizes) + 1) + sum(sizes))
        self.guards: list[tuple[int, bytes]] = []
        self.buffers: list[tuple[int, int]] = []
        pos = 0
        for i, size in enumerate((*sizes, 0)):
            guard = canary(GUARD_BYTES, i)
            self.arena[pos:pos + GUARD_BYTES] = guard
            self.guards.append((pos, guard))
            pos += GUARD_BYTES
            if size:
                self.buffers.append((pos, size))
                pos += size
        view = memoryview(self.arena)
        (o0, n0), (o1, n1), (o2, n2) = self.buffers
        self.segments: dict[int, Any] = {
            1: wrap_memory("fuzz-single", [view[o0:o0 + n0]]),
            2: wrap_memory("fuzz-multi", [view[o1:o1 + n1], view[o2:o2 + n2]]),
        }
        self.notes: list[tuple[str, bytes]] = []
        self.open_server = TargetServer(self.segments.get, self._note,
                                        max_frame_bytes=MAX_FRAME_BYTES)
        self.auth_server = TargetServer(self.segments.get, self._note, token=TOKEN,
                                        max_frame_bytes=MAX_FRAME_BYTES)
        self.pair = TcpPair()
        self.inputs = 0

    def _note(self, sender: str, message: bytes) -> None:
        if len(self.notes) < 1000:
            self.notes.append((sender, message))

    def close(self) -> None:
        self.open_server.close()
        self.auth_server.close()
        self.pair.close()

    # ---------------------------------------------------------------- one input

    def _answer(self, sock: socket.socket) -> bytes:
        sock.settimeout(5.0)
        _recv_exact(sock, self.p.HELLO.size)
        return self.p.ANSWER.pack(self.p.MAGIC, self.p.VERSION, bytes(32), bytes(32))

    def _hello_only(self, sock: socket.socket) -> bytes:
        sock.settimeout(5.0)
        _recv_exact(sock, self.p.HELLO.size)
        return b""

    def one_input(self, data: bytes) -> None:
        """Serve ``data`` as one connection and check every property."""
        if not data:
            return
        mode, body = data[0] % 3, data[1:]
        server = self.auth_server if mode == 2 else self.open_server
        before = bytes(self.arena) if mode == 2 else b""
        first = self._answer if mode == 0 else self._hello_only
        client, conn = self.pair()
        pump = Pump(client, body, first)
        try:
            server._serve(conn, ("fuzz", 0))  # the real per-connection handler
        finally:
            try:
                reply = pump.join()
            finally:
                client.close()
        self.check_guards()
        if mode == 2:
            verdict = reply[:self.p.VERDICT.size]
            if len(verdict) == self.p.VERDICT.size and verdict[4] == self.p.Verdict.OK:
                raise FuzzFinding("token-protected server accepted a handshake without the token")
            if bytes(self.arena) != before:
                raise FuzzFinding("an unauthenticated connection changed registered memory")
        self.inputs += 1
        if self.inputs % CHECK_EVERY == 0:
            self.roundtrip()

    def check_guards(self) -> None:
        """Raise when any guard byte around a registered buffer changed."""
        for pos, guard in self.guards:
            if self.arena[pos:pos + len(guard)] != guard:
                raise FuzzFinding(f"guard region at arena offset {pos} was overwritten")

    # ---------------------------------------------------------------- well-formed client

    def roundtrip(self, offset: int = 100, length: int = 200) -> None:
        """A well-formed client WRITEs then READs back a pattern through the real listener."""
        p = self.p
        pattern = os.urandom(length)
        with socket.create_connection((self.open_server.host, self.open_server.port),
                                      timeout=10) as sock:
            _recv_exact(sock, p.HELLO.size)
            sock.sendall(p.ANSWER.pack(p.MAGIC, p.VERSION, bytes(32), bytes(32)))
            _magic, code, _proof = p.VERDICT.unpack(_recv_exact(sock, p.VERDICT.size))
            if code != p.Verdict.OK:
                raise FuzzFinding(f"well-formed handshake refused (verdict {code})")
            entry = p.ENTRY.pack(1, offset, length)
            sock.sendall(p.HEADER.pack(p.FrameType.WRITE, 0, 0, 7, 1, length) + entry + pattern)
            _check_resp(_recv_exact(sock, p.HEADER.size), p, 7, 0)
            sock.sendall(p.HEADER.pack(p.FrameType.READ, 0, 0, 8, 1, 0) + entry)
            size = _check_resp(_recv_exact(sock, p.HEADER.size), p, 8, length)
            if _recv_exact(sock, size) != pattern:
                raise FuzzFinding("well-formed READ returned other bytes than were written")


def _check_resp(head: bytes, p: Any, tag: int, payload: int) -> int:
    ftype, status, _pad, got_tag, _index, size = p.HEADER.unpack(head)
    if (ftype, status, got_tag, size) != (p.FrameType.RESP, p.WireStatus.OK, tag, payload):
        raise FuzzFinding(f"well-formed request answered {ftype}/{status} tag {got_tag} "
                          f"size {size}")
    return int(size)


_HARNESS: TransferHarness | None = None


def harness() -> TransferHarness:
    """The process-wide harness (created on first use)."""
    global _HARNESS  # noqa: PLW0603 - one harness per fuzzing process
    if _HARNESS is None:
        _HARNESS = TransferHarness()
    return _HARNESS


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the name atheris expects
    harness().one_input(data)


# ---------------------------------------------------------------- seeds


def seeds() -> dict[str, bytes]:
    """Named seed inputs (written to fuzz/corpus/transfer by fuzz/make_seeds.py)."""
    from kvctl.transfer import protocol as p

    def frame(ftype: int, tag: int, entries: list[tuple[int, int, int]], payload: bytes = b"",
              declared: int | None = None) -> bytes:
        size = len(payload) if declared is None else declared
        return (p.HEADER.pack(ftype, 0, 0, tag, len(entries), size)
                + b"".join(p.ENTRY.pack(*e) for e in entries) + payload)

    big = 2**64 - 1
    notify_body = struct.pack("<H", 4) + b"peer" + b"hello"
    return {
        "write_read_ok": bytes([0]) + frame(p.FrameType.WRITE, 1, [(1, 0, 16)], b"A" * 16)
        + frame(p.FrameType.READ, 2, [(1, 0, 16)]),
        "multi_buffer": bytes([0]) + frame(p.FrameType.WRITE, 1, [(2, 1000, 24)], b"B" * 24)
        + frame(p.FrameType.READ, 2, [(2, 1020, 8), (2, 1024, 8)]),
        "offset_max": bytes([0]) + frame(p.FrameType.READ, 3, [(1, big, 1)]),
        "length_max": bytes([0]) + frame(p.FrameType.READ, 3, [(1, 1, big)]),
        "offset_plus_length_wraps": bytes([0]) + frame(p.FrameType.WRITE, 4,
                                                        [(1, big - 7, 8)], b"C" * 8),
        "write_past_end": bytes([0]) + frame(p.FrameType.WRITE, 5, [(1, SINGLE_BYTES - 4, 8)],
                                             b"D" * 8),
        "write_across_buffers": bytes([0]) + frame(p.FrameType.WRITE, 6, [(2, 1020, 8)],
                                                   b"E" * 8),
        "declared_2_40": bytes([0]) + frame(p.FrameType.WRITE, 7, [(1, 0, 2**40)],
                                            declared=2**40),
        "payload_mismatch": bytes([0]) + frame(p.FrameType.WRITE, 8, [(1, 0, 16)], b"F" * 8,
                                               declared=16),
        "no_segment": bytes([0]) + frame(p.FrameType.READ, 9, [(99, 0, 1)]),
        "notify": bytes([0]) + frame(p.FrameType.NOTIFY, 10, [], notify_body),
        "notify_name_overrun": bytes([0]) + frame(p.FrameType.NOTIFY, 11, [],
                                                  struct.pack("<H", 999) + b"x"),
        "ping": bytes([0]) + frame(p.FrameType.PING, 12, []),
        "unknown_type": bytes([0]) + frame(0x55, 13, []),
        "too_many_entries": bytes([0]) + p.HEADER.pack(p.FrameType.READ, 0, 0, 14,
                                                       p.MAX_ENTRIES + 1, 0),
        "handshake_bad_version": bytes([1]) + p.ANSWER.pack(p.MAGIC, 9, bytes(32), bytes(32)),
        "handshake_bad_magic": bytes([1]) + b"XXXX" + bytes(34),
        "auth_zero_answer": bytes([2]) + p.ANSWER.pack(p.MAGIC, p.VERSION, bytes(32), bytes(32))
        + frame(p.FrameType.WRITE, 1, [(1, 0, 4)], b"evil"),
    }


def main() -> None:
    """atheris entry point: ``python -m fuzz.fuzz_transfer [libFuzzer flags] [corpus dirs]``."""
    import logging

    import atheris

    logging.getLogger("kvctl").setLevel(logging.ERROR)  # per-input warnings are expected
    with atheris.instrument_imports(include=["kvctl"]):
        import kvctl.net.framing
        import kvctl.transfer.protocol
        import kvctl.transfer.segments
        import kvctl.transfer.server  # noqa: F401
    from fuzz._util import run_atheris

    run_atheris(TestOneInput, sys.argv)


if __name__ == "__main__":
    main()
