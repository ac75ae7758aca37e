"""``kvctl topo``: GPU-NIC PCIe affinity, its doctor, and host snapshots."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kvctl.commands._common import JsonOpt, global_options
from kvctl.errors import UsageError
from kvctl.output import Output
from kvctl.topo.doctor import Finding, Severity, has_errors, run_doctor
from kvctl.topo.export import (
    env_lines,
    locations,
    mooncake_notes,
    mooncake_topology,
    topology_payload,
)
from kvctl.topo.model import LEGEND, PortState, Topology
from kvctl.topo.rank import rank_nics
from kvctl.topo.snapshot import write_snapshot
from kvctl.topo.sources import TopoSettings, live_sources, load_topology
from kvctl.verdict import check_entry
from kvctl.wording import plural

app = typer.Typer(
    help="GPU-NIC PCIe affinity: which NIC serves which GPU, and what is misconfigured."
    "\n\nExample: kvctl topo --format env",
    no_args_is_help=False,
)


class Format(enum.StrEnum):
    """Output formats of ``kvctl topo``."""

    TABLE = "table"
    JSON = "json"
    MOONCAKE = "mooncake"
    ENV = "env"


SysfsRootOpt = Annotated[
    Path | None,
    typer.Option("--sysfs-root", help="Directory that plays / for sysfs (default: this host).",
                 show_default=False),
]
FromOpt = Annotated[
    Path | None,
    typer.Option("--from", help="Read a recorded host instead: a 'kvctl topo snapshot' "
                 "archive, an hwloc XML (lstopo --of xml) or an NCCL topology "
                 "(NCCL_TOPO_DUMP_FILE); the format is read from the content.",
                 show_default=False),
]


def _load(ctx: typer.Context, sysfs_root: Path | None, snapshot: Path | None) -> Topology:
    if sysfs_root is not None and snapshot is not None:
        raise UsageError("--sysfs-root and --from both name a host",
                         "give one: a sysfs tree (--sysfs-root) or a snapshot (--from)")
    settings = global_options(ctx).settings(TopoSettings, sysfs_root=sysfs_root)
    return load_topology(settings, snapshot)


@app.callback(invoke_without_command=True)
def topo(
    ctx: typer.Context,
    sysfs_root: SysfsRootOpt = None,
    snapshot: FromOpt = None,
    fmt: Annotated[
        Format, typer.Option("--format", "-f", help="table, json, mooncake or env.")
    ] = Format.TABLE,
    json_out: JsonOpt = False,
) -> None:
    """Show the GPU x NIC matrix (nvidia-smi topo -m legend) and the NIC to use per GPU.

    Example: kvctl topo --format env
    """
    if ctx.invoked_subcommand is not None:
        return
    if json_out and fmt not in (Format.TABLE, Format.JSON):
        raise UsageError(f"--json and --format {fmt.value} disagree", "give one of them")
    topology = _load(ctx, sysfs_root, snapshot)
    out = global_options(ctx).output(json_mode=json_out or fmt is Format.JSON)
    if json_out or fmt is Format.JSON:
        out.emit_json("topo.matrix", topology_payload(topology))
    elif fmt is Format.MOONCAKE:
        # Mooncake parses every member as [preferred, available]: no envelope here. No
        # usable HCA raises (exit 3) instead of printing a topology Mooncake rejects.
        document = mooncake_topology(topology)
        for note in mooncake_notes(topology):
            out.warn(note)
        typer.echo(json.dumps(document, indent=2))
    elif fmt is Format.ENV:
        typer.echo("\n".join(env_lines(topology)))
    else:
        _render(out, topology)


def _cls_text(value: str) -> Text:
    styles = {"PIX": "green", "PXB": "green", "PHB": "yellow", "NODE": "yellow",
              "SYS": "red", "X": "dim"}
    style = "cyan" if value.startswith("NV") else styles.get(value, "")
    return Text(value, style=style)


def _rate(gbps: float | None) -> str:
    return f"{gbps:g} Gb/s" if gbps else "?"


def _numa(node: int | None) -> str:
    return str(node) if node is not None else "N/A"


def _print_wide(out: Output, table: Table) -> None:
    """Print ``table`` at its natural width, wider than the terminal if it must be (like
    ``nvidia-smi topo -m``), instead of eliding its cells."""
    if out.json_mode:
        return
    console = out.console
    needed = Measurement.get(console, console.options.update(max_width=100_000), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    wide = Console(file=console.file, width=needed, highlight=False, soft_wrap=False,
                   force_terminal=console.is_terminal, no_color=console.no_color)
    wide.print(table)


def _render(out: Output, topology: Topology) -> None:
    gpus, nics = topology.gpus, topology.nics
    if gpus:
        matrix = Table(title="GPU x NIC topology", title_justify="left")
        matrix.add_column("")
        for g in gpus:
            matrix.add_column(g.name, justify="center")
        for n in nics:
            matrix.add_column(n.name, justify="center")
        matrix.add_column("CPU Affinity")
        matrix.add_column("NUMA Affinity", justify="center")
        for g in gpus:
            cells = [_cls_text(topology.gpu_gpu[g.name][o.name]) for o in gpus]
            cells += [_cls_text(topology.gpu_nic[g.name][n.name].value) for n in nics]
            matrix.add_row(Text(g.name, style="bold"), *cells, g.cpu_affinity or "N/A",
                           _numa(g.numa_node))
        _print_wide(out, matrix)
        nvml = topology.source("nvml")
        if topology.nvswitches and (nvml is None or not nvml.available):
            out.print(Text(f"GPU x GPU cells show the PCIe path only: {len(topology.nvswitches)} "
                           "NVSwitch(es) here, but no NVML to show NVLink (nvidia-smi would "
                           "print NV#).", style="yellow"))
        out.print("Legend:")
        for key, text in LEGEND:
            out.print(f"  {key:<5} = {text}")
        out.print("")
    else:
        out.print("No NVIDIA GPU found (sysfs lists no display device of vendor 0x10de).")
    if gpus:
        gtable = Table(title="GPUs", title_justify="left")
        for col in ("GPU", "CUDA", "model", "PCI", "NUMA", "PCIe link (now/max)"):
            gtable.add_column(col)
        for g in gpus:
            link = g.place.link
            now = (f"{link.current_speed_gts:g} GT/s x{link.current_width}"
                   if link.current_speed_gts else "?")
            cap = f"{link.max_speed_gts:g} GT/s x{link.max_width}" if link.max_speed_gts else "?"
            gtable.add_row(g.name, g.location or "hidden", g.model, g.pci,
                           _numa(g.numa_node), f"{now} / {cap}")
        _print_wide(out, gtable)
    if nics:
        ntable = Table(title="NICs", title_justify="left")
        for col in ("NIC", "kind", "PCI", "NUMA", "state", "rate", "ports"):
            ntable.add_column(col)
        for n in nics:
            ports = "; ".join(
                f"{p.port}: {p.raw_state or '?'}"
                + (f" {p.link_layer}" if p.link_layer else "")
                + (f" {p.netdev} mtu {p.netdev_mtu}" if p.netdev else "")
                for p in n.ports
            )
            state_style = "green" if n.state is PortState.ACTIVE else "red"
            ntable.add_row(n.name, n.kind.value, n.pci or "?", _numa(n.numa_node),
                           Text(n.state.value, style=state_style), _rate(n.rate_gbps), ports)
        _print_wide(out, ntable)
    else:
        out.print("No NIC found (no RDMA device, no PCI-backed netdev).")
    if nics:
        use = Table(title="Use this NIC", title_justify="left")
        for col in ("location", "use", "class", "rate", "ranked (best first)"):
            use.add_column(col)
        for loc in locations(topology):
            ranked = rank_nics(topology, loc)
            gpu = next((g for g in gpus if g.location == loc), None)
            label = f"{gpu.name} ({loc})" if gpu else loc
            best = ranked[0] if ranked and ranked[0].state is PortState.ACTIVE else None
            order = ", ".join(
                f"{r.name} {r.link_class.value}"
                + ("" if r.state is PortState.ACTIVE else f" [{r.state.value}]")
                for r in ranked
            )
            if best is None:
                use.add_row(label, Text("none ACTIVE", style="red"), "", "", order)
            else:
                use.add_row(label, Text(best.name, style="bold"),
                            _cls_text(best.link_class.value), _rate(best.rate_gbps), order)
        _print_wide(out, use)
    _render_sources(out, topology)


def _render_sources(out: Output, topology: Topology) -> None:
    out.print("Sources:")
    for s in topology.sources:
        if s.available:
            out.print(Text(f"  {s.name}: {s.detail}"))
        else:
            out.print(Text(f"  {s.name}: unavailable: {s.detail}", style="yellow"))


@app.command()
def doctor(
    ctx: typer.Context,
    sysfs_root: SysfsRootOpt = None,
    snapshot: FromOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check the GPU/NIC wiring: port states, PCIe links, distances, GIDs, MTU, modules.

    Exits 1 when a finding is an error.

    Example: kvctl topo doctor --from host.tar.gz
    """
    topology = _load(ctx, sysfs_root, snapshot)
    findings = run_doctor(topology)
    out = global_options(ctx).output(json_mode=json_out)
    counts = {s.value: sum(1 for f in findings if f.severity is s) for s in Severity}
    if json_out:
        out.emit_json("topo.doctor", {
            "ok": not has_errors(findings),
            "checks": [check_entry(f"{f.check} {f.subject}", _FINDING_STATUS[f.severity],
                                   detail=f.message, hint=f.hint) for f in findings],
            "counts": counts,
            "findings": findings,
            "sources": topology_payload(topology)["sources"],
        })
    else:
        _render_findings(out, findings)
        _render_sources(out, topology)
        out.print(f"{counts['error']} error(s), {counts['warning']} warning(s), "
                  f"{counts['info']} info")
    if has_errors(findings):
        raise typer.Exit(1)


