"""``kvctl verify-keys watch`` end to end: JSON lines, --record, --metrics-port, exit codes."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fixtures.cli import CliResult
from tests.fixtures.schemas import validate_document
from tests.keys.watch.publisher import FixturePublisher, fixture_messages

Kvctl = Callable[..., CliResult]
LORA = ("--lora-paths", "sql-lora=/adapters/sql-lora")


def _serve(pub: FixturePublisher, name: str, *, after: Callable[[], None] | None = None
           ) -> threading.Thread:
    """Publish fixture ``name`` once the watcher has subscribed (in a thread)."""

    def run() -> None:
        pub.wait_subscriber()
        for m in fixture_messages(name):
            assert m.seq is not None
            pub.send(m.seq, m.payload)
        if after is not None:
            after()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _lines(result: CliResult) -> list[dict[str, Any]]:
    docs = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    for doc in docs:
        validate_document(doc)
    return docs


def test_json_lines_and_a_record_replayable_as_a_trace(
        kvctl: Kvctl, publishers: Callable[[str], FixturePublisher], tmp_path: Path) -> None:
    pub = publishers("a")
    thread = _serve(pub, "vllm_sha256_cbor")
    record = tmp_path / "kv.jsonl"
    result = kvctl("verify-keys", "watch", f"a={pub.url},replay={pub.replay_url}",
                   "--profile", "vllm:sha256_cbor", *LORA, "--events", "18", "--duration",
                   "20", "--json", "--record", str(record))
    thread.join(timeout=10)
    assert result.exit_code == 0, result.stderr
    docs = _lines(result)
    final = docs[-1]
    assert final["kind"] == "keys.watch"
    assert final["final"] is True
    assert final["ok"]
    row = final["instances"][0]
    assert row["verified"] == row["blocks_seen"] == 47
    assert row["blocks_held"] == 22
    from kvctl.sim.trace_kvevents import read_kv_events

    requests = list(read_kv_events(record))
    assert len(requests) == 11  # one per BlockStored
    assert requests[0].instance == "a"
    assert requests[0].block_tokens == 16
    assert requests[0].input_length == 16 * len(requests[0].hash_ids)


def test_a_mismatch_fails_with_its_cause(
        kvctl: Kvctl, publishers: Callable[[str], FixturePublisher]) -> None:
    pub = publishers("x")
    thread = _serve(pub, "vllm_sha256")
    result = kvctl("verify-keys", "watch", pub.url, "--profile", "vllm:sha256_cbor", *LORA,
                   "--events", "18", "--duration", "20", "--json")
    thread.join(timeout=10)
    assert result.exit_code == 1, result.stderr
    docs = _lines(result)
    mismatch = next(d for d in docs if d["kind"] == "keys.watch-finding"
                    and d["finding"] == "mismatch")
    assert mismatch["causes"][0]["setting"] == "profile"
    assert mismatch["causes"][0]["b"] == "vllm:sha256"
    final = docs[-1]
    assert not final["ok"]
    assert any(c["status"] == "fail" and c["name"].startswith("fidelity:")
               for c in final["checks"])


def test_metrics_endpoint_exports_the_counters(publishers: Callable[[str], FixturePublisher],
                                               zctx: Any) -> None:
    from kvctl.keys.profiles import KeyConfig
    from kvctl.keys.watch.session import WatchOptions, WatchSession, serve_metrics
    from kvctl.keys.watch.source import Endpoint

    pub = publishers("m")
    with WatchSession([Endpoint("m", pub.url)], KeyConfig(profile="vllm:sha256_cbor",
                                                          block_size=16),
                      WatchOptions(), context=zctx) as session:
        pub.wait_subscriber()
        for m in fixture_messages("vllm_sha256_cbor_seed1"):
            assert m.seq is not None
            pub.send(m.seq, m.payload)
        for _ in range(200):
            if session.checker.expected_seq("m") == 13:
                break
            session.step(0.05)
        metrics = serve_metrics(session, "127.0.0.1", 0)
        try:
            assert metrics.address is not None
            url = f"http://127.0.0.1:{metrics.address[1]}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        finally:
            metrics.close()
    assert 'kvctl_keys_watch_blocks_seen_total{instance="m"} 47.0' in text
    assert 'kvctl_keys_watch_blocks_mismatched_total{instance="m"} 3.0' in text
    for name in ("blocks_divergent_total", "blocks_duplicated_total", "blocks_held"):
        assert f"kvctl_keys_watch_{name}" in text


def test_a_bad_endpoint_is_a_usage_error(kvctl: Kvctl) -> None:
    result = kvctl("verify-keys", "watch", "localhost:5557")
    assert result.exit_code == 2
    assert "has no URL" in result.stderr
    result = kvctl("verify-keys", "watch", "tcp://127.0.0.1:1,replay")
    assert result.exit_code == 2
    assert "unknown option" in result.stderr


def test_text_mode_reports_a_dead_endpoint_and_fails(kvctl: Kvctl) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = kvctl("verify-keys", "watch", f"dead=tcp://127.0.0.1:{port}",
                   "--profile", "vllm:sha256_cbor", "--duration", "1.5")
    assert result.exit_code == 1
    assert "nothing accepts connections" in result.stderr
    assert "reachable: dead" in result.stdout
    assert "a shared pool would have served 0 of 0" in result.stdout


def test_a_record_across_a_filled_gap_replays_like_the_whole_stream(
        kvctl: Kvctl, publishers: Callable[[str], FixturePublisher], tmp_path: Path) -> None:
    from kvctl.sim.trace_kvevents import read_kv_events
    from tests.keys.watch.publisher import EVENTS

    pub = publishers("a")

    def run() -> None:
        pub.wait_subscriber()
        for m in fixture_messages("vllm_sha256_cbor"):
            assert m.seq is not None
            pub.send(m.seq, m.payload, live=m.seq not in range(3, 7))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    record = tmp_path / "kv.jsonl"
    result = kvctl("verify-keys", "watch", f"a={pub.url},replay={pub.replay_url}",
                   "--profile", "vllm:sha256_cbor", *LORA, "--events", "18", "--duration",
                   "20", "--json", "--record", str(record))
    thread.join(timeout=10)
    assert result.exit_code == 0, result.stderr
    got = [list(r.hash_ids) for r in read_kv_events(record)]
    want = [list(r.hash_ids) for r in read_kv_events(EVENTS / "vllm_sha256_cbor.jsonl")]
    assert got == want
    assert any(d.get("finding") == "gap-filled" for d in _lines(result))


def test_the_same_publisher_twice_is_a_usage_error(kvctl: Kvctl) -> None:
    # named apart, one publisher would be two instances that duplicate each other's every
    # block: a pool's savings out of nothing
    result = kvctl("verify-keys", "watch", "a=tcp://127.0.0.1:5557", "b=tcp://127.0.0.1:5557",
                   "--profile", "vllm:sha256_cbor", "--duration", "1")
    assert result.exit_code == 2
    assert "Error: instances a and b are the same publisher tcp://127.0.0.1:5557" in result.stderr
    assert "Hint:" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bound_that_is_not_positive_is_a_usage_error(kvctl: Kvctl) -> None:
    # --duration -1 used to end at once and report the endpoint unreachable (exit 1)
    for option, value in (("--duration", "-1"), ("--events", "0")):
        result = kvctl("verify-keys", "watch", "tcp://127.0.0.1:5557", "--profile",
                       "vllm:sha256_cbor", option, value)
        assert result.exit_code == 2, (option, result.stderr)
        assert f"Error: {option} {value} is not positive" in result.stderr
        assert "Hint:" in result.stderr


def test_sigterm_and_sigint_leave_a_complete_record(
        publishers: Callable[[str], FixturePublisher], tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from kvctl.sim.trace_kvevents import read_kv_events

    want = fixture_messages("vllm_sha256_cbor")
    for sig in (signal.SIGTERM, signal.SIGINT):
        pub = publishers(f"s{int(sig)}")
        record = tmp_path / f"kv{int(sig)}.jsonl"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "verify-keys", "watch", pub.url, "--profile",
             "vllm:sha256_cbor", *LORA, "--json", "--interval", "0.1", "--duration", "60",
             "--record", str(record)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            pub.wait_subscriber()
            for m in want:
                assert m.seq is not None
                pub.send(m.seq, m.payload)
            assert proc.stdout is not None
            for _ in range(1000):  # summary lines every 0.1 s, until every message is in
                doc = json.loads(proc.stdout.readline() or "{}")
                if doc.get("kind") == "keys.watch" and doc["instances"][0]["next_seq"] == len(
                        want):
                    break
            else:
                raise AssertionError("the watch never took the whole stream")
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert json.loads(out.splitlines()[-1])["final"] is True
        assert len(record.read_text().splitlines()) == 1 + len(want)
        assert len(list(read_kv_events(record))) == 11
