"""Keys, names and tokens that are not UTF-8 get typed errors, never a bare
``UnicodeEncodeError`` (issue 27.13).

Python hands bytes that are not UTF-8 (from argv, the environment, ``os.fsdecode``) over as
lone surrogates: ``'surrogate\\udcff'``. Every store call with such a key raised
``UnicodeEncodeError`` from msgspec while the master's other odd keys (empty, too long,
unprintable) were a ``BadRequestError``; so did a metadata key or segment name on the CLI
("this is a bug in kvctl") and a token with such bytes. The master decodes requests with
msgspec, which refuses strings that are not UTF-8: a raw frame carrying one is a
``bad_request`` reply and the connection stays usable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from kvctl.errors import ConfigError, KvctlError
from kvctl.net import auth
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.errors import BadRequestError
from kvctl.store.rpc import MasterConnection
from kvctl.store.settings import StoreSettings
from kvctl.transfer.engine import TransferEngine
from tests.fixtures.cli import CliResult

BAD = "surrogate\udcff"
Kvctl = Callable[..., CliResult]


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=16 << 20)) as running:
        yield running.address


def _calls(client: StoreClient) -> dict[str, Callable[[], object]]:
    return {
        "put": lambda: client.put(BAD, b"v"),
        "get": lambda: client.get(BAD),
        "get_into": lambda: client.get_into(BAD, bytearray(8)),
        "exists": lambda: client.exists(BAD),
        "remove": lambda: client.remove(BAD),
        "stat": lambda: client.stat(BAD),
        "pin": lambda: client.pin(BAD),
        "list": lambda: client.list(BAD),
        "drop_node": lambda: client.drop_node(BAD),
    }


def test_every_store_call_with_a_lone_surrogate_is_a_bad_request(store: str) -> None:
    with StoreClient(store) as client:
        client.put("fine", b"ok")
        for name, call in _calls(client).items():
            with pytest.raises(BadRequestError, match="not valid UTF-8"):
                call()
            assert client.get("fine") == b"ok", name  # the client is still in step


def test_batches_answer_per_key_like_other_odd_keys(store: str) -> None:
    with StoreClient(store) as client:
        put = client.batch_put([(BAD, b"v"), ("fine-2", b"ok"), ("bad\x00", b"v")])
        assert [type(e).__name__ for e in put] == ["BadRequestError", "NoneType",
                                                  "BadRequestError"]
        got = client.batch_get([BAD, "fine-2", "bad\x00", ""])
        assert isinstance(got[0], BadRequestError)
        assert "not valid UTF-8" in got[0].cause
        assert got[1] == b"ok"
        assert [type(g).__name__ for g in got[2:]] == ["BadRequestError"] * 2
        into = client.batch_get_into([BAD, "fine-2"], [bytearray(8), bytearray(8)])
        assert isinstance(into[0], BadRequestError)
        assert into[1] == 2


def test_the_master_refuses_a_frame_that_is_not_utf8(store: str) -> None:
    conn = MasterConnection(store)
    try:
        good = msgspec.msgpack.encode(p.Exists(keys=["surrogate?"]))
        raw = good.replace(b"surrogate?", b"surrogate\xff")
        conn._sock.sendall(conn._codec.frames.encode_header(p.PROTOCOL_VERSION, len(raw))
                           + raw)
        reply = conn.recv()
        assert isinstance(reply, p.Fail)
        assert reply.error.code == "bad_request"
        assert isinstance(conn.call(p.Exists(keys=["surrogate?"])), p.Bools)  # still usable
    finally:
        conn.close()


def test_a_token_that_is_not_utf8_is_a_config_error_and_not_shown(store: str) -> None:
    with pytest.raises(ConfigError) as caught:
        auth.respond("tok\udcff-secret", b"n", b"ctx")
    assert "secret" not in caught.value.cause + (caught.value.hint or "")
    with pytest.raises(ConfigError):
        auth.sign_request("tok\udcff", "GET", "/", b"")
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=8 << 20),
                       token="good") as guarded, pytest.raises(ConfigError):
        StoreClient(guarded.address, token="tok\udcff")


def test_segment_names_that_are_not_utf8_are_usage_errors() -> None:
    with TransferEngine("surrogates", metadata="memory://surrogates") as engine:
        for call in (lambda: engine.lookup(BAD), lambda: engine.open_segment(BAD),
                     lambda: engine.register_segment(BAD, 4096)):
            with pytest.raises(KvctlError, match=r"not (a )?valid"):
                call()


@pytest.mark.parametrize("args", [
    ("store", "get", BAD), ("store", "ls", BAD), ("store", "rm", BAD),
    ("store", "stat", BAD), ("store", "node", "rm", BAD),
])
def test_cli_store_commands_exit_2(kvctl: Kvctl, store: str, args: tuple[str, ...]) -> None:
    r = kvctl(*args, "--master", store)
    assert r.exit_code == 2, r.stderr
    assert "not valid UTF-8" in r.stderr
    assert "Hint:" in r.stderr
    assert "bug in kvctl" not in r.stderr


@pytest.mark.parametrize("args", [
    ("metadata", "get", BAD), ("metadata", "ls", BAD), ("segment", "show", BAD),
    ("segment", "rm", BAD),
])
def test_cli_metadata_and_segment_commands_exit_2(kvctl: Kvctl, tmp_path: Path,
                                                  args: tuple[str, ...]) -> None:
    r = kvctl(*args, "--metadata", f"file://{tmp_path}")
    assert r.exit_code == 2, r.stderr
    assert "not valid UTF-8" in r.stderr
    assert "bug in kvctl" not in r.stderr
