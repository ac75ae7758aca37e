"""The checker and the wire decoder without sockets: memory bounds, restarts seen by their
timestamps, decoding odd payloads, endpoints' syntax, the record file and the trace reader."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvctl.errors import UsageError
from kvctl.keys.profiles import KeyConfig
from kvctl.keys.profiles.base import EngineOptions
from kvctl.keys.watch.checker import Checker
from kvctl.keys.watch.record import Recorder, read_record
from kvctl.keys.watch.source import parse_endpoint
from kvctl.keys.watch.wire import BadFrame, Batch, decode_payload, split_message
from kvctl.sim.trace_kvevents import read_kv_events
from tests.keys.watch.publisher import EVENTS, fixture_messages

VLLM = KeyConfig(profile="vllm:sha256_cbor", block_size=16,
                 options=EngineOptions(lora_paths=(("sql-lora", "/adapters/sql-lora"),)))


def _feed(checker: Checker, name: str, fixture: str) -> None:
    for m in fixture_messages(fixture):
        assert m.seq is not None
        checker.feed(name, m.seq, m.payload)


def test_memory_is_bounded_by_max_blocks() -> None:
    checker = Checker(VLLM, max_blocks=5)
    checker.add_instance("a")
    _feed(checker, "a", "vllm_sha256_cbor")
    s = checker.stats("a")
    assert checker.held("a") <= 5
    assert len(checker.instances["a"].chain) <= 5
    assert len(checker.owners) <= 5
    assert len(checker.digests) <= 5
    assert s.forgotten_blocks > 0
    assert s.mismatched == 0  # forgetting only makes blocks unverifiable, never wrong


def test_a_restart_that_lost_its_first_messages_is_seen_by_its_timestamp() -> None:
    checker = Checker(VLLM)
    checker.add_instance("a")
    _feed(checker, "a", "vllm_sha256_cbor")
    later = msgspec.msgpack.encode([2e9, [{"type": "AllBlocksCleared"}], 0])
    checker.feed("a", 2, later)  # seq 2 < 13 expected, but stamped after everything
    assert checker.stats("a").restarts == 1
    assert checker.held("a") == 0
    checker.feed("a", 3, msgspec.msgpack.encode([1.0, [], 0]))
    older = msgspec.msgpack.encode([1.0, [], 0])
    checker.feed("a", 1, older)  # older than the last: a duplicate, dropped
    assert checker.stats("a").reordered == 1


def test_the_decoder_never_raises() -> None:
    assert isinstance(decode_payload(b""), BadFrame)
    assert isinstance(decode_payload(msgspec.msgpack.encode({"ts": 1})), BadFrame)
    batch = decode_payload(msgspec.msgpack.encode([1.0, [{"no": "type"}, 7], None]))
    assert isinstance(batch, Batch)
    assert [u.tag for u in batch.unknown] == ["", ""]
    assert isinstance(split_message([b"", b"\xff" * 8, b""]), BadFrame)  # seq -1 live


def test_endpoint_syntax() -> None:
    e = parse_endpoint("a=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558")
    assert (e.name, e.url, e.replay, e.bind) == ("a", "tcp://10.0.0.5:5557",
                                                 "tcp://10.0.0.5:5558", False)
    assert parse_endpoint("tcp://*:5557").bind
    assert parse_endpoint("ipc:///run/kv.sock,bind").bind
    assert parse_endpoint("tcp://h:1").name == "h:1"
    with pytest.raises(UsageError, match="unknown transport"):
        parse_endpoint("udp://h:1")


def test_a_record_reads_back_and_names_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    rec = Recorder(path, profile="vllm:sha256_cbor", block_size=16)
    rec.message("a", 1.5, 0, b"t", b"payload")
    rec.malformed("a", 1.6, [b"x"])
    rec.close()
    rec.close()
    got = list(read_record(path))
    assert [(m.instance, m.seq, m.payload) for m in got] == [("a", 0, b"payload"),
                                                             ("a", None, b"")]
    assert got[1].frames == (b"x",)
    path.write_text(path.read_text() + '{"instance": "a"}\n')
    with pytest.raises(UsageError, match="line 4"):
        list(read_record(path))
    path.write_text(json.dumps({"format": "other"}) + "\n")
    with pytest.raises(UsageError, match="line 1"):
        list(read_record(path))


def test_the_trace_of_a_record_chains_from_the_root() -> None:
    requests = list(read_kv_events(EVENTS / "vllm_sha256_cbor.jsonl"))
    assert len(requests) == 11  # one per BlockStored
    first, second = requests[0], requests[1]
    assert len(first.hash_ids) == 8
    assert first.input_length == 128
    # the next turn of that session: its ancestors from the file, then its new block
    assert second.hash_ids[:-1] == first.hash_ids
    assert second.input_length == 16 * 9
    assert all(r.instance == "vllm_sha256_cbor" and r.block_tokens == 16 for r in requests)
    stamps = [r.timestamp_ms for r in requests]
    assert stamps == sorted(stamps)
    # two instances that hash alike share ids; the variant's system prompt is the same
    variant = list(read_kv_events(EVENTS / "vllm_sha256_cbor_variant.jsonl"))
    assert variant[0].hash_ids[:4] == first.hash_ids[:4]


def test_groups_and_tiers_are_held_apart_and_offloads_are_not_prefill() -> None:
    checker = Checker(VLLM)
    checker.add_instance("a")
    first = fixture_messages("vllm_sha256_cbor")[0].payload
    event = msgspec.msgpack.decode(first)[1][0]
    n = len(event["block_hashes"])
    batches = [event, {**event, "group_idx": 1}, {**event, "medium": "CPU"}, event]
    for seq, ev in enumerate(batches):
        checker.feed("a", seq, msgspec.msgpack.encode([1.0, [ev], 0]))
    s = checker.stats("a")
    assert checker.held("a") == 3 * n  # GPU group 0, GPU group 1, CPU
    assert s.computed_blocks == 2 * n  # the CPU copy is an offload
    assert s.reused_blocks == n  # the last store re-announces what group 0 holds
    assert s.verified == 4 * n
    removed = {"type": "BlockRemoved", "block_hashes": event["block_hashes"], "medium": "CPU"}
    checker.feed("a", 4, msgspec.msgpack.encode([1.0, [removed], 0]))
    assert checker.held("a") == 2 * n


def test_what_cannot_be_checked_says_why_and_a_block_size_is_named() -> None:
    # xxhash with PYTHONHASHSEED unset: vLLM draws NONE_HASH at random per process
    checker = Checker(KeyConfig(profile="vllm:xxhash", block_size=16))
    checker.add_instance("x")
    _feed(checker, "x", "vllm_sha256_cbor")
    s = checker.stats("x")
    assert s.mismatched == 0
    assert s.verified == 0
    assert any("random per process" in r for r in s.unverifiable)
    # SGLang's salted requests are namespaced with seeds kvctl does not reproduce
    sg = Checker(KeyConfig(profile="sglang", block_size=16))
    sg.add_instance("s")
    first = msgspec.msgpack.decode(fixture_messages("sglang")[0].payload)[1][0]
    sg.feed("s", 0, msgspec.msgpack.encode([1.0, [{**first, "cache_salt": "t"}], 0]))
    assert any("namespaces" in r for r in sg.stats("s").unverifiable)
    # the configuration's block size differs from the instance's
    wrong = Checker(KeyConfig(profile="vllm:sha256_cbor", block_size=32))
    wrong.add_instance("w")
    _feed(wrong, "w", "vllm_sha256_cbor")
    assert wrong.stats("w").mismatched == 47
    (finding,) = [f for f in wrong.findings if f.kind == "mismatch"]
    assert finding.causes[0].setting == "block_size"
    assert (finding.causes[0].a, finding.causes[0].b) == ("32", "16")


def test_content_verified_once_is_not_hashed_again() -> None:
    checker = Checker(VLLM)
    checker.add_instance("a")
    checker.add_instance("b")
    calls = []
    block = checker.hasher.block

    def counting(*args: object) -> bytes:
        calls.append(1)
        return block(*args)  # type: ignore[arg-type]

    checker.hasher.block = counting  # type: ignore[method-assign]
    _feed(checker, "a", "vllm_sha256_cbor")
    hashed = len(calls)
    _feed(checker, "b", "vllm_sha256_cbor")  # the same traffic on a second instance
    assert len(calls) == hashed
    assert checker.stats("b").verified == 47
