"""The watch against streams recorded from vLLM 0.33.0's and SGLang 0.5.23's own publishers
(tests/keys/events/), published over real ZeroMQ sockets: gaps and replay, a restart, two
instances that disagree, a wrong hash algorithm, garbage, a dead endpoint."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvctl.keys.profiles import KeyConfig
from kvctl.keys.profiles.base import EngineOptions
from kvctl.keys.watch.checker import Finding
from kvctl.keys.watch.session import WatchOptions, WatchSession
from kvctl.keys.watch.source import Endpoint
from tests.keys.watch.publisher import FixturePublisher, fixture_messages

Publishers = Callable[[str], FixturePublisher]
LORA = EngineOptions(lora_paths=(("sql-lora", "/adapters/sql-lora"),))
VLLM = KeyConfig(profile="vllm:sha256_cbor", block_size=16, options=LORA)
#: Blocks in each recorded vLLM stream, and those still held at its end.
VLLM_BLOCKS, VLLM_HELD = 47, 22


def _session(zctx: Any, pubs: list[FixturePublisher], config: KeyConfig = VLLM,
             *, replay: bool = True, **opts: Any) -> tuple[WatchSession, list[Finding]]:
    found: list[Finding] = []
    endpoints = [Endpoint(p.url.rsplit("/", 1)[1].split(".")[0], p.url,
                          p.replay_url if replay else None) for p in pubs]
    session = WatchSession(endpoints, config, WatchOptions(**opts), on_finding=found.append,
                           context=zctx)
    for p in pubs:
        p.wait_subscriber()
    return session, found


def _until(session: WatchSession, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, session.summary()
        session.step(0.05)


def _publish(pub: FixturePublisher, name: str, *, skip: range = range(0)) -> int:
    messages = fixture_messages(name)
    for m in messages:
        assert m.seq is not None
        pub.send(m.seq, m.payload, live=m.seq not in skip)
    return len(messages)


def _checked(session: WatchSession, name: str, count: int) -> None:
    _until(session, lambda: session.checker.expected_seq(name) == count)


def test_a_vllm_stream_verifies_block_by_block(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    session, found = _session(zctx, [pub])
    with session:
        n = _publish(pub, "vllm_sha256_cbor")
        _checked(session, "a", n)
        s = session.checker.stats("a")
        assert (s.blocks_seen, s.verified, s.mismatched) == (VLLM_BLOCKS, VLLM_BLOCKS, 0)
        assert s.unverifiable == {}
        # stored minus removed, with AllBlocksCleared resetting the count
        assert session.checker.held("a") == VLLM_HELD
        assert s.cleared == 1
        assert s.removed_blocks == 6
        doc = session.summary(final=True)
    assert doc["ok"], doc["checks"]
    assert found == []


def test_bytes_hashes_and_sglang_verify(zctx: Any, publishers: Publishers) -> None:
    a, s = publishers("a"), publishers("s")
    session, _ = _session(zctx, [a])
    with session:
        _checked(session, "a", _publish(a, "vllm_sha256_cbor_bytes"))
        assert session.checker.stats("a").verified == VLLM_BLOCKS
    session, found = _session(zctx, [s], KeyConfig(profile="sglang", block_size=16))
    with session:
        _checked(session, "s", _publish(s, "sglang"))
        st = session.checker.stats("s")
        assert st.verified == st.blocks_seen > 0
        assert st.mismatched == 0
    assert found == []


def test_a_gap_is_filled_from_the_replay_endpoint(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    session, found = _session(zctx, [pub])
    with session:
        n = _publish(pub, "vllm_sha256_cbor", skip=range(3, 7))
        _checked(session, "a", n)
        s = session.checker.stats("a")
        assert s.verified == VLLM_BLOCKS
        assert s.gaps_filled == 1
        assert s.gaps == 0
    assert [f.kind for f in found] == ["gap-filled"]
    assert "3..6 filled" in found[0].message


def test_a_late_join_without_replay_says_what_it_could_not_verify(
        zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    session, found = _session(zctx, [pub], replay=False)
    with session:
        n = _publish(pub, "vllm_sha256_cbor", skip=range(2))
        _checked(session, "a", n)
        s = session.checker.stats("a")
        assert s.mismatched == 0
        assert s.gaps == 1
        assert s.gap_batches_lost == 2
        reasons = " ".join(s.unverifiable)
        assert "parent block never seen" in reasons
        assert "from their root" in reasons
        assert s.blocks_seen == VLLM_BLOCKS - 9  # the 2 lost messages stored 9 blocks
        assert s.verified + sum(s.unverifiable.values()) == s.blocks_seen
        doc = session.summary(final=True)
    gap = next(f for f in found if f.kind == "gap")
    assert "joined after the publisher started" in gap.message
    assert "no replay endpoint" in gap.message
    assert doc["instances"][0]["unverifiable_blocks"] > 0


def test_a_publisher_restart_resets_what_it_holds(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    session, found = _session(zctx, [pub])
    with session:
        n = _publish(pub, "vllm_sha256_cbor")
        _checked(session, "a", n)
        for m in fixture_messages("vllm_sha256_cbor")[:3]:  # the engine starts again
            assert m.seq is not None
            pub.send(m.seq, m.payload)
        _checked(session, "a", 3)
        s = session.checker.stats("a")
        assert s.restarts == 1
        assert s.mismatched == 0
        assert session.checker.held("a") == 8 + 1 + 4  # what its first 3 messages stored
    assert [f.kind for f in found] == ["restart"]


def test_two_instances_with_different_seeds_diverge(zctx: Any, publishers: Publishers) -> None:
    a, b = publishers("a"), publishers("b")
    session, found = _session(zctx, [a, b])
    with session:
        _checked(session, "a", _publish(a, "vllm_sha256_cbor"))
        _checked(session, "b", _publish(b, "vllm_sha256_cbor_seed1"))
        doc = session.summary(final=True)
    div = [f for f in found if f.kind == "divergence"]
    assert len(div) == 1
    assert div[0].details["instances"] == ["a", "b"]
    assert div[0].details["root"] is True
    assert "a and b hash the same blocks differently" in div[0].message
    mismatch = next(f for f in found if f.kind == "mismatch")
    assert mismatch.instance == "b"
    assert mismatch.causes[0].setting == "pythonhashseed"
    assert not doc["ok"]
    assert {"name": "agreement: a / b", "status": "fail"}.items() <= next(
        c for c in doc["checks"] if c["name"] == "agreement: a / b").items()
    assert doc["divergent_pairs"][0]["blocks"] == session.checker.stats("b").divergent > 0


def test_a_wrong_hash_algorithm_is_named(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("x")
    session, found = _session(zctx, [pub])
    with session:
        _checked(session, "x", _publish(pub, "vllm_sha256"))
        doc = session.summary(final=True)
    mismatch = [f for f in found if f.kind == "mismatch"]
    assert len(mismatch) == 1
    cause = mismatch[0].causes[0]
    assert (cause.setting, cause.a, cause.b) == ("profile", "vllm:sha256_cbor", "vllm:sha256")
    assert "x:" in mismatch[0].message
    assert "hash function differs" in mismatch[0].message
    fidelity = next(c for c in doc["checks"] if c["name"] == "fidelity: x")
    assert fidelity["status"] == "fail"


def test_what_a_pool_would_save(zctx: Any, publishers: Publishers) -> None:
    a, b = publishers("a"), publishers("b")
    session, found = _session(zctx, [a, b], window_s=3600)
    with session:
        _checked(session, "a", _publish(a, "vllm_sha256_cbor"))
        _checked(session, "b", _publish(b, "vllm_sha256_cbor_variant"))
        sb = session.checker.stats("b")
        # b computed the shared system prompt (4 blocks) while a held it, twice: before and
        # after its own prefix-cache reset; and a's LoRA and salted requests are b's too
        assert sb.duplicate_blocks > 0
        assert sb.duplicate_tokens == 16 * sb.duplicate_blocks
        assert session.checker.stats("a").duplicate_blocks == 0  # nothing held elsewhere yet
        row = session.instance_row("b")
        assert row["duplicate_share"] == sb.duplicate_tokens / sb.computed_tokens
        assert row["window"]["duplicate_tokens"] == sb.duplicate_tokens
    assert [f for f in found if f.kind in ("divergence", "mismatch")] == []


def _batch(events: list[dict[str, Any]]) -> bytes:
    return msgspec.msgpack.encode([1.0, events, 0])


def test_garbage_and_unknown_events_are_warned_never_fatal(
        zctx: Any, publishers: Publishers) -> None:
    pub = publishers("g")
    session, found = _session(zctx, [pub])
    good = fixture_messages("vllm_sha256_cbor")[0].payload
    first_event = msgspec.msgpack.decode(good)[1][0]
    with session:
        pub.send_raw([b"only", b"two"])
        pub.send_raw([b"", b"\x00\x01", b"short seq"])
        pub.send(0, b"\xc1 not msgpack")
        pub.send(1, _batch([{"type": "BlockPinned", "block_hashes": [1]}, first_event]))
        pub.send(2, _batch([{"type": "BlockStored", "block_hashes": "nope"}]))
        pub.send(3, _batch([{"type": "BlockStored", "block_hashes": [1, 2],
                             "token_ids": [1, 2, 3], "block_size": 16}]))
        _checked(session, "g", 4)
        s = session.checker.stats("g")
    kinds = [f.kind for f in found]
    assert kinds.count("bad-frame") == 4
    assert kinds.count("unknown-event") == 2
    assert "unknown event type 'BlockPinned'" in found[3].message
    assert s.verified == 8  # the good event beside the unknown one was checked


def test_reordered_messages_are_dropped(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("r")
    session, found = _session(zctx, [pub])
    messages = fixture_messages("vllm_sha256_cbor")
    with session:
        for m in messages[:3]:
            assert m.seq is not None
            pub.send(m.seq, m.payload)
        pub.send(1, messages[1].payload)  # an old one again
        pub.send(3, messages[3].payload)
        _checked(session, "r", 4)
    assert [f.kind for f in found] == ["reordered"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_endpoint_is_reported(zctx: Any) -> None:
    url = f"tcp://127.0.0.1:{_closed_port()}"
    found: list[Finding] = []
    with WatchSession([Endpoint("dead", url)], VLLM, WatchOptions(), on_finding=found.append,
                      context=zctx) as session:
        _until(session, lambda: any(f.kind == "dead-endpoint" for f in found))
        doc = session.summary(final=True)
    assert "nothing accepts connections" in found[0].message
    assert url in found[0].message
    reach = next(c for c in doc["checks"] if c["name"] == "reachable: dead")
    assert reach["status"] == "fail"
    assert not doc["ok"]


def test_bounded_runs_stop_by_themselves(zctx: Any, publishers: Publishers) -> None:
    pub = publishers("a")
    session, _ = _session(zctx, [pub], max_events=5)
    with session:
        _publish(pub, "vllm_sha256_cbor")
        _until(session, session.done)
        assert session.events >= 5
    session, _ = _session(zctx, [publishers("b")], duration_s=0.2)
    with session:
        start = time.monotonic()
        _until(session, session.done)
        assert time.monotonic() - start < 5
    assert zmq.zmq_version_info() >= (4,)


def test_kvctl_binds_where_the_engine_connects(zctx: Any, ipc_dir: Any) -> None:
    url = f"ipc://{ipc_dir}/bound"
    found: list[Finding] = []
    with WatchSession([Endpoint("c", url, bind=True)], VLLM, WatchOptions(),
                      on_finding=found.append, context=zctx) as session:
        pub = zctx.socket(zmq.XPUB)  # an engine given tcp://kvctl-host:P connects
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(url)
        try:
            # the bound SUB attaches the engine's pipe (and subscribes) while it is polled
            _until(session, lambda: bool(pub.poll(0)))
            pub.recv()
            for m in fixture_messages("vllm_sha256_cbor"):
                assert m.seq is not None
                pub.send_multipart([b"", m.seq.to_bytes(8, "big"), m.payload])
            _checked(session, "c", 13)
        finally:
            pub.close(0)
        assert session.checker.stats("c").verified == VLLM_BLOCKS


def test_the_view_renders_the_summary(zctx: Any, publishers: Publishers) -> None:
    from rich.console import Console

    from kvctl.commands._keys_watch_screen import render

    a, b = publishers("a"), publishers("b")
    session, found = _session(zctx, [a, b])
    with session:
        _checked(session, "a", _publish(a, "vllm_sha256_cbor"))
        _checked(session, "b", _publish(b, "vllm_sha256_cbor_seed1"))
        doc = session.summary(final=True)
    console = Console(record=True, width=220)
    console.print(render(doc, found, live=True))
    text = console.export_text()
    assert "PROBLEMS" in text
    assert "a shared pool would have served" in text
    assert "agreement: a / b" in text
    assert "divergence" in text
    assert "(q quits)" in text
