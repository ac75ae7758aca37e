"""Security properties of every listener: loopback by default (anything else logged), token
authentication on the metadata server, transfer targets, the store master and the store
nodes' data path, and the token never shown: not in logs, exceptions, --json, metadata
values, or on the wire."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.bench.spec import BenchSettings
from kvctl.keys.chain import SeedFields
from kvctl.keys.profiles import KeyConfig, known_profiles
from kvctl.keys.prompts import Prompt
from kvctl.keys.selfcheck import tenant_isolation
from kvctl.metadata import MetadataServer, open_metadata
from kvctl.metadata.base import MetadataError
from kvctl.metadata.settings import MetadataSettings
from kvctl.net import auth
from kvctl.net.bind import parse_listen
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.errors import StoreAuthError
from kvctl.store.master import MasterCore
from kvctl.store.server import MasterServer
from kvctl.store.settings import StoreSettings
from kvctl.transfer import OpCode, TransferEngine, TransferRequest
from kvctl.transfer import protocol as tp
from kvctl.transfer.server import TargetServer
from kvctl.transfer.settings import SegmentSettings
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]


def _token() -> str:
    return f"s3cr3t-{uuid.uuid4().hex}"


def _absent(token: str, text: str | bytes) -> bool:
    forms = [token, base64.b64encode(token.encode()).decode(), token.encode().hex()]
    if isinstance(text, bytes):
        return not any(f.encode() in text for f in forms)
    return not any(f in text for f in forms)


# ------------------------------------------------------------------ binds


def test_every_listener_binds_loopback_by_default() -> None:
    target = TargetServer(lambda _i: None, lambda _s, _m: None)
    master = MasterServer(MasterCore())
    meta = MetadataServer(port=0).start()
    try:
        assert target.host == "127.0.0.1"
        assert master.host == "127.0.0.1"
        assert meta.host == "127.0.0.1"
        assert meta.url.startswith("http://127.0.0.1:")
    finally:
        target.close()
        master.close()
        meta.stop()
    # What the commands bind when nothing is configured.
    for listen in (MetadataSettings().listen, StoreSettings().listen,
                   StoreSettings().node_listen, SegmentSettings().listen,
                   BenchSettings().listen):
        assert parse_listen(listen)[0] == "127.0.0.1", listen


def test_engine_and_store_node_default_to_loopback() -> None:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=4 << 20)) as store:
        assert store.node.endpoint.startswith("127.0.0.1:")
        assert store.address.startswith("127.0.0.1:")
    with TransferEngine("sec-default", metadata=f"memory://{uuid.uuid4().hex}") as engine:
        engine.register_memory("sec-default.buf", [bytearray(64)])
        assert (engine.address or "").startswith("127.0.0.1:")


@pytest.mark.parametrize("kind", ["target", "master", "metadata"])
def test_binding_beyond_loopback_is_logged_as_a_warning(
        caplog: pytest.LogCaptureFixture, kind: str) -> None:
    caplog.set_level(logging.INFO, logger="kvctl.net")
    with contextlib.ExitStack() as stack:
        if kind == "target":
            stack.callback(TargetServer(lambda _i: None, lambda _s, _m: None,
                                        host="0.0.0.0").close)
            stack.callback(TargetServer(lambda _i: None, lambda _s, _m: None).close)
        elif kind == "master":
            stack.callback(MasterServer(MasterCore(), host="0.0.0.0").close)
            stack.callback(MasterServer(MasterCore()).close)
        else:
            stack.callback(MetadataServer("0.0.0.0", 0).start().stop)
            stack.callback(MetadataServer(port=0).start().stop)
    records = [r for r in caplog.records if r.name == "kvctl.net"]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "0.0.0.0" in warnings[0].getMessage()
    assert "explicit choice" in warnings[0].getMessage()
    loopback = [r for r in records if "127.0.0.1" in r.getMessage()]
    assert loopback
    assert all(r.levelno == logging.INFO for r in loopback)


# ------------------------------------------------------------------ a token everywhere


class Secured:
    """Every kind of listener with one token: metadata server, a transfer target engine
    publishing on it, and an embedded store (master + node)."""

    def __init__(self, token: str, advertise: str | None = None) -> None:
        self.token = token
        self.meta = MetadataServer(port=0, token=token).start()
        self.target = TransferEngine("sec-target", metadata=self.meta.url, token=token,
                                     advertise=(advertise,) if advertise else ())
        self.buffer = bytearray(4096)
        self.target.register_memory("sec-target.buf", [self.buffer])
        self.store = EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=8 << 20),
                                   token=token)

    def initiator(self, token: str | None) -> TransferEngine:
        engine = TransferEngine(f"sec-init-{uuid.uuid4().hex[:6]}", metadata=self.meta.url,
                                token=self.token, transport="tcp", timeout_s=5)
        # The metadata service is readable with the right token; the data path is then
        # tried with ``token`` (TransferEngine signs metadata and answers targets alike, so
        # a wrong-token initiator gets its own engine with a separate metadata client).
        if token != self.token:
            engine.close()
            engine = TransferEngine(f"sec-init-{uuid.uuid4().hex[:6]}",
                                    metadata=open_metadata(self.meta.url, token=self.token),
                                    token=token, transport="tcp", timeout_s=5)
        engine.register_memory(f"{engine.name}.buf", [bytearray(4096)])
        return engine

    def close(self) -> None:
        self.store.close()
        self.target.close()
        self.meta.stop()


@pytest.fixture
def secured() -> Iterator[Secured]:
    s = Secured(_token())
    yield s
    s.close()


def test_metadata_server_refuses_missing_and_wrong_tokens(secured: Secured) -> None:
    for token in (None, "wrong-" + secured.token):
        with open_metadata(secured.meta.url, token=token) as client, \
                pytest.raises(MetadataError) as err:
            client.put("kvctl/x", b"v")
        assert _absent(secured.token, str(err.value) + (err.value.hint or ""))
    with open_metadata(secured.meta.url, token=secured.token) as client:
        client.put("kvctl/x", b"v")
        assert client.get("kvctl/x") == b"v"


def _transfer(engine: TransferEngine) -> None:
    engine.transfer([TransferRequest(OpCode.WRITE, f"{engine.name}.buf", 0, "sec-target.buf",
                                     0, 128)], timeout_s=10)


@pytest.mark.parametrize("token", [None, "wrong"])
def test_transfer_target_refuses_missing_and_wrong_tokens(secured: Secured,
                                                          token: str | None) -> None:
    engine = secured.initiator(token)
    try:
        with pytest.raises(Exception) as err:
            _transfer(engine)
        assert "auth" in str(err.value).lower() or "token" in str(err.value).lower()
        assert _absent(secured.token, str(err.value))
    finally:
        engine.close()
    good = secured.initiator(secured.token)
    try:
        _transfer(good)
    finally:
        good.close()


def test_store_master_refuses_missing_and_wrong_tokens(secured: Secured) -> None:
    for token in (None, "wrong"):
        with pytest.raises(StoreAuthError) as err:
            StoreClient(secured.store.address, token=token)
        assert _absent(secured.token, str(err.value) + (err.value.hint or ""))
    with StoreClient(secured.store.address, token=secured.token, transport="tcp") as client:
        client.put("k", b"v" * 100)
        assert client.get("k") == b"v" * 100


def _node_verdict(endpoint: str, token: str | None) -> int:
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        hello = b""
        while len(hello) < tp.HELLO.size:
            hello += sock.recv(tp.HELLO.size - len(hello))
        _magic, _version, flags, nonce = tp.HELLO.unpack(hello)
        assert flags & tp.FLAG_AUTH, "the node's data path does not ask for the token"
        digest = auth.respond(token, nonce, tp.AUTH_CONTEXT) if token else bytes(32)
        sock.sendall(tp.ANSWER.pack(tp.MAGIC, tp.VERSION, digest, bytes(32)))
        verdict = b""
        while len(verdict) < tp.VERDICT.size:
            chunk = sock.recv(tp.VERDICT.size - len(verdict))
            if not chunk:
                break
            verdict += chunk
        return int(tp.VERDICT.unpack(verdict)[1])


def test_store_node_data_path_requires_the_token(secured: Secured) -> None:
    endpoint = secured.store.node.endpoint
    assert _node_verdict(endpoint, None) == tp.Verdict.AUTH_REFUSED
    assert _node_verdict(endpoint, "wrong") == tp.Verdict.AUTH_REFUSED
    assert _node_verdict(endpoint, secured.token) == tp.Verdict.OK


# ------------------------------------------------------------------ never shown


def test_token_never_logged_over_a_whole_session(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = _token()
    s = Secured(token)
    try:
        with open_metadata(s.meta.url, token=token) as client:
            client.put("kvctl/log-check", b"x")
            client.list("kvctl/")
        for t in (token, "wrong", None):
            engine = s.initiator(t)
            with contextlib.suppress(Exception):
                _transfer(engine)
            engine.close()
        with StoreClient(s.store.address, token=token, transport="tcp") as store:
            store.put("log-check", os.urandom(2000))
            store.get("log-check")
        with contextlib.suppress(StoreAuthError):
            StoreClient(s.store.address, token="wrong")
    finally:
        s.close()
    assert len(caplog.records) > 10
    for record in caplog.records:
        text = record.getMessage() + repr(record.args) + str(record.exc_info or "")
        assert _absent(token, text), record.name


def test_token_absent_from_errors_json_and_metadata_values(
        kvctl: Kvctl, secured: Secured, monkeypatch: pytest.MonkeyPatch,
        tmp_path: os.PathLike[str]) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    token = secured.token
    outputs: list[str] = []
    env = {"KVCTL_TOKEN": token, "KVCTL_METADATA": secured.meta.url}
    for argv in (["metadata", "ls"], ["metadata", "ls", "--json"],
                 ["segment", "list", "--json"], ["segment", "show", "sec-target.buf", "--json"],
                 ["store", "status", "-m", secured.store.address, "--json"],
                 ["doctor", "env", "--json"]):
        result = kvctl(*argv, env=env)
        assert result.exit_code == 0, (argv, result.stderr)
        outputs.append(result.stdout + result.stderr)
    # The listing really shows the published entries (JSON: the table may wrap a long key).
    assert "sec-target.buf" in outputs[1]
    # Failing commands with tracebacks on (KVCTL_DEBUG=1): the wrong token must not show
    # either, and neither must the right one.
    wrong = _token()
    debug = {"KVCTL_TOKEN": wrong, "KVCTL_DEBUG": "1"}
    for argv, code in ((["metadata", "ls", "-m", secured.meta.url], 3),
                       (["store", "status", "-m", secured.store.address], 3),
                       (["store", "status", "-m", "127.0.0.1:1"], 3)):
        result = kvctl(*argv, env=debug)
        assert result.exit_code == code, (argv, result.stderr)
        assert "Traceback" in result.stderr  # the debug path really ran
        outputs.append(result.stdout + result.stderr)
        assert _absent(wrong, result.stdout + result.stderr), argv
    for text in outputs:
        assert _absent(token, text)


class RecordingProxy:
    """Loopback TCP proxy that records every byte in both directions."""

    def __init__(self) -> None:
        self.upstream: tuple[str, int] | None = None
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            assert self.upstream is not None
            server = socket.create_connection(self.upstream)
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    self.seen += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()


def test_token_never_crosses_the_wire() -> None:
    token = _token()
    meta_proxy, target_proxy, store_proxy = RecordingProxy(), RecordingProxy(), RecordingProxy()
    s = Secured(token, advertise=target_proxy.address)
    try:
        meta_proxy.upstream = ("127.0.0.1", s.meta.port)
        host, _, port = (s.target.address or "").rpartition(":")
        target_proxy.upstream = (host, int(port))
        host, _, port = s.store.address.rpartition(":")
        store_proxy.upstream = (host, int(port))
        proxied_url = f"http://{meta_proxy.address}"
        with open_metadata(proxied_url, token=token) as client:
            client.put("kvctl/wire", b"x")
            assert client.get("kvctl/wire") == b"x"
        engine = TransferEngine("sec-wire", metadata=open_metadata(proxied_url, token=token),
                                token=token, transport="tcp", timeout_s=10)
        try:
            engine.register_memory("sec-wire.buf", [bytearray(4096)])
            _transfer(engine)
        finally:
            engine.close()
        with StoreClient(store_proxy.address, token=token, transport="tcp") as store:
            store.put("wire", b"y" * 300)
            assert store.get("wire") == b"y" * 300
    finally:
        for proxy in (meta_proxy, target_proxy, store_proxy):
            proxy.close()
        s.close()
    for proxy in (meta_proxy, target_proxy, store_proxy):
        assert len(proxy.seen) > 100  # traffic really went through the proxy
        assert _absent(token, bytes(proxy.seen))


# ------------------------------------------------------------------ tenant isolation

#: Profiles that isolate tenants: by the tenant seed field (kvctl) or by cache_salt (vLLM,
#: SGLang). LMCache mixes neither, and `verify-keys --tenant-isolation` reports that.
ISOLATING = sorted(n for n, p in known_profiles().items()
                   if {"tenant", "cache_salt"} & p.mixed(KeyConfig().key_format))
BLOCK = 4


def _keys(profile: str, tenant: str, prompts: list[list[int]]) -> set[str]:
    config = KeyConfig(profile=profile, block_size=BLOCK, pythonhashseed="0")
    mixed = known_profiles()[profile].mixed(config.key_format)
    out: set[str] = set()
    for i, tokens in enumerate(prompts):
        prompt = Prompt(f"p{i}", tuple(tokens))
        if "tenant" in mixed:
            cfg = KeyConfig(profile=profile, block_size=BLOCK, pythonhashseed="0",
                            fields=SeedFields(tenant=tenant))
            out |= set(known_profiles()[profile].keyer(cfg).keys(prompt))
        else:
            prompt = Prompt(prompt.id, prompt.tokens, cache_salt=tenant)
            out |= set(known_profiles()[profile].keyer(config).keys(prompt))
    return out


@settings(max_examples=60, deadline=None)
@given(profile=st.sampled_from(ISOLATING),
       tenants=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=3, unique=True),
       prompts=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=BLOCK,
                                 max_size=BLOCK * 5), min_size=1, max_size=4))
def test_keys_of_different_tenants_never_collide(profile: str, tenants: list[str],
                                                 prompts: list[list[int]]) -> None:
    keys = {t: _keys(profile, t, prompts) for t in tenants}
    for i, a in enumerate(tenants):
        assert keys[a], "every prompt here has at least one full block"
        for b in tenants[i + 1:]:
            assert not keys[a] & keys[b], (profile, a, b)


@settings(max_examples=25, deadline=None)
@given(profile=st.sampled_from(ISOLATING),
       tenants=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=3, unique=True))
def test_verify_keys_tenant_isolation_passes_for_any_tenants(profile: str,
                                                             tenants: list[str]) -> None:
    results = tenant_isolation(KeyConfig(profile=profile, pythonhashseed="0"), tenants)
    assert results
    assert all(r.passed for r in results), [r for r in results if not r.passed]
