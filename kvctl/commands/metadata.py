"""``kvctl metadata``: run kvctl's metadata server and inspect what is published."""

from __future__ import annotations

import base64
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from kvctl.commands._common import JsonOpt, global_options, stop_on_signal, wait_until
from kvctl.config import CommonSettings
from kvctl.errors import NotFoundError, UsageError
from kvctl.metadata import MetadataServer, MetadataSettings, key_prefix, open_configured
from kvctl.metadata.settings import DEFAULT_PORT
from kvctl.metrics import ServerMetrics
from kvctl.net.bind import parse_listen
from kvctl.output import Output, safe_cell
from kvctl.wording import plural

app = typer.Typer(help="kvctl's metadata server, and what is published in a metadata service.\n\n"
                  "Example: kvctl metadata serve --listen 127.0.0.1:7420",
                  no_args_is_help=True)

MetadataOpt = Annotated[
    str | None,
    typer.Option("--metadata", "-m", show_default=False,
                 help="Metadata service URL (default: KVCTL_METADATA / common.metadata)."),
]
_PREVIEW_CHARS = 60


@app.command()
def serve(
    ctx: typer.Context,
    listen: Annotated[str | None, typer.Option(
        "--listen", show_default=False,
        help=f"HOST:PORT to listen on (default 127.0.0.1:{DEFAULT_PORT}; port 0 = any free).",
    )] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", show_default=False,
        help="Keep entries and leases in files here, so they survive a restart.",
    )] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", show_default=False,
        help="Serve Prometheus metrics on this port of the listen host (0 = any free).",
    )] = None,
    json_: JsonOpt = False,
) -> None:
    """Run kvctl's metadata server until SIGINT or SIGTERM, printing the URL to use.

    With a token (KVCTL_TOKEN or common.token) every request must be signed with it.

    Example: kvctl metadata serve --listen 127.0.0.1:7420 --data-dir /var/lib/kvctl/metadata
    """
    opts = global_options(ctx)
    settings = opts.settings(MetadataSettings, listen=listen, data_dir=data_dir,
                             metrics_port=metrics_port)
    common = opts.settings(CommonSettings)
    host, port = parse_listen(settings.listen, default_port=DEFAULT_PORT)
    out = opts.output(json_mode=json_)
    metrics = ServerMetrics("kvctl_metadata") if settings.metrics_port is not None else None
    server = MetadataServer(host, port, token=common.token, data_dir=settings.data_dir,
                            request_timeout_s=settings.request_timeout_s,
                            max_body_bytes=settings.max_body_bytes, metrics=metrics)
    # Handlers go in before the URL is printed: whoever reads it may signal right away.
    with stop_on_signal() as stop:
        try:
            if metrics is not None and settings.metrics_port is not None:
                where, bound = metrics.serve_for(host, settings.metrics_port,
                                                 token=common.token)
                out.info(f"metrics on http://{where}:{bound}/metrics")
            _serve_until(server, stop, out, settings, common, json_mode=json_)
        finally:
            if metrics is not None:
                metrics.close()
    out.info("metadata server stopped")


def _serve_until(server: MetadataServer, stop: threading.Event, out: Output,
                 settings: MetadataSettings, common: CommonSettings, *, json_mode: bool) -> None:
    with server:
        if json_mode:
            out.emit_json("metadata.serve", {
                "url": server.url, "auth": common.token is not None,
                "data_dir": settings.data_dir,
            })
        else:
            out.print(Text(server.url))
            storage = f"files in {settings.data_dir}" if settings.data_dir else "memory"
            auth = "signed requests only" if common.token else "no token: anyone who can connect"
            out.info(f"metadata server up ({storage}; {auth}); use KVCTL_METADATA={server.url}; "
                     "Ctrl-C stops it")
        wait_until(stop)


def _describe(key: str, value: bytes) -> dict[str, Any]:
    try:
        text: str | None = value.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"key": key, "size_bytes": len(value), "value": text,
            "value_base64": base64.b64encode(value).decode()}


