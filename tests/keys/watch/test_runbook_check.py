"""The runbook check ``keys-live`` ("keys: live agreement") on recorded engine streams."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvctl.runbook.model import Verdict, load_runbook
from kvctl.runbook.runner import run_runbook
from tests.keys.watch.publisher import FixturePublisher, fixture_messages


def _serve(pub: FixturePublisher, name: str) -> threading.Thread:
    def run() -> None:
        pub.wait_subscriber()
        for m in fixture_messages(name):
            assert m.seq is not None
            pub.send(m.seq, m.payload)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_live_agreement_names_the_instance_that_diverges(
        publishers: Callable[[str], FixturePublisher], tmp_path: Path) -> None:
    a, b = publishers("a"), publishers("b")
    book = tmp_path / "book.yaml"
    book.write_text(f"""
name: live
steps:
  - check: keys-live
    name: "keys: live agreement"
    endpoints: ["a={a.url},replay={a.replay_url}", "b={b.url}"]
    profile: vllm:sha256_cbor
    lora_paths: ["sql-lora=/adapters/sql-lora"]
    duration_s: 20
    max_events: 36
    min_blocks: 10
""")
    threads = [_serve(a, "vllm_sha256_cbor"), _serve(b, "vllm_sha256_cbor_seed1")]
    report = run_runbook(load_runbook(book), workdir=tmp_path)
    for t in threads:
        t.join(timeout=10)
    rows = {r.check: r for r in report.results}
    assert rows["keys: live agreement: fidelity: a"].verdict is Verdict.PASS
    assert rows["keys: live agreement: fidelity: b"].verdict is Verdict.FAIL
    assert "PYTHONHASHSEED" in rows["keys: live agreement: fidelity: b"].measured
    agreement = rows["keys: live agreement: agreement: a / b"]
    assert agreement.verdict is Verdict.FAIL
    assert agreement.hint is not None
    assert "pool" in " ".join(rows)


def test_an_endless_or_empty_bound_is_a_config_error(tmp_path: Path) -> None:
    # duration_s: .inf made a runbook check that never ends
    for bound, why in (("duration_s: .inf", "duration_s inf is not a positive number"),
                       ("max_events: 0", "max_events 0 is not positive"),
                       ("window_s: -1", "window_s -1 is not positive")):
        book = tmp_path / "book.yaml"
        book.write_text(f"""
name: live
steps:
  - check: keys-live
    endpoints: ["a=tcp://127.0.0.1:9"]
    profile: vllm:sha256_cbor
    {bound}
""")
        started = time.monotonic()
        report = run_runbook(load_runbook(book), workdir=tmp_path)
        assert time.monotonic() - started < 10
        text = " ".join(f"{r.measured} {r.hint}" for r in report.results)
        assert why in text, [dataclasses.asdict(r) for r in report.results]