#: A finding as a verdict entry: only errors fail the doctor.
_FINDING_STATUS = {Severity.ERROR: "fail", Severity.WARNING: "warn", Severity.INFO: "pass"}


def _render_findings(out: Output, findings: list[Finding]) -> None:
    if not findings:
        out.print("No findings: the GPU/NIC wiring looks right.")
        return
    styles = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "dim"}
    for f in findings:
        line = Text(f"{f.severity.value.upper():<7}", style=styles[f.severity])
        line.append(f" {f.subject} ", style="bold")
        line.append(f"[{f.check}] {f.message}")
        out.print(line)
        out.print(Text(f"        fix: {f.hint}", style="dim"))


@app.command()
def snapshot(
    ctx: typer.Context,
    out_path: Annotated[Path, typer.Argument(metavar="OUT.tar.gz",
                                             help="Archive to write.")],
    sysfs_root: SysfsRootOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Record exactly what topo reads (sysfs files, NVML and verbs answers) into a tar.gz.

    Diagnose it anywhere with: kvctl topo --from OUT.tar.gz

    Example: kvctl topo snapshot host.tar.gz
    """
    settings = global_options(ctx).settings(TopoSettings, sysfs_root=sysfs_root)
    sources = live_sources(settings)
    try:
        summary = write_snapshot(out_path, settings.sysfs_root, sources.nvml, sources.verbs)
    finally:
        sources.nvml.close()
    out = global_options(ctx).output(json_mode=json_out)
    if json_out:
        out.emit_json("topo.snapshot", dataclasses.asdict(summary))
    else:
        out.print(f"Wrote {summary.path}: {plural(summary.files, 'file')}, "
                  f"{plural(summary.links, 'symlink')}, "
                  f"{plural(summary.dirs, 'directory', 'directories')}, "
                  f"{plural(summary.size_bytes, 'byte')}.")
        out.print(f"Read it anywhere with: kvctl topo --from {summary.path}")

