"""``kvctl runbook --report report.html``: one self-contained HTML file to forward.

The file needs nothing but a browser: CSS is inline, the bench plot is a ``data:`` PNG, and
nothing refers to the network (no script, font, stylesheet or image from anywhere else).
Sections, in order: the verdict table (every check), the bench plot and rows, the topo
matrix (GPU x NIC, NICs, the NIC to use per buffer location) and the topo doctor findings.
A section whose step did not run says so. All text from the run is HTML-escaped.
"""

from __future__ import annotations

import base64
import datetime
import html
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl import __version__
from kvctl.errors import KvctlError, UsageError
from kvctl.runbook.model import Verdict
from kvctl.units import format_size

if TYPE_CHECKING:
    from kvctl.bench.result import ResultRow
    from kvctl.runbook.runner import RunbookReport
    from kvctl.topo.doctor import Finding
    from kvctl.topo.model import Topology

_CSS = """
:root { --pass: #1e7b34; --fail: #b42318; --skip: #9a6700; --line: #d0d7de; --muted: #57606a; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
       margin: 0 auto; padding: 24px; max-width: 1240px; background: #fff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; padding-bottom: 4px;
     border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 16px 0 6px; }
.meta, .note { color: var(--muted); }
.badge { display: inline-block; padding: 2px 10px; border-radius: 12px; color: #fff;
         font-weight: 600; vertical-align: middle; }
.badge.pass { background: var(--pass); } .badge.fail { background: var(--fail); }
table { border-collapse: collapse; margin: 6px 0 12px; width: 100%; }
th, td { border: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.pass td.verdict { color: var(--pass); font-weight: 600; }
tr.fail td.verdict { color: var(--fail); font-weight: 700; }
tr.skip td.verdict { color: var(--skip); font-weight: 600; }
tr.fail { background: #fff5f5; }
tr.invalid { background: #fff8c5; }
.scroll { overflow-x: auto; max-width: 100%; }
table.matrix { width: auto; } table.matrix td { text-align: center; }
table.matrix td, table.matrix th { padding: 3px 6px; white-space: nowrap; }
.cls-good { background: #dafbe1; } .cls-mid { background: #fff8c5; }
.cls-bad { background: #ffebe9; } .cls-nv { background: #ddf4ff; } .cls-self { color: #8c959f; }
.sev-error { color: var(--fail); font-weight: 700; }
.sev-warning { color: var(--skip); font-weight: 600; }
img.plot { max-width: 100%; border: 1px solid var(--line); }
@media print { body { padding: 0; } h2 { break-after: avoid; } .scroll { overflow: visible; } }
"""


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "",
           row_classes: Sequence[str] | None = None, num: frozenset[int] = frozenset(),
           raw: bool = False) -> str:
    """A table; cells are escaped unless ``raw`` (then the caller escaped them)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        klass = f' class="{row_classes[i]}"' if row_classes else ""
        cells = "".join(
            f'<td{" class=num" if j in num else ""}>{c if raw else _e(c)}</td>'
            for j, c in enumerate(row))
        body.append(f"<tr{klass}>{cells}</tr>")
    klass = f' class="{cls}"' if cls else ""
    return f"<table{klass}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _verdicts(report: RunbookReport) -> str:
    results = report.results
    counts = {v: sum(1 for r in results if r.verdict is v) for v in Verdict}
    head = "".join(f"<th>{h}</th>" for h in ("check", "result", "measured", "threshold", "hint"))
    body = "".join(
        f'<tr class="{r.verdict.value}"><td>{_e(r.check)}</td>'
        f'<td class="verdict">{_e(r.verdict.value)}</td><td>{_e(r.measured)}</td>'
        f"<td>{_e(r.threshold)}</td><td>{_e(r.hint)}</td></tr>" for r in results)
    summary = ", ".join(f"{n} {v.value}" for v, n in counts.items() if n) or "no checks"
    return (f'<h2 id="verdicts">Verdicts</h2><p class="meta">{len(results)} checks: '
            f'{_e(summary)}</p><table class="verdicts"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def _plot_img(rows: Sequence[ResultRow], title: str) -> str:
    from kvctl.bench.plot import plot_png

    try:
        png = plot_png(rows, title=title)
    except KvctlError as exc:  # matplotlib missing: say so, keep the rest of the report
        return f'<p class="note">No plot: {_e(exc.cause)} ({_e(exc.hint)}).</p>'
    data = base64.b64encode(png).decode("ascii")
    return (f'<img class="plot" alt="{_e(title)}: throughput and p99 latency against block '
            f'size" src="data:image/png;base64,{data}">')


def _bench(step: str, rows: Sequence[ResultRow]) -> str:
    out = [f"<h3>{_e(step)}</h3>", _plot_img(rows, f"runbook step {step}")]
    table_rows, classes = [], []
    for r in rows:
        if r.line_rate_fraction is None:
            line = "-"
        elif r.line_rate_valid is False:
            line = f"{r.line_rate_fraction:.0%}: baseline invalid"
        else:
            line = f"{r.line_rate_fraction:.0%}"
        table_rows.append((r.engine, r.op, r.transport, format_size(r.block_size_bytes),
                           str(r.batch_size), f"{r.throughput_gbytes_per_s:.3f}",
                           f"{r.batch_latency_p99_us / 1000:.2f}", line,
                           r.line_rate_source or "-", str(r.errors),
                           "yes" if r.verified else "-"))
        classes.append("fail" if r.errors else "invalid" if r.line_rate_valid is False else "")
    out.append(_table(("engine", "op", "path", "block", "batch", "GB/s", "p99 ms",
                       "of line rate", "line rate from", "errors", "verified"), table_rows,
                      row_classes=classes, num=frozenset({3, 4, 5, 6, 9})))
    return "".join(out)


def _cls(value: str) -> str:
    if value == "X":
        return "cls-self"
    if value.startswith("NV"):
        return "cls-nv"
    return {"PIX": "cls-good", "PXB": "cls-good", "PHB": "cls-mid", "NODE": "cls-mid",
            "SYS": "cls-bad"}.get(value, "")


def _topology(step: str, topology: Topology) -> str:
    from kvctl.topo.export import locations
    from kvctl.topo.model import LEGEND, PortState
    from kvctl.topo.rank import rank_nics

    gpus, nics = topology.gpus, topology.nics
    out = [f"<h3>{_e(step)}</h3>"]
    if gpus:
        head = "".join(f"<th>{_e(n)}</th>" for n in [""] + [g.name for g in gpus]
                       + [n.name for n in nics] + ["CPU affinity", "NUMA"])
        body = []
        for g in gpus:
            values = ([topology.gpu_gpu[g.name][o.name] for o in gpus]
                      + [topology.gpu_nic[g.name][n.name].value for n in nics])
            cells = "".join(f'<td class="{_cls(v)}">{_e(v)}</td>' for v in values)
            body.append(f"<tr><th>{_e(g.name)}</th>{cells}<td>{_e(g.cpu_affinity or 'N/A')}"
                        f"</td><td>{_e(g.numa_node if g.numa_node is not None else 'N/A')}"
                        "</td></tr>")
        out.append(f'<div class="scroll"><table class="matrix" id="topo-matrix"><thead><tr>'
                   f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")
        out.append('<p class="note">' + "; ".join(f"<b>{_e(k)}</b> {_e(v)}" for k, v in LEGEND)
                   + "</p>")
    else:
        out.append('<p class="note">No NVIDIA GPU found: no GPU x NIC matrix.</p>')
    if nics:
        out.append(_table(("NIC", "kind", "PCI", "NUMA", "state", "rate (Gbit/s)"), [
            (n.name, n.kind.value, n.pci or "?",
             str(n.numa_node) if n.numa_node is not None else "N/A", n.state.value,
             f"{n.rate_gbps:g}" if n.rate_gbps else "?") for n in nics]))
        use = []
        for loc in locations(topology):
            ranked = rank_nics(topology, loc)
            best = ranked[0] if ranked and ranked[0].state is PortState.ACTIVE else None
            order = ", ".join(f"{r.name} {r.link_class.value}" for r in ranked)
            use.append((loc, best.name if best else "none ACTIVE",
                        best.link_class.value if best else "", order))
        out.append("<h3>Use this NIC</h3>")
        out.append(_table(("buffer", "use", "class", "ranked (best first)"), use))
    else:
        out.append('<p class="note">No NIC found (no RDMA device, no PCI-backed netdev).</p>')
    return "".join(out)


def _findings(step: str, findings: Sequence[Finding]) -> str:
    if not findings:
        return f'<h3>{_e(step)}</h3><p class="note">No findings.</p>'
    rows = [(f'<span class="sev-{_e(f.severity.value)}">{_e(f.severity.value)}</span>',
             _e(f.subject), _e(f.message), _e(f.hint), _e(f.check)) for f in findings]
    return (f"<h3>{_e(step)}</h3>"
            + _table(("severity", "subject", "finding", "hint", "check"), rows, raw=True,
                     cls="findings"))


def _section(title: str, anchor: str, parts: list[str], missing: str) -> str:
    body = "".join(parts) if parts else f'<p class="note">{_e(missing)}</p>'
    return f'<h2 id="{anchor}">{_e(title)}</h2>{body}'


def render_html(report: RunbookReport, *, host: str | None = None,
                generated: datetime.datetime | None = None) -> str:
    """The report as one HTML document (a string; nothing is written)."""
    when = (generated or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    host = host or socket.gethostname()
    by_kind: dict[str, list[tuple[str, Any]]] = {}
    for a in report.artifacts:
        by_kind.setdefault(a.kind, []).append((a.step, a.value))
    verdict = "pass" if report.passed else "fail"
    head = (f"<h1>kvctl runbook {_e(report.name)} "
            f'<span class="badge {verdict}">{"PASSED" if report.passed else "FAILED"}</span>'
            f'</h1><p class="meta">host {_e(host)} · {_e(when)} · {report.duration_s:.1f} s · '
            f"kvctl {_e(__version__)}</p>")
    body = [
        head,
        _verdicts(report),
        _section("Transfer benchmark", "bench",
                 [_bench(step, rows) for step, rows in by_kind.get("bench-rows", []) if rows],
                 "No bench-transfer step ran in this runbook."),
        _section("Topology", "topology",
                 [_topology(step, t) for step, t in by_kind.get("topology", [])],
                 "No topo-doctor step ran in this runbook."),
        _section("Doctor findings", "findings",
                 [_findings(step, f) for step, f in by_kind.get("topo-findings", [])],
                 "No topo-doctor step ran in this runbook."),
    ]
    title = f"kvctl runbook {report.name}: {'PASSED' if report.passed else 'FAILED'}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def check_report_path(path: Path) -> None:
    """Fail early when ``path`` cannot be written: its folder is missing or read-only, or it
    is a folder.

    Raises:
        UsageError: it cannot be written.
    """
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"--report {path} is a folder", "give a file name, e.g. report.html")
    if not folder.is_dir():
        raise UsageError(f"--report {path}: folder {folder} does not exist",
                         "create it first, or give a path in an existing folder")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--report {path}: folder {folder} is not writable",
                         "give a path in a folder you can write")


def write_report(report: RunbookReport, path: Path) -> Path:
    """Write :func:`render_html` to ``path`` (a temporary file renamed into place).

    Raises:
        UsageError: the file cannot be written.
    """
    text = render_html(report)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write report {path}: {exc.strerror or exc}",
                         "give --report a writable path, e.g. --report report.html") from exc
    return path
