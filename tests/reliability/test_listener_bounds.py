"""Listeners a tokenless peer cannot take down (issue 15.10): each fails on the old code.

- idle or slow-drip sockets that never log in are few and short: a real peer still gets in;
- an accept loop that runs out of descriptors waits and keeps serving, never exits;
- unread NOTIFY messages are bounded.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvctl.metadata import MetadataServer, open_metadata
from kvctl.net.limits import PendingLimit
from kvctl.store import server as store_server
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from kvctl.transfer import engine as engine_mod
from kvctl.transfer import server as target_server
from kvctl.transfer.batch import OpCode, TransferRequest
from kvctl.transfer.engine import TransferEngine

TOKEN = "bounds-" + uuid.uuid4().hex


@contextlib.contextmanager
def idle_sockets(address: str, count: int) -> Iterator[list[socket.socket]]:
    host, _, port = address.rpartition(":")
    socks = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        yield socks
    finally:
        for s in socks:
            s.close()


def _cut(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has closed (EOF or reset)."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    n += 1
                    break
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


def test_pending_limit_cuts_the_oldest_and_the_late() -> None:
    limit = PendingLimit(2, "test", deadline_s=0.3)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        for ours, _ in pairs:
            limit.admit(ours)
        assert limit.pending() == 2
        assert pairs[0][1].recv(1) == b""  # the oldest was shut down
        limit.trusted(pairs[2][0])
        time.sleep(1.0)
        assert limit.pending() == 0  # the other went past its deadline
        assert pairs[1][1].recv(1) == b""
        pairs[2][0].sendall(b"x")  # the trusted one is untouched
        assert pairs[2][1].recv(1) == b"x"
    finally:
        limit.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_transfer_target_serves_a_real_peer_through_a_flood_of_idle_sockets() -> None:
    meta = MetadataServer(port=0, token=TOKEN).start()
    try:
        with TransferEngine("flood-t", metadata=meta.url, token=TOKEN) as target, \
                TransferEngine("flood-i", metadata=meta.url, token=TOKEN,
                               transport="tcp", timeout_s=5) as initiator:
            target.register_memory("flood.buf", [bytearray(4096)])
            initiator.register_memory("flood-i.buf", [bytearray(4096)])
            with idle_sockets(target.advertised[0], 3 * target_server.MAX_PENDING) as socks:
                started = time.monotonic()
                initiator.transfer([TransferRequest(OpCode.WRITE, "flood-i.buf", 0,
                                                    "flood.buf", 0, 128)], timeout_s=10)
                assert time.monotonic() - started < 5
                assert _cut(socks) >= 2 * target_server.MAX_PENDING
    finally:
        meta.stop()


def test_store_master_cuts_sockets_that_never_log_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_server, "LOGIN_TIMEOUT_S", 0.5)
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=8 << 20),
                       token=TOKEN) as store, idle_sockets(store.address, 520) as socks:
        with StoreClient(store.address, token=TOKEN) as client:
            client.put("after-flood", b"v" * 100)
            assert client.get("after-flood") == b"v" * 100
        time.sleep(1.5)
        assert _cut(socks) == len(socks)  # none may sit there for good


def test_metadata_server_answers_signed_requests_through_slow_drip_connections() -> None:
    server = MetadataServer(port=0, token=TOKEN).start()
    stop = threading.Event()
    socks: list[socket.socket] = []

    def drip() -> None:
        while not stop.wait(0.2):
            for s in list(socks):
                with contextlib.suppress(OSError):
                    s.send(b"G")

    try:
        threading.Thread(target=drip, daemon=True).start()  # dripping from the first one
        for _ in range(260):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        ok = 0
        with open_metadata(server.url, token=TOKEN) as client:
            for i in range(32):
                client.put(f"kvctl/drip/{i}", b"v")
                ok += client.get(f"kvctl/drip/{i}") == b"v"
        assert ok == 32
    finally:
        stop.set()
        for s in socks:
            s.close()
        server.stop()


def test_accept_loops_survive_running_out_of_descriptors(tmp_path: object) -> None:
    # A child with a low descriptor limit serves a store (master + node); the parent opens
    # more connections than it has descriptors, closes them, then uses the store.
    script = textwrap.dedent("""
        import resource, sys, time
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
        from kvctl.store.embedded import EmbeddedStore
        from kvctl.store.settings import StoreSettings
        with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=8 << 20)) as s:
            print(s.address, s.node.endpoint, flush=True)
            sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        master, node = child.stdout.readline().split()
        for address in (master, node):
            with idle_sockets(address, 150):
                time.sleep(0.3)  # the child hits EMFILE on accept
        time.sleep(0.5)
        with StoreClient(master, transport="tcp") as client:
            client.put("after-emfile", b"x" * 65536)
            assert client.get("after-emfile") == b"x" * 65536
    finally:
        if child.stdin is not None:
            child.stdin.write("\n")
            child.stdin.flush()
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 96  # the parent was not limited


def test_unread_notifications_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod, "MAX_INBOX", 50)
    url = f"memory://{uuid.uuid4().hex}"
    with TransferEngine("note-t", metadata=url) as target, \
            TransferEngine("note-i", metadata=url, transport="tcp") as sender:
        target.register_memory("note.buf", [bytearray(64)])
        sender.register_memory("note-i.buf", [bytearray(64)])
        for i in range(200):
            sender.notify("note.buf", f"n{i}".encode() * 1000)
        deadline = time.monotonic() + 10
        while target.notifications_dropped < 150 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = target.drain_notifications()
        assert len(got) == 50
        assert target.notifications_dropped == 150
        assert got[-1].message.startswith(b"n199")  # the newest are kept


def test_one_peer_holds_at_most_half_of_the_pending_room() -> None:
    limit = PendingLimit(8, "test", deadline_s=30)
    pairs = [socket.socketpair() for _ in range(12)]
    try:
        for ours, _ in pairs[:8]:
            limit.admit(ours, "10.9.9.9")
        assert limit.pending() == 4  # the flooder's share is 4 of 8: its oldest gave way
        assert [theirs.recv(1) for _, theirs in pairs[:4]] == [b""] * 4
        for ours, _ in pairs[8:]:
            limit.admit(ours, "10.1.1.1")  # another host gets the other half, nothing cut
        assert limit.pending() == 8
        limit.admit(pairs[0][0], "10.9.9.9")  # the flood goes on: still only its own go
        pairs[8][0].sendall(b"x")
        assert pairs[8][1].recv(1) == b"x"
    finally:
        limit.close()
        for a, b in pairs:
            a.close()
            b.close()
