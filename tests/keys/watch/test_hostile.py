"""Hostile publishers over real ZeroMQ sockets: what a broken or malicious engine sends must
end as a finding, never as a crash, and must not make the watch unbounded in time or memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvctl.keys.profiles import KeyConfig
from kvctl.keys.watch.checker import Finding
from kvctl.keys.watch.session import WatchOptions, WatchSession
from kvctl.keys.watch.source import Endpoint
from tests.keys.watch.publisher import FixturePublisher

Publishers = Callable[[str], FixturePublisher]
VLLM = KeyConfig(profile="vllm:sha256_cbor", block_size=16)
SGLANG = KeyConfig(profile="sglang", block_size=16)


def _seq(i: int) -> bytes:
    return i.to_bytes(8, "big")


def _stored(**fields: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1],
                             "parent_block_hash": None, "token_ids": list(range(16)),
                             "block_size": 16}
    event.update(fields)
    return event


def _batch(*events: Any, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _watch(zctx: Any, pub: FixturePublisher, config: KeyConfig = VLLM, *,
           replay: bool = False, **opts: Any) -> tuple[WatchSession, list[Finding]]:
    found: list[Finding] = []
    session = WatchSession([Endpoint("a", pub.url, pub.replay_url if replay else None)],
                           config, WatchOptions(**opts), on_finding=found.append, context=zctx)
    pub.wait_subscriber()
    return session, found


def _until(session: WatchSession, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, session.summary()
        session.step(0.05)


def _send_all(session: WatchSession, pub: FixturePublisher, payloads: list[bytes]) -> None:
    """Publish ``payloads`` as seq 0.. and wait until the watch has taken them all."""
    for i, payload in enumerate(payloads):
        pub.send_raw([b"", _seq(i), payload])
    _until(session, lambda: session.checker.expected_seq("a") == len(payloads))


def test_an_event_nested_past_the_recursion_limit_is_a_bad_event(
        zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    # a BlockStored whose extra_keys nest 100,000 deep: msgspec raises RecursionError
    head = _batch(_stored(extra_keys=[]))
    bomb = head[:-2] + b"\x91" * 100_000 + b"\xc0" + head[-1:]
    deep_top = b"\x91" * 100_000 + b"\xc0"  # the payload itself
    session, found = _watch(zctx, pub)
    with session:
        _send_all(session, pub, [bomb, deep_top, _batch(_stored())])
        assert session.checker.stats("a").blocks_seen == 1  # the watch goes on
    assert [f.kind for f in found][:2] == ["bad-frame", "bad-frame"]


def test_fields_the_hash_function_rejects_are_unverifiable_never_fatal(
        zctx: Any, publishers: Publishers) -> None:
    # SGLang hashes tokens as uint32: a negative one cannot be hashed (was a UsageError)
    pub = publishers("s")
    session, found = _watch(zctx, pub, SGLANG)
    with session:
        _send_all(session, pub, [_batch(_stored(token_ids=[-5] * 16))])
        s = session.checker.stats("a")
        assert (s.blocks_seen, s.mismatched) == (1, 0)
        assert list(s.unverifiable) == [
            "its fields cannot be hashed as the engine hashes them (UsageError): not an "
            "engine's event"]
    assert found == []


def test_a_mismatch_with_extra_keys_too_deep_to_pickle_is_diagnosed(
        zctx: Any, publishers: Publishers) -> None:
    # sha256_cbor hashes 900 levels; the diagnosis tries sha256 (pickle), which recurses
    # too deep (was a RecursionError out of the watch)
    pub = publishers("a")
    session, found = _watch(zctx, pub)
    with session:
        _send_all(session, pub, [_batch(_stored(extra_keys=[[_nested(900)]]))])
        assert session.checker.stats("a").mismatched == 1
    assert [f.kind for f in found] == ["mismatch"]
