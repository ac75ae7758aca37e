"""Clients check that the store master knows the token too (issue 15.6).

A fake master that greets like kvctl's, asks for a login and then says "ok" to anything
got puts (their bytes), answered gets with its own bytes, and made clients write where it
said. With the token set, the client now requires the master's proof over both nonces.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvctl.net import auth
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.errors import StoreAuthError
from kvctl.store.settings import StoreSettings

TOKEN = "mutual-auth-0b7f"


class FakeMaster:
    """Greets as a kvctl master with auth on, and answers every login with Ok (with a
    proof made with the wrong token, or none)."""

    def __init__(self, proof_token: str | None) -> None:
        self.proof_token = proof_token
        self.logins = 0
        self.requests_after_login = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        codec = p.Codec()
        nonce = auth.new_nonce()
        try:
            codec.send(conn, p.Hello(version=p.PROTOCOL_VERSION, auth=True, nonce=nonce,
                                     max_frame_bytes=p.DEFAULT_MAX_FRAME_BYTES,
                                     login_binding=p.LOGIN_BINDING))
            login = codec.decode_request(codec.frames.recv(conn).payload)
            assert isinstance(login, p.Login)
            self.logins += 1
            proof = (auth.server_proof(self.proof_token, nonce, login.client_nonce,
                                       p.AUTH_CONTEXT) if self.proof_token else b"")
            codec.send(conn, p.Ok(proof=proof))
            while True:
                codec.frames.recv(conn)
                self.requests_after_login += 1
        except Exception:  # a fake: any way the connection ends is fine
            conn.close()

    def close(self) -> None:
        self._sock.close()


@pytest.fixture(params=[None, "wrong-token"], ids=["no-proof", "wrong-proof"])
def fake(request: pytest.FixtureRequest) -> Iterator[FakeMaster]:
    server = FakeMaster(request.param)
    yield server
    server.close()


def test_a_master_that_cannot_prove_the_token_gets_nothing(fake: FakeMaster) -> None:
    with pytest.raises(StoreAuthError) as info:
        StoreClient(fake.address, token=TOKEN)
    assert "did not prove" in info.value.cause
    assert fake.logins >= 1
    assert fake.requests_after_login == 0  # no put, get or status ever reached it


def test_the_real_master_proves_the_token_and_tenants_work() -> None:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=8 << 20,
                                     tenants=(f"alpha=tok-{TOKEN}",)), token=TOKEN) as store:
        with StoreClient(store.address, token=TOKEN) as admin:
            admin.put("k", b"v")
            assert admin.get("k") == b"v"
        with StoreClient(store.address, token=f"tok-{TOKEN}") as alpha:
            assert alpha.namespace == "alpha/"
