"""Hostile publishers over real ZeroMQ sockets: what a broken or malicious engine sends must
end as a finding, never as a crash, and must not make the watch unbounded in time or memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvctl.keys.profiles import KeyConfig
from kvctl.keys.watch.checker import Finding
from kvctl.keys.watch.session import WatchOptions, WatchSession
from kvctl.keys.watch.source import MAX_REPLAY, Endpoint
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


class HostileReplay:
    """A ROUTER replay endpoint that misbehaves: ``never`` answers, ``floods`` (sends
    out-of-range messages until it is closed, bounded at 10**6), or answers ``garbage``.
    It keeps the start sequence numbers it was asked for."""

    def __init__(self, ctx: Any, url: str, mode: str) -> None:
        self.url, self.mode = url, mode
        self.asked: list[int] = []
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 1000)
        self.router.bind(url)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            if self.mode == "garbage":
                self.router.send_multipart([client, b"not", b"a reply"])
            for _ in range(10**6 if self.mode == "floods" else 0):
                if self.stop.is_set():
                    break
                try:
                    self.router.send_multipart([client, b"", b"", _seq(2**62), b"x" * 1000],
                                               zmq.NOBLOCK)
                except zmq.Again:
                    self.router.poll(10, zmq.POLLOUT)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.router.close(0)


@pytest.fixture
def hostile_replay(zctx: Any, ipc_dir: Path) -> Iterator[Callable[[str], HostileReplay]]:
    made: list[HostileReplay] = []

    def make(mode: str) -> HostileReplay:
        made.append(HostileReplay(zctx, f"ipc://{ipc_dir}/hostile-{mode}.replay", mode))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _gappy(pub: FixturePublisher, count: int, *, step: int = 2) -> None:
    """``count`` messages whose seqs skip (0, 2, 4...): a gap before every one but the first."""
    for i in range(count):
        pub.send_raw([b"", _seq(i * step), _batch(_stored(block_hashes=[i + 1]))])


def test_a_replay_endpoint_that_never_answers_cannot_stretch_the_duration(
        zctx: Any, publishers: Publishers, hostile_replay: Callable[[str], HostileReplay]
        ) -> None:
    pub, replay = publishers("a"), hostile_replay("never")
    session = WatchSession([Endpoint("a", pub.url, replay.url)], VLLM,
                           WatchOptions(duration_s=1.0, replay_timeout_s=5.0), context=zctx)
    with session:
        pub.wait_subscriber()
        _gappy(pub, 40)
        started = time.monotonic()
        session.run(threading.Event())
        took = time.monotonic() - started
        s = session.checker.stats("a")
    # was 40 gaps x 5 s of replay timeout; now the first replay waits what is left of the
    # duration, and the endpoint is not asked again at every gap
    assert took < 2.5, took
    assert len(replay.asked) == 1
    assert s.gaps == s.batches - 1 > 0
    assert s.gap_batches_lost == s.gaps


def test_a_flooding_replay_endpoint_is_cut_off(
        zctx: Any, publishers: Publishers, hostile_replay: Callable[[str], HostileReplay]
        ) -> None:
    pub, replay = publishers("a"), hostile_replay("floods")
    session = WatchSession([Endpoint("a", pub.url, replay.url)], VLLM,
                           WatchOptions(replay_timeout_s=60.0), context=zctx)
    with session:
        pub.wait_subscriber()
        started = time.monotonic()
        got, problem = session.subscriber.replay("a", 0, 5)
        took = time.monotonic() - started
    assert got == []  # nothing it sent was asked for, and none of it was kept
    assert problem is not None
    assert "more than" in problem
    assert took < 30, took  # not the 60 s timeout: cut off after a bounded count


def test_a_huge_gap_asks_a_bounded_replay(
        zctx: Any, publishers: Publishers, hostile_replay: Callable[[str], HostileReplay]
        ) -> None:
    pub, replay = publishers("a"), hostile_replay("garbage")
    session = WatchSession([Endpoint("a", pub.url, replay.url)], VLLM,
                           WatchOptions(replay_timeout_s=5.0), context=zctx)
    with session:
        pub.wait_subscriber()
        pub.send_raw([b"", _seq(0), _batch(_stored())])
        pub.send_raw([b"", _seq(2**60), _batch(_stored(block_hashes=[2]))])
        _until(session, lambda: session.checker.expected_seq("a") == 2**60 + 1)
        s = session.checker.stats("a")
    assert replay.asked == [2**60 - MAX_REPLAY]
    assert (s.gaps, s.gap_batches_lost) == (1, 2**60 - 1)


def test_reasons_a_publisher_chooses_stay_few(zctx: Any, publishers: Publishers) -> None:
    from kvctl.keys.watch.checker import MAX_REASONS, OTHER_REASONS

    pub = publishers("a")
    session, _ = _watch(zctx, pub)
    # every message a LoRA adapter of its own, whose path is not configured, and an extra
    # key of a type vLLM never publishes, 100 kB long
    payloads = [_batch(_stored(lora_name=f"l{i}", extra_keys=[[f"l{i}"]]),
                       _stored(block_hashes=[10**6 + i], extra_keys=[[{"k": "v" * 100_000}]]))
                for i in range(500)]
    with session:
        _send_all(session, pub, payloads)
        reasons = session.checker.stats("a").unverifiable
    assert len(reasons) == MAX_REASONS + 1
    assert reasons[OTHER_REASONS] == 500 - (MAX_REASONS - 1)  # the dict is one reason, kept
    assert max(len(why) for why in reasons) < 300


def test_a_hash_longer_than_a_digest_is_malformed(zctx: Any, publishers: Publishers) -> None:
    # every remembered hash is kept (chain, held blocks, owners): 100 kB "hashes" made 300
    # messages cost 110 MB
    pub = publishers("a")
    session, found = _watch(zctx, pub)
    long_hash = bytes(100_000)
    with session:
        _send_all(session, pub, [
            _batch(_stored(block_hashes=[long_hash])),
            _batch(_stored(block_hashes=[b"\1" * 32], parent_block_hash=long_hash)),
            _batch({"type": "BlockRemoved", "block_hashes": [long_hash]}),
            _batch(_stored(block_hashes=[b"\2" * 32]))])
        s = session.checker.stats("a")
        assert (s.unknown_events, s.blocks_seen) == (3, 1)
    assert [f.kind for f in found][:3] == ["unknown-event"] * 3
    assert "length <= 64" in found[0].message


def test_events_stops_at_the_message_that_reaches_it(zctx: Any, publishers: Publishers
                                                      ) -> None:
    from kvctl.keys.watch.source import Received

    pub = publishers("a")
    session, _ = _watch(zctx, pub, max_events=5)
    # one poll drains up to 10,000 messages an instance: give step() 500 at once
    burst = [Received("a", [b"", _seq(i), _batch(_stored(block_hashes=[i + 1]))], 1.0)
             for i in range(500)]
    session.subscriber.poll = lambda timeout_s: burst  # type: ignore[method-assign]
    with session:
        session.step(0)
        assert session.done()
        assert session.events == 5  # was all 500


def test_pool_figures_match_a_hand_count() -> None:
    from kvctl.keys.watch.checker import Checker
    from kvctl.keys.watch.hashing import event_hasher

    hasher = event_hasher(VLLM)
    x_d = hasher.block(None, list(range(16)), None, None, None)
    x = hasher.published_int(x_d)
    y = hasher.published_int(hasher.block(x_d, list(range(16, 32)), None, None, None))
    z = hasher.published_int(hasher.block(x_d, list(range(100, 116)), None, None, None))
    now = [100.0]
    checker = Checker(VLLM, window_s=10, clock=lambda: now[0])
    checker.add_instance("a")
    checker.add_instance("b")
    seqs = {"a": 0, "b": 0}

    def send(name: str, *events: Any) -> None:
        checker.feed(name, seqs[name], _batch(*events, ts=now[0]))
        seqs[name] += 1

    root = {"parent_block_hash": None, "token_ids": list(range(16))}
    send("a", _stored(block_hashes=[x, y], token_ids=list(range(32))))  # a: computes X, Y
    send("b", _stored(block_hashes=[x, z], token_ids=list(range(16)) + list(range(100, 116))))
    # b: computes X (a holds it: 16 duplicated tokens) and Z (nobody holds it)
    send("a", {"type": "BlockRemoved", "block_hashes": [x]})  # a: holds Y
    send("b", {"type": "AllBlocksCleared"})  # b: holds nothing
    now[0] = 120.0  # past the 10 s window
    send("b", _stored(block_hashes=[x], **root))  # b computes X; a does not hold it
    send("b", _stored(block_hashes=[x], **root))  # a prefix hit re-announced: reuse
    send("a", _stored(block_hashes=[x], **root))  # a computes X; b holds it: 16 duplicated
    a, b = checker.stats("a"), checker.stats("b")
    assert (a.computed_blocks, a.computed_tokens, a.duplicate_tokens, a.reused_blocks) == (
        3, 48, 16, 0)
    assert (b.computed_blocks, b.computed_tokens, b.duplicate_tokens, b.reused_blocks) == (
        3, 48, 16, 1)
    assert (a.verified, b.verified, a.mismatched + b.mismatched) == (3, 4, 0)
    assert (checker.held("a"), checker.held("b")) == (2, 1)  # a: Y, X; b: X
    assert (a.removed_blocks, b.cleared) == (1, 1)
    wa, wb = checker.window("a"), checker.window("b")
    assert (wa.computed_tokens, wa.duplicate_tokens) == (16, 16)  # the last X only
    assert (wb.computed_tokens, wb.duplicate_tokens) == (16, 0)


def test_an_unknown_tag_is_shortened_in_its_warning(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    session, found = _watch(zctx, pub)
    with session:
        _send_all(session, pub, [_batch({"type": "X" * 1_000_000})])
    assert [f.kind for f in found] == ["unknown-event"]
    assert len(found[0].message) < 300  # was the whole megabyte, in every warning
    assert found[0].details["type"] == "X" * 64


def test_a_message_over_the_bound_is_never_taken_in_and_the_watch_reconnects(
        zctx: Any, publishers: Publishers) -> None:
    from kvctl.keys.watch.source import MAX_MESSAGE_BYTES

    pub = publishers("a")
    session, _ = _watch(zctx, pub)
    with session:
        big = MAX_MESSAGE_BYTES // 4  # tokens of 5 bytes each in msgpack
        pub.send_raw([b"", _seq(0), _batch(_stored(token_ids=[2**31] * big, block_size=big))])
        # ZeroMQ drops the connection without retrying; the watch connects again: publish
        # until a message arrives
        deadline = time.monotonic() + 20
        seq = 1
        while session.checker.expected_seq("a") is None:
            assert time.monotonic() < deadline, session.summary()
            pub.send_raw([b"", _seq(seq), _batch(_stored(block_hashes=[seq]))])
            seq += 1
            session.step(0.05)
        s = session.checker.stats("a")
        assert s.gaps == 1  # message 0, the big one, never came in
        assert s.gap_batches_lost >= 1
