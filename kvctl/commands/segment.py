"""``kvctl segment``: register, list, show and remove transfer-engine segments."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kvctl.commands._common import JsonOpt, global_options, stop_on_signal, wait_until
from kvctl.commands.metadata import shared_metadata
from kvctl.config import CommonSettings
from kvctl.metadata import MetadataSettings, open_configured
from kvctl.output import safe_cell
from kvctl.transfer.admin import list_segments, lookup_segment, remove_segment
from kvctl.transfer.engine import TransferEngine
from kvctl.transfer.segments import SegmentInfo
from kvctl.transfer.settings import SegmentSettings
from kvctl.units import format_size

app = typer.Typer(help="Transfer-engine segments: register and serve, list, show, remove.\n\n"
                       "Example: kvctl segment list --metadata file:///tmp/kvmeta",
                  no_args_is_help=True)

MetadataOpt = Annotated[
    str | None,
    typer.Option("--metadata", "-m", show_default=False,
                 help="Metadata service URL (default: KVCTL_METADATA / common.metadata)."),
]


@app.command()
def register(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Segment name (unique in the cluster).")],
    size: Annotated[str | None, typer.Option(
        "--size", "-s", show_default=False,
        help="Size, e.g. 64MiB (default segment.size).")] = None,
    kind: Annotated[str | None, typer.Option(
        "--kind", show_default=False, help="shm (host DRAM, default) or file.")] = None,
    path: Annotated[Path | None, typer.Option(
        "--path", show_default=False, help="Backing file of a file segment.")] = None,
    listen: Annotated[str | None, typer.Option(
        "--listen", show_default=False,
        help="HOST:PORT of the target server (default: loopback, or the address that routes "
        "to a metadata service on another host; any free port).")] = None,
    metadata: MetadataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Create a segment and serve it in the foreground until SIGINT/SIGTERM.

    Prints the segment's name and address once it is published (with a lease renewed by a
    heartbeat, so it vanishes if this process dies).

    Example: kvctl segment register kv-a --size 1GiB --metadata file:///tmp/kvmeta
    """
    opts = global_options(ctx)
    settings = opts.settings(SegmentSettings, size=size, kind=kind, path=path, listen=listen)
    common = opts.settings(CommonSettings, metadata=metadata)
    out = opts.output(json_mode=json_)
    engine_name = settings.engine or f"{name}-engine"
    with stop_on_signal() as stop, open_configured(
        common, opts.settings(MetadataSettings)) as client, TransferEngine(
        engine_name, client, cluster_id=common.cluster_id, listen=settings.listen or None,
        token=common.token, lease_ttl_s=settings.lease_ttl_s,
        connections_per_peer=settings.connections, slice_bytes=settings.slice_size,
    ) as engine:
        engine.register_segment(name, settings.size, kind=settings.kind, path=settings.path)
        info = engine.lookup(name)
        if json_:
            out.emit_json("segment.register", {"segment": info, "metadata": client.url})
        else:
            out.print(Text(f"{info.name} {','.join(info.addresses)}"))
            out.info(f"serving {info.kind} segment {info.name} ({format_size(info.size_bytes)}) "
                     f"on {','.join(info.addresses)}; published in {client.url}; Ctrl-C stops")
        wait_until(stop)
    out.info(f"segment {name} withdrawn")


def _row(info: SegmentInfo) -> list[str]:
    return [info.name, info.kind, format_size(info.size_bytes), info.engine,
            ",".join(info.addresses), ",".join(info.transports), info.host.split("/")[0]]


@app.command("list")
def list_(
    ctx: typer.Context,
    metadata: MetadataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """List the segments published in the metadata service.

    Example: kvctl segment list --metadata file:///tmp/kvmeta
    """
    opts = global_options(ctx)
    common = shared_metadata(opts.settings(CommonSettings, metadata=metadata))
    with open_configured(common, opts.settings(MetadataSettings)) as client:
        infos = list_segments(client, common.cluster_id)
        url = client.url
    out = opts.output(json_mode=json_)
    if json_:
        out.emit_json("segment.list", {"metadata": url, "segments": infos})
        return
    if not infos:
        out.info(f"no segments published in {url}")
        return
    table = Table(title=f"{len(infos)} segment(s) in {url}", title_justify="left")
    for column in ("name", "kind", "size", "engine", "address", "transports", "host"):
        table.add_column(column, overflow="fold")
    for info in infos:
        table.add_row(*(safe_cell(cell) for cell in _row(info)))
    out.print(table)


@app.command()
def show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Segment name.")],
    metadata: MetadataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show one published segment: address, transports and buffers.

    Exit code 1 when the segment is not published.

    Example: kvctl segment show kv-a --json
    """
    opts = global_options(ctx)
    common = shared_metadata(opts.settings(CommonSettings, metadata=metadata))
    with open_configured(common, opts.settings(MetadataSettings)) as client:
        info = lookup_segment(client, common.cluster_id, name, token=common.token)
    out = opts.output(json_mode=json_)
    if json_:
        out.emit_json("segment.show", {"segment": info})
        return
    table = Table(title=safe_cell(f"segment {info.name}"), title_justify="left",
                  show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    for field, value in [("kind", info.kind), ("size", format_size(info.size_bytes)),
                         ("engine", info.engine), ("host", info.host), ("pid", str(info.pid)),
                         ("addresses", ",".join(info.addresses)),
                         ("transports", ",".join(info.transports)),
                         ("auth", "token required" if info.auth else "open")]:
        table.add_row(field, safe_cell(value))
    out.print(table)
    buffers = Table(title="buffers", title_justify="left")
    for column in ("offset (B)", "length (B)", "location", "path"):
        buffers.add_column(column, overflow="fold")
    for buf in info.buffers:
        buffers.add_row(str(buf.offset), str(buf.length), safe_cell(buf.location),
                        safe_cell(buf.path or "-"))
    out.print(buffers)


@app.command()
def rm(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Segment name.")],
    metadata: MetadataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove a stale segment entry (and its shm file when its process is gone).

    Exit code 1 when the segment is not published.

    Example: kvctl segment rm kv-a --metadata file:///tmp/kvmeta
    """
    opts = global_options(ctx)
    common = shared_metadata(opts.settings(CommonSettings, metadata=metadata))
    with open_configured(common, opts.settings(MetadataSettings)) as client:
        removed = remove_segment(client, common.cluster_id, name)
    out = opts.output(json_mode=json_)
    if json_:
        out.emit_json("segment.rm", {"removed": removed})
        return
    out.print(Text(f"removed {removed.key}"))
    for path in removed.files_removed:
        out.info(f"deleted stale shared memory file {path}")
