"""Hostile checks of today's transfer protocol v2 (frame MACs): what a relay or an impostor
at a target's address can still do to a client that holds a token."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvctl.net import auth
from kvctl.net.framing import FrameError, recv_exact
from kvctl.transfer import TransferEngine
from kvctl.transfer import protocol as p
from kvctl.transfer.errors import AuthError
from kvctl.transfer.transports import tcp
from tests.transfer._helpers import memory_url

TOKEN = "hostile-today-token"
SIZE = 1 << 16


@contextlib.contextmanager
def _listener() -> Iterator[socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    try:
        yield srv
    finally:
        srv.close()


def _connect(host: str, port: int) -> None:
    sock = tcp.open_connection(host, port, token=TOKEN, local_address=None,
                               connect_timeout_s=5, timeout_s=5)
    sock.close()


def _impostor(srv: socket.socket, seen: list[bytes]) -> None:
    """A target that asks for no token and says OK to anything, then records frames."""
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(10)
        with contextlib.suppress(OSError, FrameError):  # the client may hang up first
            conn.sendall(p.HELLO.pack(p.MAGIC, p.VERSION, 0, bytes(auth.NONCE_BYTES)))
            recv_exact(conn, p.ANSWER.size)
            conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.OK, bytes(auth.DIGEST_BYTES)))
            seen.append(conn.recv(1 << 16))


def test_a_client_with_a_token_refuses_a_target_that_asks_for_none() -> None:
    """Downgrade: an impostor (or a relay that clears FLAG_AUTH in the HELLO) answers with
    no proof at all; a client holding a token must not take it as the target."""
    with _listener() as srv:
        seen: list[bytes] = []
        thread = threading.Thread(target=_impostor, args=(srv, seen), daemon=True)
        thread.start()
        host, port = srv.getsockname()[:2]
        with pytest.raises(AuthError, match="asks for no token"):
            _connect(host, port)
        thread.join(10)
        assert not any(seen), "the client sent a frame to a target that proved nothing"


def _strip_auth_relay(srv: socket.socket, real: tuple[str, int], forged: list[bytes]) -> None:
    """A relay in front of the real target: it clears FLAG_AUTH in the real HELLO and, as
    the real target would refuse a zero answer, says OK itself and serves forged data."""
    conn, _ = srv.accept()
    with conn, socket.create_connection(real, timeout=10) as up:
        conn.settimeout(10)
        magic, version, _flags, nonce = p.HELLO.unpack(recv_exact(up, p.HELLO.size))
        with contextlib.suppress(OSError, FrameError):  # the client may hang up first
            conn.sendall(p.HELLO.pack(magic, version, 0, nonce))
            recv_exact(conn, p.ANSWER.size)
            conn.sendall(p.VERDICT.pack(p.MAGIC, p.Verdict.OK, bytes(auth.DIGEST_BYTES)))
            head = recv_exact(conn, p.HEADER.size)
            _, _, _, tag, count, _ = p.HEADER.unpack(head)
            entries = recv_exact(conn, p.ENTRY.size * count)
            length = sum(e[2] for e in p.ENTRY.iter_unpack(entries))
            conn.sendall(p.HEADER.pack(p.FrameType.RESP, p.WireStatus.OK, 0, tag, p.NO_INDEX,
                                       length) + b"F" * length)
            forged.append(b"F" * length)


def test_a_relay_that_clears_the_auth_flag_cannot_serve_forged_reads() -> None:
    with TransferEngine("hostile-target", memory_url(), token=TOKEN) as target, \
            _listener() as srv:
        target.register_segment("vault", SIZE)
        host, _, port = (target.address or "").rpartition(":")
        forged: list[bytes] = []
        thread = threading.Thread(target=_strip_auth_relay,
                                  args=(srv, (host, int(port)), forged), daemon=True)
        thread.start()
        rhost, rport = srv.getsockname()[:2]
        with pytest.raises(AuthError, match="asks for no token"):
            _connect(rhost, rport)
        thread.join(10)
        assert not forged

