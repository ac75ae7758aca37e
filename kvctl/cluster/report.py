"""A cluster bench as data: host x host matrices, the JSON payload, CSV, a heatmap PNG.

The matrix is symmetric: a pair is measured once (its initiator READs and WRITEs, so both
directions are crossed) and its cell is the slower direction, in GB/s (decimal). Rail by
rail there is one matrix per rail (``rail 0``: NIC i of each host against NIC i of the
other) and, across rails, one per rail pair. Strings are returned, never printed.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvctl.cluster.bench import ClusterBenchReport, PairOutcome
from kvctl.cluster.diagnosis import Culprit, Diagnosis, Evidence
from kvctl.cluster.protocol import RowSummary
from kvctl.units import format_size


@dataclasses.dataclass(frozen=True)
class Matrix:
    """Host x host GB/s of one rail (or of the hosts as a whole).

    Attributes:
        label: ``hosts`` or ``rail 0`` / ``rail 0 x rail 1``.
        hosts: row and column order.
        cells: ``cells[i][j]``: GB/s of the pair of hosts i and j; ``None`` on the diagonal
            and where the pair was not measured.
        states: the pair's state where it was not ``ok`` (``missing``, ``failed``...).
    """

    label: str
    hosts: tuple[str, ...]
    cells: tuple[tuple[float | None, ...], ...]
    states: dict[tuple[str, str], str]

    def value(self, a: str, b: str) -> float | None:
        """The cell of hosts ``a`` and ``b``."""
        return self.cells[self.hosts.index(a)][self.hosts.index(b)]


def _rail_key(o: PairOutcome, report: ClusterBenchReport) -> str:
    if not report.per_rail or o.a.nic is None:
        return "hosts"
    ra = next((r.index for r in report.records[o.a.host].rails if r.nic == o.a.nic), None)
    rb = next((r.index for r in report.records[o.b.host].rails if r.nic == o.b.nic), None)
    return f"rail {ra}" if ra == rb else f"rail {ra} x rail {rb}"


def matrices(report: ClusterBenchReport) -> list[Matrix]:
    """One matrix per rail (or one for the hosts)."""
    groups: dict[str, list[PairOutcome]] = {}
    for o in report.outcomes:
        groups.setdefault(_rail_key(o, report), []).append(o)
    out: list[Matrix] = []
    hosts = report.hosts
    for label in sorted(groups, key=lambda k: (k != "hosts", len(k), k)):
        cells: list[list[float | None]] = [[None for _ in hosts] for _ in hosts]
        states: dict[tuple[str, str], str] = {}
        for o in groups[label]:
            i, j = hosts.index(o.a.host), hosts.index(o.b.host)
            cells[i][j] = cells[j][i] = o.gbps
            if o.state != "ok":
                states[(o.a.host, o.b.host)] = states[(o.b.host, o.a.host)] = o.state
        out.append(Matrix(label, hosts, tuple(tuple(r) for r in cells), states))
    return out


def matrix_csv(report: ClusterBenchReport) -> str:
    """Every matrix as CSV: a header ``matrix,host,<hosts...>`` and one line per row;
    an empty cell is not measured (or the diagonal); values are GB/s."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(("matrix", "host", *report.hosts))
    for m in matrices(report):
        for host, row in zip(m.hosts, m.cells, strict=True):
            writer.writerow((m.label, host, *("" if v is None else f"{v:.4f}" for v in row)))
    return out.getvalue()


def _evidence(items: Sequence[Evidence]) -> list[dict[str, Any]]:
    return [{"peer": e.peer.label(), "gbytes_per_s": e.gbps, "slow": e.slow} for e in items]


def culprit_payload(c: Culprit, report: ClusterBenchReport) -> dict[str, Any]:
    """A culprit with its evidence and its host's doctor findings."""
    import msgspec

    record = report.records.get(c.subject.host)
    findings = [msgspec.to_builtins(f) for f in (record.doctor.findings if record else [])
                if f.severity in ("error", "warning")]
    return {"subject": c.subject.label(), "host": c.subject.host, "nic": c.subject.nic,
            "slow_pairs": c.slow_pairs, "measured_pairs": c.measured_pairs,
            "share_of_slow": c.share_of_slow, "median_gbytes_per_s": c.median_gbps,
            "row": _evidence(c.row), "column": _evidence(c.column),
            "topo_findings": findings}


def diagnosis_payload(d: Diagnosis, report: ClusterBenchReport) -> dict[str, Any]:
    """The diagnosis as JSON."""
    def pair(s: Any) -> dict[str, Any]:
        return {"a": s.a.label(), "b": s.b.label(), "gbytes_per_s": s.gbps, "ratio": s.ratio,
                "robust_z": s.robust_z}

    return {"summary": d.summary(), "median_gbytes_per_s": d.median_gbps,
            "mad_gbytes_per_s": d.mad_gbps, "threshold_gbytes_per_s": d.threshold_gbps,
            "slow_fraction": d.slow_fraction,
            "measured": d.measured, "slow": [pair(s) for s in d.slow],
            "culprits": [culprit_payload(c, report) for c in d.culprits],
            "unexplained": [pair(s) for s in d.unexplained], "note": d.note,
            "unreachable": [e.label() for e in d.unreachable]}


