"""``kvctl runbook --report report.html``: one self-contained file, rendered by a real browser.

The browser test runs Debian's headless Chromium (``scripts/setup`` installs it) on the file
with every network feature it has turned off, then checks the screenshot (size, not blank)
and the DOM it built (the verdict table's rows, the plot, the matrix, the findings).
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvctl.bench.result import ResultRow
from kvctl.probe.nvml import RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.runbook.model import Artifact, CheckResult, Verdict
from kvctl.runbook.report_html import render_html, write_report
from kvctl.runbook.runner import RunbookReport
from kvctl.topo.build import discover
from kvctl.topo.doctor import run_doctor
from kvctl.topo.model import Topology
from tests.fixtures.sysfs import build_sysfs, h100_host

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = '<script>alert("x")</script> & "quotes"'

ROW = ResultRow(
    engine="kvctl", op="read", transport="tcp", transport_requested="tcp", path="p",
    block_size_bytes=4096, batch_size=8, threads=1, local_location="cpu:0",
    remote_location="cpu:0", batches=10, requests=80, bytes_moved=80 * 4096, elapsed_s=1.0,
    throughput_gbytes_per_s=1.0, throughput_gbits_per_s=8.0, requests_per_s=80.0,
    batch_latency_p50_us=1000.0, batch_latency_p99_us=2000.0, batch_latency_p999_us=3000.0,
    batch_latency_mean_us=1500.0, batch_latency_stddev_us=5.0, request_latency_p50_us=math.nan,
    request_latency_p99_us=math.nan, request_latency_p999_us=math.nan,
    request_latency_stddev_us=math.nan, errors=0, retries=None, line_rate_gbytes_per_s=2.0,
    line_rate_source="tcp-loopback 4 KiB x8, 4 streams", line_rate_fraction=0.5,
    line_rate_valid=True, verified=True)


def _topology(tmp_path: Path) -> Topology:
    root = build_sysfs(tmp_path / "host", h100_host())
    return discover(SysfsReader(root), RecordedNvml(Unavailable("nvml", "test")),
                    RecordedVerbs(Unavailable("verbs", "test")))


def _report(tmp_path: Path) -> RunbookReport:
    rows = tuple(dataclasses.replace(ROW, op=op, block_size_bytes=size,
                                     throughput_gbytes_per_s=0.5 + i)
                 for op in ("read", "write") for i, size in enumerate((4096, 65536, 1 << 20)))
    rows = (*rows[:-1], dataclasses.replace(rows[-1], line_rate_fraction=1.4,
                                            line_rate_valid=False))
    topology = _topology(tmp_path)
    results = (
        CheckResult("environment: etcd", Verdict.SKIP, "missing: etcd", "optional",
                    "apt-get install etcd-server"),
        CheckResult("topo doctor: findings", Verdict.PASS, "2 info", "no error findings"),
        *(CheckResult(f"transfer: {r.label()}", Verdict.PASS,
                      f"{r.throughput_gbytes_per_s:.3f} GB/s", "no errors") for r in rows),
        CheckResult(f"store smoke: {HOSTILE}", Verdict.FAIL, "0 of 3 objects", "byte-exact",
                    "run 'kvctl store smoke' for details"),
    )
    artifacts = (Artifact("topo doctor", "topology", topology),
                 Artifact("topo doctor", "topo-findings", run_doctor(topology)),
                 Artifact("transfer", "bench-rows", rows))
    return RunbookReport("report-test", results, False, 12.5, artifacts)


def test_the_report_is_self_contained_and_escaped(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = _report(tmp_path)
    text = render_html(report, host="host-a")
    assert text.startswith("<!DOCTYPE html>")
    # nothing is fetched: no scripts, stylesheets, frames; every source is inline data
    assert not re.search(r"<(script|link|iframe|object|embed)\b", text, re.IGNORECASE)
    sources = re.findall(r'\b(?:src|href)="([^"]*)"', text)
    assert sources
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert "url(" not in text
    assert "@import" not in text
    # the run's text is escaped: a hostile check name stays text
    assert HOSTILE not in text
    assert "store smoke: &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp;" in text
    assert text.count('<tr class="pass">') == 7
    assert text.count('<tr class="fail">') == 1
    assert text.count('<tr class="skip">') == 1
    assert 'id="topo-matrix"' in text
    assert "223%" not in text
    assert "140%: baseline invalid" in text
    assert "FAILED" in text
    assert "host-a" in text


def test_a_report_without_bench_or_topo_steps_says_so(tmp_path: Path) -> None:
    report = RunbookReport("keys-only", (CheckResult("keys", Verdict.PASS, "5/5"),), True, 1.0)
    text = render_html(report)
    assert "No bench-transfer step ran in this runbook." in text
    assert "No topo-doctor step ran in this runbook." in text
    assert "PASSED" in text


def _png_size_and_spread(png: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the pixel data)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    idat, pos = b"", 8
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IDAT":
            idat += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def _chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", *args, page.as_uri()]
    return subprocess.run(command, capture_output=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup "
                    "installs Debian's chromium)")
def test_chromium_renders_the_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    page = write_report(_report(tmp_path), tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    done = _chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1280,2000")
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    width, height, spread = _png_size_and_spread(shot.read_bytes())
    assert (width, height) == (1280, 2000)
    assert spread > 50  # tables, colours and the plot: far from a blank page
    assert shot.stat().st_size > 50_000
    dom = _chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    text = dom.stdout.decode()
    rows = re.findall(r'<tr class="(pass|fail|skip)"><td>([^<]*)</td>', text)
    assert len(rows) == 9  # every verdict row survived parsing, in order
    assert rows[0] == ("skip", "environment: etcd")
    assert rows[-1][0] == "fail"
    assert "transfer: kvctl write tcp 1 MiB x8" in [name for _, name in rows]
    assert "&lt;script&gt;" in text
    assert "<script>alert" not in text
    assert re.search(r'<img class="plot"[^>]*src="data:image/png;base64,', text)
    assert 'id="topo-matrix"' in text
    assert "Doctor findings" in text


def test_runbook_report_flag_end_to_end(kvctl: Callable[..., Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    root = build_sysfs(tmp_path / "host", h100_host())
    book = tmp_path / "book.yaml"
    book.write_text(
        "name: report-e2e\nsteps:\n"
        f"  - check: topo-doctor\n    name: topo doctor\n    sysfs_root: {root}\n"
        "    fail_on: error\n"
        "  - check: bench-transfer\n    name: transfer\n    transport: shm\n"
        "    block_size: 4KiB\n    batch_size: '4'\n    iterations: 3\n    op: write\n")
    out = tmp_path / "report.html"
    r = kvctl("runbook", str(book), "--report", str(out))
    assert f"Report written to {out}" in r.stderr
    text = out.read_text()
    assert "transfer: kvctl write shm 4 KiB x4" in text
    assert "topo doctor: findings" in text
    assert 'id="topo-matrix"' in text
    assert "GPU0" in text
    assert "data:image/png;base64," in text
    assert r.exit_code == 0, r.stderr  # the fake H100 host has warnings, no errors
    assert "nvlink" in text  # its doctor finding
    # a report that cannot be written fails before the run, not after it
    r = kvctl("runbook", str(book), "--report", str(tmp_path / "no" / "such" / "r.html"))
    assert r.exit_code == 2
    assert "does not exist" in r.stderr
    assert "transfer" not in r.stdout
