"""An RDMA exchange service that asks for no token is refused by an initiator that has one
(found in the issue 27.5 pass over every connection's handshake): before, the initiator
answered with zeros and took the service's QP info as the target's, so a relay that
cleared the greeting's token flag (or an impostor) chose the QP it connected to."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from kvctl.errors import AuthError
from kvctl.net import auth
from kvctl.transfer.transports.rdma.exchange import QpInfo, _send_frame, request_qp

MINE = QpInfo("mlx5_0", 1, 0, "fe80000000000000020c29fffe123456", 0x1234, 0xABCDE, 5)
THEIRS = {"qp": {"device": "mlx5_9", "port": 1, "lid": 0, "qpn": 0x999, "psn": 1, "mtu": 5,
                 "gid": "fe80000000000000020c29fffe999999"}}


def test_an_exchange_that_asks_for_no_token_is_refused_with_one() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[bool] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.sendall(b"\0" + auth.new_nonce())  # flag 0: no token asked
            conn.recv(auth.DIGEST_BYTES)
            conn.sendall(b"\0")
            served.append(True)
            _send_frame(conn, THEIRS)
            conn.recv(1)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(AuthError, match="asks for no token"):
            request_qp([f"127.0.0.1:{listener.getsockname()[1]}"], token="rdma-token",
                       initiator="i", target_nic="mlx5_0", mine=MINE, timeout_s=5)
    finally:
        listener.close()
        thread.join(5)