def shared_metadata(common: CommonSettings) -> CommonSettings:
    """``common`` when it names a metadata service another process can have written to.

    Raises:
        UsageError: it is ``memory://`` (the default): this process's own map, empty here.
    """
    if common.metadata.startswith("memory://"):
        raise UsageError(
            "no metadata service is configured: memory:// (the default) is this process's "
            "own map, and a new process's is empty",
            "name one with --metadata (etcd://HOST:2379, redis://HOST:6379, file:///DIR, or "
            f"http://HOST:{DEFAULT_PORT} for 'kvctl metadata serve'), KVCTL_METADATA or "
            "common.metadata in the config file")
    return common


def _utf8(text: str | None) -> str | None:
    """A key or prefix the metadata backends can store: UTF-8 text (the shell hands bytes
    that are not UTF-8 over as lone surrogates)."""
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"key {text!r} is not valid UTF-8",
                             "keys are UTF-8 text: check the bytes (or the shell's locale)"
                             ) from None
    return text


@app.command("ls")
def ls(
    ctx: typer.Context,
    prefix: Annotated[str | None, typer.Argument(
        show_default=False, help="Key prefix (default: kvctl/ or kvctl/<cluster_id>/).",
        callback=_utf8)] = None,
    metadata: MetadataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """List the live entries under a prefix, with their sizes and a preview.

    Example: kvctl metadata ls kvctl/segments/ --metadata etcd://10.0.0.1:2379
    """
    opts = global_options(ctx)
    settings = opts.settings(MetadataSettings)
    common = shared_metadata(opts.settings(CommonSettings, metadata=metadata))
    chosen = key_prefix(common.cluster_id) if prefix is None else prefix
    with open_configured(common, settings) as client:
        entries = client.list(chosen)
        url = client.url
    out = opts.output(json_mode=json_)
    if json_:
        out.emit_json("metadata.ls", {"url": url, "prefix": chosen,
                                      "entries": [_describe(k, v) for k, v in entries.items()]})
        return
    if not entries:
        out.info(f"no entries under {chosen!r} in {url}")
        return
    table = Table(title=f"{plural(len(entries), 'entry', 'entries')} under {chosen!r} in {url}",
                  title_justify="left")
    table.add_column("key", overflow="fold")
    table.add_column("size (B)", justify="right")
    table.add_column("value", overflow="ellipsis", no_wrap=True)
    for key, value in entries.items():
        shown = _describe(key, value)["value"]
        preview = "<binary>" if shown is None else shown.replace("\n", " ")
        if len(preview) > _PREVIEW_CHARS:
            preview = preview[:_PREVIEW_CHARS - 1] + "…"
        table.add_row(safe_cell(key), str(len(value)), safe_cell(preview))
    out.print(table)


@app.command("get")
def get(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The full key, e.g. kvctl/segments/host-a.",
                                       callback=_utf8)],
    metadata: MetadataOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Print the value of one key (text as is, binary values in base64).

    Exits 1 when the key is absent (or its lease expired).

    Example: kvctl metadata get kvctl/segments/host-a
    """
    opts = global_options(ctx)
    settings = opts.settings(MetadataSettings)
    common = shared_metadata(opts.settings(CommonSettings, metadata=metadata))
    with open_configured(common, settings) as client:
        value = client.get(key)
        url = client.url
    if value is None:
        raise NotFoundError(f"key {key!r} is not in {url} (absent, or its lease expired)",
                            "see what is published with: kvctl metadata ls")
    out = opts.output(json_mode=json_)
    described = _describe(key, value)
    if json_:
        out.emit_json("metadata.get", {"url": url, **described})
        return
    if described["value"] is None:
        out.warn(f"value of {key!r} is binary ({len(value)} bytes); printing it in base64")
        out.print(Text(described["value_base64"]))
    else:
        out.print(Text(described["value"]))
