"""Bad input on kvctl's metadata HTTP server (kvctl/metadata/server.py).

Properties: any JSON body on any route gets the server's own 4xx/5xx refusal or a JSON
answer, never another exception; raw HTTP of any shape is answered or dropped without a
crash in the handler; a declared body of 2**40 bytes allocates nothing; a well-formed client
still puts and gets after every fuzzed request.
"""

from __future__ import annotations

import json
import socket
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import fuzz_metadata
from fuzz._util import Pump
from fuzz.runner import CORPUS, run_harness


def fast(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(), st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64, 10**400]),
    st.text(max_size=40), st.sampled_from(["", "kvctl/", "kvctl/a", "\ud800", "a" * 300,
                                          "aGk=", "!!", "\x00"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
field_names = st.sampled_from(["key", "value", "lease", "prefix", "ttl_s", "x"])
bodies = st.one_of(st.dictionaries(field_names, json_values, max_size=4), json_values)


@pytest.fixture(scope="module")
def harness() -> Iterator[fuzz_metadata.MetadataHarness]:
    h = fuzz_metadata.MetadataHarness()
    yield h
    h.close()


def _encode(body: object) -> bytes:
    # Lone surrogates are not UTF-8: send them escaped, as a JSON encoder would.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@fast(300)
@given(store=st.sampled_from([0, 1]), route=st.integers(0, 255), body=bodies)
def test_any_json_on_any_route_gets_a_refusal_or_an_answer(
        harness: fuzz_metadata.MetadataHarness, store: int, route: int, body: object) -> None:
    harness.one_input(bytes([store, route]) + _encode(body))


methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"\xff",
                           b"POST"])
paths = st.one_of(st.sampled_from([p.encode() for p in fuzz_metadata.ROUTES]),
                  st.binary(max_size=40).map(lambda b: b"/" + b.replace(b" ", b"")))
lengths = st.one_of(st.none(), st.sampled_from([b"0", b"-1", b"1099511627776", b"9" * 30,
                                                b"\xc2\xb2", b"12 34", b"0x10", b"+5"]),
                    st.integers(0, 300).map(lambda n: str(n).encode()))
extra_headers = st.lists(st.sampled_from([
    b"Transfer-Encoding: chunked", b"Connection: close", b"Expect: 100-continue",
    b"X-Kvctl-Signature: 00", b"X-Kvctl-Time: nan", b"Host: \xff", b": empty-name",
    b"Content-Length: 5",
]), max_size=3)


@fast(120)
@given(method=methods, path=paths, length=lengths, headers=extra_headers, body=bodies,
       tail=st.binary(max_size=40), version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0",
                                                             b"HTTP/9.9", b""]))
def test_raw_http_requests_never_crash_the_handler(
        harness: fuzz_metadata.MetadataHarness, method: bytes, path: bytes,
        length: bytes | None, headers: list[bytes], body: object, tail: bytes,
        version: bytes) -> None:
    payload = _encode(body)
    lines = [method + b" " + path + b" " + version, *headers]
    if length is not None:
        lines.append(b"Content-Length: " + length)
    request = b"\r\n".join(lines) + b"\r\n\r\n" + payload + tail
    harness.one_input(bytes([2]) + request)  # raises on a logged handler crash
    harness.roundtrip()


@fast(100)
@given(route=st.sampled_from([p.encode() for p in fuzz_metadata.ROUTES]), body=bodies,
       signature=st.sampled_from([b"", b"X-Kvctl-Time: 1\r\nX-Kvctl-Nonce: a\r\n"
                                  b"X-Kvctl-Signature: " + b"0" * 64 + b"\r\n"]))
def test_unsigned_or_forged_requests_never_succeed(
        harness: fuzz_metadata.MetadataHarness, route: bytes, body: object,
        signature: bytes) -> None:
    payload = _encode(body)
    request = (b"POST " + route + b" HTTP/1.1\r\n" + signature + b"Content-Length: "
               + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    harness.one_input(bytes([3]) + request)  # asserts no 2xx and no entry changed


@pytest.mark.parametrize("headers", [
    b"Content-Length: 1099511627776\r\n",
    b"Content-Length: " + b"9" * 5000 + b"\r\n",
    b"X-Pad: " + b"a" * 60000 + b"\r\n",
    b"".join(b"X-H%d: v\r\n" % i for i in range(150)),
], ids=["length-2^40", "length-5000-digits", "60KB-header", "150-headers"])
def test_declared_huge_bodies_and_headers_allocate_little(
        harness: fuzz_metadata.MetadataHarness, headers: bytes) -> None:
    request = b"POST /v1/put HTTP/1.1\r\n" + headers + b"\r\n"
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        client = socket.create_connection(("127.0.0.1", harness.memory.port), timeout=10)
        try:
            reply = Pump(client, request).join()
        finally:
            client.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply.startswith(b"HTTP/1.")
    assert reply.split(b" ", 2)[1][:1] == b"4", reply[:80]
    assert peak < 4 << 20, f"peak {peak} bytes"
    harness.trap.check()
    harness.roundtrip()


def test_committed_corpus_replays_clean(harness: fuzz_metadata.MetadataHarness) -> None:
    files = sorted((CORPUS / "metadata").iterdir())
    assert files
    for path in files:
        harness.one_input(path.read_bytes())
    harness.roundtrip()


def test_atheris_short_run_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the dev extra")
    result = run_harness("metadata", runs=len(list((CORPUS / "metadata").iterdir())) + 300,
                         max_time_s=10, scratch=tmp_path)
    assert result.returncode == 0, result.output
    assert not result.artifacts, result.output
    assert result.runs >= 100, result.output


@pytest.mark.slow
def test_atheris_long_run_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the dev extra")
    result = run_harness("metadata", runs=50_000, max_time_s=240, scratch=tmp_path)
    assert result.returncode == 0, result.output
    assert not result.artifacts, result.output
