"""``kvctl sim trace`` against hostile input and flags: each is an ``Error:``/``Hint:`` with
exit code 2 (never an unexpected-error exit), or a result the docs promise."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

Kvctl = Callable[..., Any]


def _rows(n: int) -> bytes:
    return b"".join(b'{"timestamp": %d, "input_length": 1000, "hash_ids": [1, 2]}\n' % i
                    for i in range(n))


def _refused(r: Any, *words: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    for word in ("Error:", "Hint:", *words):
        assert word in r.stderr, r.stderr
    for word in ("unexpected", "Traceback"):
        assert word not in r.stderr, r.stderr


def test_a_corrupt_gz_is_named_not_an_unexpected_error(kvctl: Kvctl, tmp_path: Path) -> None:
    data = bytearray(gzip.compress(_rows(2000)))
    data[10:12] = b"\xff\xff"  # the first deflate block: an invalid block type
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(zlib.error):
        gzip.decompress(bytes(data))
    _refused(kvctl("sim", "trace", str(path), "--json"), f"{path} line 1: cannot read")


def test_timestamps_without_a_finite_span_are_named(kvctl: Kvctl, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": -1e308, "input_length": 10, "hash_ids": [1]}\n'
                    '{"timestamp": 1e308, "input_length": 10, "hash_ids": [1]}\n')
    _refused(kvctl("sim", "trace", str(path), "--json"), f"{path} line 2: timestamp 1e+308")


def _ok_trace(tmp_path: Path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_rows(3))
    return str(path)


@pytest.mark.parametrize(("name", "words"), [
    ("hit.xyz", ".xyz is not an image format"),
    ("hit", "no image format suffix"),   # matplotlib would write hit.png and we said "hit"
    (".", "is a directory"),             # matplotlib would write ..png beside it
    ("absent/hit.png", "no directory"),
])
def test_a_bad_plot_path_is_refused_before_the_replay(kvctl: Kvctl, tmp_path: Path, name: str,
                                                      words: str) -> None:
    pytest.importorskip("matplotlib")
    before = set(tmp_path.parent.iterdir())
    r = kvctl("sim", "trace", str(tmp_path / "missing.jsonl"), "--plot", str(tmp_path / name))
    _refused(r, words)  # the plot's error, not the missing trace's: checked first
    assert set(tmp_path.parent.iterdir()) == before
    assert list(tmp_path.iterdir()) == []


def test_the_plot_goes_where_it_says(kvctl: Kvctl, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = kvctl("sim", "trace", _ok_trace(tmp_path), "--plot", str(tmp_path / "hit.svg"))
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "hit.svg").read_bytes().lstrip().startswith(b"<?xml")
    assert f"wrote {tmp_path / 'hit.svg'}" in r.stdout + r.stderr


@pytest.mark.parametrize(("flags", "words"), [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "llama-3-70b", "--gpu", "no-such-gpu"], "no-such-gpu"),
    (["--model", "llama-3-70b", "--prefill-tps", "0"], "--prefill-tps"),
    (["--model", "llama-3-70b", "--nic-gbytes-per-s", "-1"], "--nic-gbytes-per-s"),
    (["--model", "llama-3-70b", "--bench-file", "/nonexistent/b.json"], "/nonexistent"),
    (["--gpu", "H100 SXM"], "needs --model"),
])
def test_cost_flags_are_refused_before_the_replay(kvctl: Kvctl, tmp_path: Path,
                                                  flags: list[str], words: str) -> None:
    # the trace does not exist: an error about the flags shows they were checked first
    _refused(kvctl("sim", "trace", str(tmp_path / "missing.jsonl"), *flags), words)


def test_the_gpu_hint_names_a_flag_sim_trace_has(kvctl: Kvctl, tmp_path: Path) -> None:
    r = kvctl("sim", "trace", _ok_trace(tmp_path), "--model", "llama-3-70b", "--gpu", "nope")
    _refused(r, "--gpu-tflops")
    ok = kvctl("sim", "trace", _ok_trace(tmp_path), "--model", "llama-3-70b", "--gpu-tflops",
               "989", "--json")
    assert ok.exit_code == 0, ok.stderr
    cost = ok.json()["cost"]
    assert "from --gpu-tflops" in cost["prefill_source"]
    assert cost["prefill_tokens_per_s"] > 0


@pytest.mark.parametrize(("text", "want"), [
    ("3000000000000000001", 3_000_000_000_000_000_001),  # a float would make it 3e18
    ("1.5M", 1_500_000), ("3M", 3_000_000), ("2k", 2000), ("1e6", 1_000_000), ("0", 0),
])
def test_token_counts_are_exact(kvctl: Kvctl, tmp_path: Path, text: str, want: int) -> None:
    r = kvctl("sim", "trace", _ok_trace(tmp_path), "--capacity-tokens", text, "--json")
    assert r.exit_code == 0, r.stderr
    assert [x["capacity_tokens"] for x in r.json()["results"]] == [want]


@pytest.mark.parametrize(("text", "words"), [
    ("3MiB", "not a token count"), ("1.5", "not a whole number"), ("-1", "not a whole number"),
    ("nan", "not a whole number"), ("inf", "not a whole number"), ("sNaN", "not a whole"),
    ("-1e1000000000", "not a whole"),
    ("1e1000000000", "more than"), ("1000000000000000000000000000001", "more than"),
    ("1000000000000000000000001G", "more than"),
])
def test_bad_token_counts(kvctl: Kvctl, tmp_path: Path, text: str, words: str) -> None:
    _refused(kvctl("sim", "trace", _ok_trace(tmp_path), "--capacity-tokens", text), words)
    _refused(kvctl("sim", "trace", _ok_trace(tmp_path), "--pool-tokens", text), words)


def test_a_million_instances_is_refused_before_the_replay(kvctl: Kvctl, tmp_path: Path) -> None:
    r = kvctl("sim", "trace", str(tmp_path / "missing.jsonl"), "--instances", "1000000")
    _refused(r, "--instances 1,000,000 is more than 10,000")
    ok = kvctl("sim", "trace", _ok_trace(tmp_path), "--instances", "10000", "--capacity-tokens",
               "0", "--routing", "round-robin", "--json")
    assert ok.exit_code == 0, ok.stderr
    assert len(ok.json()["results"][-1]["per_instance"]) == 10_000


@pytest.mark.parametrize(("name", "compress"), [
    ("t.jsonl", True),    # compressed, named plain: was "line 1: not a JSON object"
    ("t.gz", False),      # plain, named .gz: was "cannot read: Not a gzipped file"
    ("t.jsonl.gz", True), ("t.jsonl", False),
])
def test_gzip_is_known_by_its_bytes_not_its_name(kvctl: Kvctl, tmp_path: Path, name: str,
                                                 compress: bool) -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(_rows(5)) if compress else _rows(5))
    r = kvctl("sim", "trace", str(path), "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["requests"] == 5


def test_a_byte_order_mark_is_skipped(kvctl: Kvctl, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _rows(3).replace(b"\n", b"\r\n"))  # as Notepad saves
    r = kvctl("sim", "trace", str(path), "--json")
    assert r.exit_code == 0, r.stderr  # was "line 1: not a JSON object (invalid character)"
    assert r.json()["requests"] == 3
    path.write_bytes(_rows(1) + b"\xef\xbb\xbf" + _rows(1))  # only the file's start is one
    _refused(kvctl("sim", "trace", str(path)), f"{path} line 2: not a JSON object")


def _peak_bytes(path: Path) -> int:
    import tracemalloc

    from kvctl.sim.trace import TraceConfig, replay_trace

    tracemalloc.start()
    try:
        replay_trace(path, [TraceConfig(0)], block_tokens=1)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_grows_with_distinct_ids_not_with_requests(tmp_path: Path) -> None:
    """docs/traffic.md "Scale": not with the requests; one count per distinct id."""
    def trace(name: str, ids: Callable[[int], list[int]]) -> Path:
        path = tmp_path / name
        path.write_text("".join(
            f'{{"timestamp": {i}, "input_length": 10, "hash_ids": {ids(i)}}}\n'
            for i in range(20_000)))
        return path

    same = _peak_bytes(trace("same.jsonl", lambda i: list(range(10))))
    new = _peak_bytes(trace("new.jsonl", lambda i: list(range(10 * i, 10 * i + 10))))
    assert same < 4 * 2**20                      # 200,000 uses of 10 ids: no growth
    assert new / 200_000 < 200                   # bytes per distinct id (~70 in RSS)


@pytest.mark.timeout(60)  # a reopen would block on the FIFO forever
@pytest.mark.parametrize("compress", [True, False])
def test_a_trace_through_a_pipe_gz_or_not(kvctl: Kvctl, tmp_path: Path, compress: bool) -> None:
    """Sniffing gzip must not reopen the file: a FIFO (or /dev/stdin) cannot be read twice."""
    import os
    import threading

    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    data = gzip.compress(_rows(7)) if compress else _rows(7)

    def feed() -> None:
        with fifo.open("wb") as w:
            w.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    r = kvctl("sim", "trace", str(fifo), "--json")
    writer.join(timeout=10)
    assert not writer.is_alive()
    assert r.exit_code == 0, r.stderr
    assert r.json()["requests"] == 7


def test_reads_in_a_trace_of_no_duration_have_no_rate(kvctl: Kvctl, tmp_path: Path) -> None:
    from tests.fixtures.schemas import validate_document

    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 1000, "hash_ids": [1, 2]}\n' * 2)
    flags = ["--model", "llama-3-70b", "--prefill-tps", "1000", "--nic-gbytes-per-s", "50",
             "--instances", "2", "--routing", "round-robin", "--capacity-tokens", "0",
             "--pool-tokens", "1M"]
    r = kvctl("sim", "trace", str(path), *flags, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert validate_document(doc) == "sim.trace"
    pooled = doc["cost"]["rows"][-1]
    assert doc["results"][-1]["pool_hit_tokens"] == 1000  # 320 MiB read back in 0 s
    assert pooled["pool_readback_gbytes_per_s"] is None   # was 0.0: "the NIC is idle"
    assert pooled["busiest_nic_share"] is None
    assert [p["readback_gbytes_per_s"] for p in pooled["per_instance"]] == [0.0, None]
    assert doc["cost"]["rows"][0]["pool_readback_gbytes_per_s"] == 0.0  # nothing read: 0
    table = kvctl("sim", "trace", str(path), *flags)
    assert table.exit_code == 0, table.stderr
    assert "lasts 0 s" in table.stdout


def test_reuse_counts_occurrences_as_the_docs_say(kvctl: Kvctl, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [7, 7]}\n'
                    '{"timestamp": 1, "input_length": 512, "hash_ids": [8]}\n')
    doc = kvctl("sim", "trace", str(path), "--json").json()
    reuse = {b["label"]: (b["ids"], b["uses"]) for b in doc["trace"]["reuse"]}
    assert reuse["1"] == (1, 1)        # id 8
    assert reuse["2-10"] == (1, 2)     # id 7: twice in one request
    assert doc["trace"]["block_uses"] == 3
    assert doc["ideal_hit_ratio"] == 0.0  # the repeat is no hit: not seen before the request


def test_a_gz_bomb_line_is_refused_with_bounded_memory(tmp_path: Path) -> None:
    """256 KiB of gzip inflating to 256 MiB without a newline: refused after the 64 MiB
    bound, never inflated whole (measured by the CLI on a 2 GiB bomb: 180 MB peak RSS)."""
    import tracemalloc

    from kvctl.sim.trace_mooncake import read_mooncake
    from kvctl.sim.traceformat import MAX_LINE_BYTES, TraceInputError

    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(256):
            f.write(b"x" * 2**20)
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(TraceInputError) as err:
            list(read_mooncake(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "line 1: the line is longer than" in err.value.cause
    assert peak < 3 * MAX_LINE_BYTES


@pytest.mark.parametrize(("field", "value"), [
    ("input_length", 10**400),       # was OverflowError in the mean, after the whole replay
    ("input_length", 2**70), ("output_length", 2**63),
])
def test_lengths_past_int64_are_named(kvctl: Kvctl, tmp_path: Path, field: str,
                                      value: int) -> None:
    row = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    row[field] = value
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    _refused(kvctl("sim", "trace", str(path), "--json"),
             f"{path} line 1: {field} is more than 9,223,372,036,854,775,807 tokens")


def test_the_longest_length_replays(kvctl: Kvctl, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 2**63 - 1,
                                "output_length": 2**63 - 1, "hash_ids": [1, 2]}) + "\n")
    r = kvctl("sim", "trace", str(path), "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["trace"]["input_tokens"] == 2**63 - 1
    from tests.fixtures.schemas import validate_document

    assert validate_document(r.json()) == "sim.trace"


def test_a_deeply_nested_extra_field_is_named(kvctl: Kvctl, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text(_rows(1).decode() +
                    f'{{"timestamp": 1, "input_length": 10, "hash_ids": [1], "x": {deep}}}\n')
    _refused(kvctl("sim", "trace", str(path), "--json"), f"{path} line 2: JSON nested too deeply")


def test_idle_instances_are_not_blamed_on_prefix_aware_routing(kvctl: Kvctl,
                                                               tmp_path: Path) -> None:
    r = kvctl("sim", "trace", _ok_trace(tmp_path), "--instances", "5", "--routing",
              "round-robin,prefix-aware")
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "5 x 3,000,000 round-robin sent no request to 2 of 5 instances (3 requests, " \
           "routed round-robin)" in text
    assert "prefix-aware sent no request to 4 of 5 instances (prefix-aware routing" in text
    assert text.count("prefix-aware routing follows") == 1


def test_a_kv_events_record_corrupt_or_nested_is_named(kvctl: Kvctl, tmp_path: Path) -> None:
    """The kv-events reader (kvctl/keys/watch/record.py) had both crashes too."""
    nested = tmp_path / "deep.kvrec"
    nested.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    _refused(kvctl("sim", "trace", str(nested), "--format", "kv-events"),
             "line 1: JSON nested too deeply")
    data = bytearray(gzip.compress(b"x\n" * 1000))
    data[10:12] = b"\xff\xff"
    corrupt = tmp_path / "c.kvrec.gz"
    corrupt.write_bytes(bytes(data))
    _refused(kvctl("sim", "trace", str(corrupt), "--format", "kv-events"), "cannot read")