#: Wire names of an agent's rows (:class:`~kvctl.cluster.protocol.RowSummary`; agents of the
#: last release still speak them) and their names in ``--json``, which name the unit as
#: ``bench transfer``'s do. The envelope adds the old names back, deprecated, for one release.
ROW_KEYS = {"gbps": "gbytes_per_s", "line_rate_gbps": "line_rate_gbytes_per_s"}


def row_payload(row: RowSummary) -> dict[str, Any]:
    """One agent's row as JSON: GB/s under ``gbytes_per_s`` and ``line_rate_gbytes_per_s``."""
    import msgspec

    return {ROW_KEYS.get(k, k): v for k, v in msgspec.to_builtins(row).items()}


def outcome_payload(o: PairOutcome) -> dict[str, Any]:
    """One pair as JSON (its rows in full)."""
    return {"a": o.a.label(), "b": o.b.label(), "a_address": o.a_address,
            "b_address": o.b_address, "state": o.state, "gbytes_per_s": o.gbps,
            "read_gbytes_per_s": o.op_gbps("read"), "write_gbytes_per_s": o.op_gbps("write"),
            "verified": o.verified, "error": o.error, "round": o.round_index,
            "duration_s": o.duration_s, "rows": [row_payload(r) for r in o.rows]}


def report_payload(report: ClusterBenchReport) -> dict[str, Any]:
    """The ``--json`` payload of ``kvctl cluster bench`` (the CLI adds the envelope)."""
    sweep = report.sweep
    return {
        "run_id": report.run_id, "ok": report.ok, "interrupted": report.interrupted,
        "hosts": list(report.hosts),
        "untrusted": [{"host": h, "problem": p} for h, p in report.untrusted],
        "schedule": {"mode": report.schedule.mode, "rounds": len(report.schedule.rounds),
                     "pairs": len(report.schedule.pairs), "sampled": report.schedule.sampled,
                     "max_concurrency": report.schedule.max_concurrency},
        "sweep": {"ops": [o.value for o in sweep.ops], "transports": list(sweep.transports),
                  "block_sizes_bytes": list(sweep.block_sizes_bytes),
                  "batch_sizes": list(sweep.batch_sizes), "verify": sweep.verify,
                  "duration_s": sweep.duration_s, "iterations": sweep.iterations,
                  "model": dataclasses.asdict(sweep.sizing) if sweep.sizing else None},
        "engines": list(report.engines), "per_rail": report.per_rail,
        "matrices": [{"label": m.label, "hosts": list(m.hosts),
                      "gbytes_per_s": [list(r) for r in m.cells]} for m in matrices(report)],
        "pairs": [outcome_payload(o) for o in report.outcomes],
        "missing": [dataclasses.asdict(m) for m in report.missing],
        "diagnosis": diagnosis_payload(report.diagnosis, report),
        "started_at": report.started_at, "duration_s": report.duration_s,
    }


def describe_sweep(report: ClusterBenchReport) -> str:
    """``read+write tcp 256 KiB x8, verified``: what each pair ran."""
    s = report.sweep
    sizes = ",".join(format_size(b) for b in s.block_sizes_bytes)
    batches = ",".join(str(n) for n in s.batch_sizes)
    text = (f"{'+'.join(o.value for o in s.ops)} {','.join(s.transports)} {sizes} "
            f"x{batches}")
    if s.sizing is not None:
        text += f" ({s.sizing.model} KV pages of {s.sizing.tokens_per_block} tokens)"
    return text + (", verified" if s.verify else "")


def plot_heatmap(report: ClusterBenchReport, path: Path) -> Path:
    """Write the matrices as heatmaps (one panel per rail) to ``path`` (PNG).

    Raises:
        UnavailableError: matplotlib is missing (the ``plot`` extra).
    """
    import importlib

    from kvctl.bench.plot import require_matplotlib

    require_matplotlib()
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")  # files only: never open a window
    plt = importlib.import_module("matplotlib.pyplot")
    mats = matrices(report)
    fig, axes = plt.subplots(1, len(mats), figsize=(1.2 + 0.9 * len(report.hosts) * len(mats),
                                                     0.9 * len(report.hosts) + 1.4),
                             squeeze=False)
    values = [v for m in mats for row in m.cells for v in row if v is not None]
    top = max(values) if values else 1.0
    culprits = {c.subject.host for c in report.diagnosis.culprits}
    for ax, m in zip(axes[0], mats, strict=True):
        grid = [[float("nan") if v is None else v for v in row] for row in m.cells]
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=top)
        ax.set_xticks(range(len(m.hosts)), labels=list(m.hosts), rotation=45, ha="right")
        ax.set_yticks(range(len(m.hosts)), labels=list(m.hosts))
        for label in (*ax.get_xticklabels(), *ax.get_yticklabels()):
            if label.get_text() in culprits:
                label.set_color("crimson")
                label.set_fontweight("bold")
        for i, row in enumerate(m.cells):
            for j, v in enumerate(row):
                state = m.states.get((m.hosts[i], m.hosts[j]))
                text = f"{v:.3g}" if v is not None else ("" if i == j else (state or "-"))
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="white" if v is not None and v < 0.6 * top else "black")
        ax.set_title(f"{m.label}: GB/s" if len(mats) > 1 else "GB/s (slower direction)",
                     fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    named = ", ".join(c.subject.label() for c in report.diagnosis.culprits)
    fig.suptitle(f"kvctl cluster bench: {describe_sweep(report)}"
                 + (f"\nlikely culprit: {named}" if named else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
