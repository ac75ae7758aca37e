"""Terminal injection: values someone else wrote never reach the operator's terminal raw.

Issue 27, item 4: a metadata key and a host record carrying escape sequences (an OSC title,
an OSC 52 clipboard write, CSI clear-screen and hide-cursor) were written raw by
``kvctl metadata ls`` and ``kvctl cluster ls``. Every listing that prints foreign values is
fed the same hostile strings here (through a ``file://`` metadata service anyone with write
access to it can fill), and none of their bytes may reach stdout or stderr raw; the JSON
documents carry them exactly (JSON escapes them already).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.cluster.protocol import ClusterKeys, DoctorSummary, GpuFact, HostRecord, NicFact, seal
from kvctl.metadata import open_metadata
from kvctl.output import SafeFormatter, safe_text
from kvctl.transfer.admin import segment_key
from kvctl.transfer.segments import BufferInfo, SegmentInfo
from tests.fixtures.cli import CliResult

#: What an attacker writes: set the window title, write the clipboard (OSC 52), clear the
#: screen and hide the cursor (CSI), a C1 CSI, a bidi override, and Rich markup that would
#: become an OSC 8 hyperlink if it were parsed.
OSC_TITLE = "\x1b]0;owned\x07"
OSC_52 = "\x1b]52;c;cm0gLXJmIH4K\x1b\\"
CSI_CLEAR = "\x1b[2J\x1b[H"
CSI_HIDE = "\x1b[?25l"
C1_CSI = "\x9b31m"
BIDI = "\u202e"
MARKUP = "[link=http://evil.example]x[/link]"
HOSTILE = OSC_TITLE + OSC_52 + CSI_CLEAR + CSI_HIDE + C1_CSI + BIDI + MARKUP

RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\x1b]8;")


def _assert_clean(result: CliResult, what: str) -> None:
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        for raw in RAW:
            assert raw not in text, f"{what}: {raw!r} reached {stream} raw: {text[:400]!r}"
    assert "\\x1b" in result.stdout, f"{what}: the hostile text is not shown at all"


def _plant(url: str) -> None:
    keys = ClusterKeys()
    client = open_metadata(url)
    try:
        client.put(f"kvctl/raw/{HOSTILE}", HOSTILE.encode())
        name = f"h{CSI_CLEAR}"
        record = HostRecord(
            hostname=name, agent_id=HOSTILE, version=f"0.1{OSC_TITLE}", pid=1, started_at=0.0,
            address=f"10.0.0.1{OSC_52}", addresses=[HOSTILE],
            gpus=[GpuFact(HOSTILE, HOSTILE)], nics=[NicFact(HOSTILE, "rdma", HOSTILE)],
            doctor=DoctorSummary(error=HOSTILE), transports=[HOSTILE, "tcp"])
        client.put(keys.host(name), seal(keys.host(name), "host", record, None))
        # a record not even decodable as one, at a hostile key: listed by name with the reason
        client.put(keys.host(f"x{CSI_HIDE}"), HOSTILE.encode())
        info = SegmentInfo(name=f"seg{OSC_TITLE}", kind="shm", engine=HOSTILE, host=HOSTILE,
                           pid=1, addresses=(f"127.0.0.1:9{OSC_52}",), seg_id=1,
                           transports=(HOSTILE,),
                           buffers=(BufferInfo(0, 4096, f"cpu:0{CSI_CLEAR}", HOSTILE),))
        client.put(segment_key("", info.name), info.to_json(key=segment_key("", info.name)))
    finally:
        client.close()


def _strings(doc: object) -> list[str]:
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return []


@pytest.fixture
def hostile_metadata(tmp_path: Path) -> str:
    url = f"file://{tmp_path / 'meta'}"
    _plant(url)
    return url


LISTINGS: list[tuple[str, ...]] = [
    ("metadata", "ls", "kvctl/"),
    ("metadata", "ls", "kvctl/raw/"),
    ("cluster", "ls"),
    ("segment", "list"),
    ("segment", "show", f"seg{OSC_TITLE}"),
]


@pytest.mark.parametrize("args", LISTINGS, ids=lambda a: " ".join(a[:2]))
def test_no_listing_writes_foreign_control_characters_raw(
        args: tuple[str, ...], hostile_metadata: str,
        kvctl: Callable[..., CliResult]) -> None:
    result = kvctl(*args, "--metadata", hostile_metadata,
                   env={"COLUMNS": "400", "KVCTL_TOKEN": ""})
    assert result.exit_code == 0, result.stderr
    _assert_clean(result, " ".join(args[:2]))


@pytest.mark.parametrize("args", LISTINGS, ids=lambda a: " ".join(a[:2]))
def test_json_still_carries_the_exact_foreign_text(
        args: tuple[str, ...], hostile_metadata: str,
        kvctl: Callable[..., CliResult]) -> None:
    result = kvctl(*args, "--metadata", hostile_metadata, "--json",
                   env={"KVCTL_TOKEN": ""})
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout  # JSON escapes it ...
    assert any(HOSTILE in text for text in _strings(result.json()))  # ... and keeps it exact


def test_the_sanitiser_renders_every_control_visibly() -> None:
    every = "".join(chr(c) for c in [*range(0x20), 0x7f, *range(0x80, 0xa0)])
    shown = safe_text(every + BIDI + "é中 ok")
    assert shown.isprintable()
    assert shown.isascii() is False
    assert shown.startswith("\\x00\\x01")
    assert "\\x1b" in shown
    assert "\\x9b" in shown
    assert "\\u202e" in shown
    assert shown.endswith("é中 ok")
    assert safe_text("plain host-1:7400") == "plain host-1:7400"


def test_log_lines_with_foreign_text_are_sanitised() -> None:
    record = logging.LogRecord("kvctl.cluster", logging.WARNING, __file__, 1,
                               "refusing %s", (f"kvctl/cluster/jobs/h0/{HOSTILE}",), None)
    line = SafeFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert not any(raw in line for raw in RAW), line
    assert line.startswith("WARNING kvctl.cluster: refusing kvctl/cluster/jobs/h0/\\x1b]0;")



def test_the_cluster_runbook_table_shows_what_agents_reported_visibly(
        capsys: pytest.CaptureFixture[str]) -> None:
    # rows carry what each host's agent reported (check names, measurements, hints): a host
    # that lies must not reach the operator's terminal through the verdict table either
    from kvctl.cluster.runbook import ClusterCheck, ClusterRunbookReport
    from kvctl.commands.cluster import _render_runbook
    from kvctl.output import Output
    from kvctl.runbook.model import Verdict

    row = ClusterCheck(host=f"h1{CSI_CLEAR}", check=f"store: node{OSC_TITLE}",
                       verdict=Verdict.FAIL, measured=HOSTILE, hint=OSC_52 + MARKUP)
    report = ClusterRunbookReport(hosts=(row.host,), rows=(row,), bench=None, passed=False,
                                  duration_s=1.0)
    _render_runbook(Output(), report)
    captured = capsys.readouterr()
    _assert_clean(CliResult(0, captured.out, captured.err), "cluster runbook")
