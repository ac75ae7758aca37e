"""``kvctl store``: run the embedded KV store, and put, get, inspect and validate objects."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from kvctl.commands._common import JsonOpt, global_options, stop_on_signal, wait_until
from kvctl.config import CommonSettings
from kvctl.errors import CheckFailedError, UsageError
from kvctl.output import Output, safe_cell
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import (
    EmbeddedStore,
    metrics_url,
    resolve_master,
    start_master,
    start_node,
)
from kvctl.store.errors import StoreUnavailableError
from kvctl.store.server import MasterServer
from kvctl.store.settings import StoreSettings
from kvctl.store.smoke import SmokeReport, run_kvctl, run_mooncake
from kvctl.store.standby import run_elected
from kvctl.store.state import elects_leader
from kvctl.units import format_size
from kvctl.wording import plural

app = typer.Typer(help="The embedded KV store: serve it, put/get objects, validate it.\n\n"
                  "Example: kvctl store serve & kvctl store smoke",
                  no_args_is_help=True)

BACKENDS = ("kvctl", "mooncake")

def _valid_key(key: str) -> str:
    bad = p.check_key(key)
    if bad is not None:
        raise UsageError(f"bad key: {bad.cause}", bad.hint or "give a printable UTF-8 key")
    return key


KeyArg = Annotated[str, typer.Argument(help="Object key.", callback=_valid_key)]
#: The most bytes 'store put' reads from a file or stdin (a KV object is far smaller).
MAX_PUT_BYTES = 2 << 30
MasterOpt = Annotated[str | None, typer.Option(
    "--master", "-m", show_default=False,
    help="Master HOST:PORT, several (A:PORT,B:PORT: elected masters, the leader is found) "
    "or etcd://HOST:2379[?cluster=ID] (the leader they name there); default: the local "
    "embedded store.")]
BackendOpt = Annotated[str, typer.Option(
    "--backend", help="Store to talk to: kvctl, or mooncake (a Mooncake master over TCP).")]
ListenOpt = Annotated[str | None, typer.Option(
    "--listen", show_default=False,
    help="Master HOST:PORT to listen on (default: 127.0.0.1:50051).")]
CapacityOpt = Annotated[str | None, typer.Option(
    "--capacity", show_default=False,
    help="DRAM the node contributes, e.g. 512MiB (default: 1 GiB or 1/8 of RAM).")]
SsdOpt = Annotated[Path | None, typer.Option(
    "--ssd", show_default=False, help="SSD tier directory (off when not given).")]
SsdPolicyOpt = Annotated[str | None, typer.Option(
    "--ssd-policy", show_default=False,
    help="write-through or write-back (default: write-through).")]
StateOpt = Annotated[str | None, typer.Option(
    "--state", show_default=False,
    help="Master state: none, a directory, or etcd://HOST:PORT (default: none).")]
TenantOpt = Annotated[list[str] | None, typer.Option(
    "--tenant", show_default=False,
    help="NAME=@FILE (repeatable; the file holds the token) or NAME=TOKEN: a client with "
    "TOKEN only reaches keys under NAME/ (needs KVCTL_TOKEN, which stays the admins' and "
    "nodes').")]


SharedTierOpt = Annotated[Path | None, typer.Option(
    "--shared-tier", show_default=False,
    help="Shared tier: a directory on a distributed file system (3FS, NFS, CephFS) every "
    "node and client mounts; DRAM evictions go there and any host reads them (off when "
    "not given).")]
SharedPolicyOpt = Annotated[str | None, typer.Option(
    "--shared-tier-policy", show_default=False,
    help="write-back (on DRAM eviction) or write-through (also soon after each put, off "
    "the put's path) (default: write-back).")]
SharedCapacityOpt = Annotated[str | None, typer.Option(
    "--shared-tier-capacity", show_default=False,
    help="Most bytes of files in the shared tier, e.g. 10TiB (default: 1 TiB); least "
    "recently used evicted past it.")]
SharedFilesOpt = Annotated[int | None, typer.Option(
    "--shared-tier-files", show_default=False,
    help="Most files in the shared tier (default: 10,000,000).")]
SharedPackOpt = Annotated[str | None, typer.Option(
    "--shared-tier-pack-below", show_default=False,
    help="Write shared-tier copies of objects smaller than this several to a file, e.g. "
    "256KiB (one fsync and one name per pack: pays below about 256 KiB, docs/store.md); "
    "0 (the default): a file per object.")]
SharedMapOpt = Annotated[str | None, typer.Option(
    "--shared-tier-map", show_default=False,
    help="Where this host mounts the master's shared tier when not at the master's path: "
    "MASTER_DIR=LOCAL_DIR (comma-separated).")]


def _warn_inline_tokens(out: Output, tenants: list[str] | None) -> None:
    """A token in argv is readable by every local user (/proc/PID/cmdline): say so."""
    from kvctl.store.tenants import inline_tenant_tokens

    names = inline_tenant_tokens(tenants or [])
    if names:
        out.warn(f"tenant token(s) of {', '.join(names)} given on the command line, where "
                 "every local user can read them (/proc/PID/cmdline); use --tenant NAME=@FILE "
                 "or KVCTL_STORE_TENANTS")
MetricsPortOpt = Annotated[int | None, typer.Option(
    "--metrics-port", show_default=False,
    help="Serve Prometheus metrics on this port of the listen host (0 = any free).")]


def _client(ctx: typer.Context, master: str | None, **flags: Any) -> StoreClient:
    opts = global_options(ctx)
    settings = opts.settings(StoreSettings, master=master, **flags)
    common = opts.settings(CommonSettings)
    return StoreClient(resolve_master(settings), token=common.token,
                       replicas=settings.replicas, transport=settings.transport,
                       shared_map=settings.shared_tier_map)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")


# ---------------------------------------------------------------- servers


@app.command()
def serve(
    ctx: typer.Context,
    listen: ListenOpt = None,
    capacity: CapacityOpt = None,
    ssd: SsdOpt = None,
    ssd_policy: SsdPolicyOpt = None,
    state: StateOpt = None,
    metrics_port: MetricsPortOpt = None,
    tenant: TenantOpt = None,
    shared_tier: SharedTierOpt = None,
    shared_tier_policy: SharedPolicyOpt = None,
    shared_tier_capacity: SharedCapacityOpt = None,
    shared_tier_files: SharedFilesOpt = None,
    shared_tier_pack_below: SharedPackOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run a master and one storage node in this process until SIGINT/SIGTERM.

    Clients on this host find it without --master (discovery file, else 127.0.0.1:50051).

    Shared tier: --shared-tier DIR (and --shared-tier-policy, -capacity, -files) as for
    'kvctl store master': evicted (or, write-through, just put) objects are kept as files
    there, read by clients directly. See docs/store.md, "Shared tier".

    Example: kvctl store serve --capacity 2GiB --ssd /mnt/nvme/kvctl
    Example: kvctl store serve --shared-tier /mnt/3fs/kvctl --shared-tier-policy write-through
    """
    opts = global_options(ctx)
    settings = opts.settings(StoreSettings, listen=listen, capacity=capacity, ssd=ssd,
                             ssd_policy=ssd_policy, state=state, metrics_port=metrics_port,
                             tenants=tenant or None, shared_tier=shared_tier,
                             shared_tier_policy=shared_tier_policy,
                             shared_tier_capacity=shared_tier_capacity,
                             shared_tier_files=shared_tier_files,
                             shared_tier_pack_below=shared_tier_pack_below)
    common = opts.settings(CommonSettings)
    out = opts.output(json_mode=json_)
    _warn_inline_tokens(out, tenant)
    with stop_on_signal() as stop, EmbeddedStore(settings, token=common.token,
                                                 write_discovery=True,
                                                 cluster_id=common.cluster_id) as store:
        if store.election is not None:
            store.election.on_deposed(lambda _why: stop.set())
        shared = store.server.core.status().shared  # the tier as the master resolved it
        payload = {"master": store.address, "node_id": store.node.node_id,
                   "capacity_bytes": store.node.capacity_bytes,
                   "ssd": store.node.ssd.directory if store.node.ssd else None,
                   "ssd_policy": store.node.ssd_policy, "state": settings.state,
                   "auth": common.token is not None,
                   "tenants": [t.name for t in store.server.tenants],
                   "metrics": metrics_url(store.server),
                   "shared_tier": shared.root if shared else None,
                   "shared_tier_policy": shared.policy if shared else None}
        if json_:
            out.emit_json("store.serve", payload)
        else:
            # A sentence, not a bare address: scripts read --json's store.serve document.
            ssd_text = f"SSD {store.node.ssd_policy} in {store.node.ssd.directory}" if (
                store.node.ssd) else "no SSD tier"
            shared_text = f", shared tier {shared.policy} in {shared.root}" if shared else ""
            out.line(Text(f"store up: master {store.address}, node {store.node.node_id} with "
                           f"{format_size(store.node.capacity_bytes)} DRAM, {ssd_text}"
                           f"{shared_text}; Ctrl-C stops it"))
            if payload["metrics"]:
                out.info(f"metrics on {payload['metrics']}")
        wait_until(stop)
        deposed = store.election.deposed if store.election is not None else None
    if deposed is not None:
        raise StoreUnavailableError(f"store serve deposed: {deposed}; it stopped serving",
                                    "another master leads the state now")
    out.info("store stopped")


@app.command()
def master(
    ctx: typer.Context,
    listen: ListenOpt = None,
    state: StateOpt = None,
    metrics_port: MetricsPortOpt = None,
    tenant: TenantOpt = None,
    shared_tier: SharedTierOpt = None,
    shared_tier_policy: SharedPolicyOpt = None,
    shared_tier_capacity: SharedCapacityOpt = None,
    shared_tier_files: SharedFilesOpt = None,
    shared_tier_pack_below: SharedPackOpt = None,
    node_grace: Annotated[str | None, typer.Option(
        "--node-grace", show_default=False,
        help="Heartbeat silence after which a suspect node is dropped with its objects' "
        "copies, e.g. 60s or 10m (default: 60 s; 'kvctl store node rm' drops one now).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Run a store master alone (nodes join with 'kvctl store node --master HOST:PORT').

    Tenants: --tenant NAME=@FILE (repeatable; FILE holds the token) confines a client with
    that token to keys under NAME/ (KVCTL_TOKEN stays the admins' and nodes').

    With --state etcd://..., masters started on several hosts elect one leader; the others
    stand by (refusing connections) and take over once its lease (store.ha_ttl, 5 s)
    expires. The address card is printed once this master leads.

    A node silent past the node timeout (3 s) is suspect: no new placements, reads go to
    other replicas, its objects are kept; past --node-grace it is dropped.

    Shared tier: --shared-tier DIR (a distributed file system every node and client
    mounts) keeps evicted objects as files any host reads directly; they outlive their
    node. See docs/store.md, "Shared tier".

    Example: kvctl store master --listen 127.0.0.1:50051 --state /var/lib/kvctl/master
    Example: kvctl store master --state /var/lib/kvctl/master --shared-tier /mnt/3fs/kvctl
    Example: kvctl store master --shared-tier /mnt/3fs/kvctl --shared-tier-pack-below 256KiB
    """
    opts = global_options(ctx)
    settings = opts.settings(StoreSettings, listen=listen, state=state,
                             metrics_port=metrics_port, tenants=tenant or None,
                             node_grace=node_grace, shared_tier=shared_tier,
                             shared_tier_policy=shared_tier_policy,
                             shared_tier_capacity=shared_tier_capacity,
                             shared_tier_files=shared_tier_files,
                             shared_tier_pack_below=shared_tier_pack_below)
    common = opts.settings(CommonSettings)
    out = opts.output(json_mode=json_)
    _warn_inline_tokens(out, tenant)

    def announce(server: MasterServer, term: int | None = None) -> None:
        shared = server.core.status().shared  # the tier as the master resolved it
        if json_:
            out.emit_json("store.master", {"master": server.address, "state": settings.state,
                                           "auth": common.token is not None,
                                           "tenants": [t.name for t in server.tenants],
                                           "metrics": metrics_url(server), "term": term,
                                           "shared_tier": shared.root if shared else None,
                                           "shared_tier_policy":
                                               shared.policy if shared else None})
        else:
            led = f", leader of term {term}" if term is not None else ""
            tier = f", shared tier {shared.policy} in {shared.root}" if shared else ""
            out.line(Text(f"store master up on {server.address} (state: "
                           f"{server.core.state.description}{led}{tier}); Ctrl-C stops it"))

    if elects_leader(settings.state):
        with stop_on_signal() as stop:
            deposed = run_elected(settings, token=common.token, cluster_id=common.cluster_id,
                                  stop=stop, on_leading=announce)
        if deposed is not None:
            raise StoreUnavailableError(
                f"store master deposed: {deposed}; it stopped serving",
                "another master leads now; start this one again to stand by")
        out.info("store master stopped")
        return
    with stop_on_signal() as stop, start_master(settings, token=common.token,
                                                cluster_id=common.cluster_id) as server:
        announce(server)
        wait_until(stop)
    out.info("store master stopped")


node_app = typer.Typer()  # its help is the node command's (the callback below)
app.add_typer(node_app, name="node")


@node_app.callback(invoke_without_command=True)
def node(
    ctx: typer.Context,
    master: MasterOpt = None,
    capacity: CapacityOpt = None,
    ssd: SsdOpt = None,
    ssd_policy: SsdPolicyOpt = None,
    node_id: Annotated[str | None, typer.Option("--node-id", show_default=False,
                                                help="Node name (default: the host's name and a "
                                                "random suffix).")] = None,
    node_listen: Annotated[str | None, typer.Option(
        "--node-listen", show_default=False,
        help="Data-path HOST:PORT (default: loopback for a master on loopback, else the "
        "address that reaches the master, any port).")] = None,
    advertise: Annotated[str | None, typer.Option(
        "--advertise", show_default=False,
        help="HOST clients reach the data path at (default: the listen address; the "
        "interface addresses for 0.0.0.0).")] = None,
    shared_tier_map: SharedMapOpt = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", show_default=False,
        help="Serve the node's Prometheus metrics on this port of its data-path host "
        "(loopback only with a token; 0 = any free).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Run a storage node for a master until SIGINT/SIGTERM.

    A node whose master is on another host listens on the address that reaches the master,
    and tells the master that address (never loopback). 'kvctl store node rm NAME' drops a
    node from the master.

    Example: kvctl store node --master 10.0.0.5:50051 --capacity 4GiB --ssd /mnt/nvme/kv
    """
    if ctx.invoked_subcommand is not None:
        return  # a subcommand (rm): this is not a node to run
    opts = global_options(ctx)
    settings = opts.settings(StoreSettings, master=master, capacity=capacity, ssd=ssd,
                             ssd_policy=ssd_policy, node_id=node_id, node_listen=node_listen,
                             advertise=advertise, metrics_port=metrics_port,
                             shared_tier_map=shared_tier_map)
    common = opts.settings(CommonSettings)
    out = opts.output(json_mode=json_)
    address = resolve_master(settings)
    with stop_on_signal() as stop, start_node(settings, address,
                                              token=common.token) as running:
        if json_:
            out.emit_json("store.node", {"master": address, "node_id": running.node_id,
                                         "endpoint": running.endpoint,
                                         "capacity_bytes": running.capacity_bytes,
                                         "ssd_policy": running.ssd_policy,
                                         "metrics_port": running.metrics_port})
        else:
            out.line(Text(f"node {running.node_id} serving "
                           f"{format_size(running.capacity_bytes)} at {running.endpoint} for "
                           f"master {address}; Ctrl-C stops it"))
        wait_until(stop)
    out.info("store node stopped")


@node_app.command("rm")
def node_rm(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Node id, as 'kvctl store status' shows it.")],
    master: MasterOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Drop a storage node from the master now, with its objects' copies on it (as when a
    suspect node's grace ends). Objects with no copy left are lost; a node still running
    registers again with new memory. Needs the shared token (not a tenant's).

    Example: kvctl store node rm n3 --master 10.0.0.5:50051
    """
    with _client(ctx, master) as client:
        before = {n.node_id: n for n in client.status().nodes}
        client.drop_node(name)
    out = global_options(ctx).output(json_mode=json_)
    objects = before[name].objects if name in before else 0
    if json_:
        out.emit_json("store.node.rm", {"node_id": name, "dropped": True,
                                        "objects_with_a_copy": objects})
    else:
        out.info(f"node {name} dropped ({objects} object(s) had a copy on it; see "
                 "'kvctl store status' for what was lost)")


# ---------------------------------------------------------------- objects


@app.command()
def put(
    ctx: typer.Context,
    key: KeyArg,
    file: Annotated[str, typer.Argument(help="File to store, or - for stdin.")],
    master: MasterOpt = None,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", show_default=False, help="Copies on distinct nodes (default: 1).")] = None,
    backend: BackendOpt = "kvctl",
    json_: JsonOpt = False,
) -> None:
    """Store the bytes of FILE (or stdin) under KEY.

    Example: kvctl store put model/block-0 ./block.bin
    """
    _check_backend(backend)
    data = _read_input(file)
    out = global_options(ctx).output(json_mode=json_)
    if backend == "mooncake":
        _mooncake(ctx, master, lambda s: s.put(key, data))
    else:
        with _client(ctx, master, replicas=replicas) as client:
            client.put(key, data)
    if json_:
        out.emit_json("store.put", {"key": key, "size_bytes": len(data), "backend": backend})
    else:
        out.info(f"stored {key!r} ({format_size(len(data))})")


def _read_input(file: str) -> bytes:
    """The bytes of FILE (or stdin), at most :data:`MAX_PUT_BYTES` (``/dev/zero`` ends)."""
    try:
        with contextlib.ExitStack() as stack:
            stream = (sys.stdin.buffer if file == "-"
                      else stack.enter_context(Path(file).open("rb")))
            data = stream.read(MAX_PUT_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror or exc}",
                         "give a readable file, or - to read stdin") from None
    if len(data) > MAX_PUT_BYTES:
        raise UsageError(f"{file} holds more than {format_size(MAX_PUT_BYTES)}",
                         "store KV blocks (kilobytes to megabytes), not whole devices")
    return data


def _mooncake(ctx: typer.Context, master: str | None, fn: Any) -> Any:
    from kvctl.store.mooncake import MooncakeStore

    settings = global_options(ctx).settings(StoreSettings, master=master)
    if not settings.master:
        raise UsageError("--backend mooncake needs --master HOST:PORT of a mooncake_master",
                         "start one (mooncake_master --rpc_port=50051) and pass its address")
    # Contribute no memory: objects must land in the cluster's storage, not in this process.
    with MooncakeStore(settings.master, global_segment_bytes=0) as store:
        return fn(store)


@app.command()
def get(
    ctx: typer.Context,
    key: KeyArg,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", show_default=False, help="Write here (default: stdout).")] = None,
    master: MasterOpt = None,
    backend: BackendOpt = "kvctl",
    json_: JsonOpt = False,
) -> None:
    """Fetch KEY (checksum-verified) to a file or stdout. Exits 1 when KEY is absent.

    Example: kvctl store get model/block-0 -o block.bin
    """
    _check_backend(backend)
    if json_ and output is None:
        raise UsageError("--json prints metadata, so the bytes need --output FILE",
                         "add -o FILE (or drop --json to write the bytes to stdout)")
    if backend == "mooncake":
        data: bytes = _mooncake(ctx, master, lambda s: s.get(key))
    else:
        with _client(ctx, master) as client:
            data = client.get(key)
    out = global_options(ctx).output(json_mode=json_)
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    _write_atomically(output, data)
    if json_:
        out.emit_json("store.get", {"key": key, "size_bytes": len(data), "output": output,
                                    "backend": backend})
    else:
        out.info(f"wrote {format_size(len(data))} of {key!r} to {output}")


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``: a
    full disk or a crash leaves the old file as it was."""
    tmp = path.with_name(f".{path.name}.kvctl-{os.getpid()}.tmp")
    try:
        with tmp.open("xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}",
                         "pick a writable --output path with room for the object; the old "
                         "file (if any) is unchanged") from None


def _info_row(info: p.ObjectInfo) -> dict[str, Any]:
    return {"key": info.key, "size_bytes": info.size, "checksum": f"{info.checksum:016x}",
            "tier": info.tier, "replicas": info.replicas, "ssd_replicas": info.ssd_replicas,
            "pinned": info.pinned, "lease_remaining_s": info.lease_remaining_s,
            "age_s": info.age_s, "version": info.version}


@app.command("ls")
def ls(
    ctx: typer.Context,
    prefix: Annotated[str, typer.Argument(help="Key prefix.")] = "",
    master: MasterOpt = None,
    limit: Annotated[int, typer.Option("--limit", help="Most objects to list.")] = 1000,
    json_: JsonOpt = False,
) -> None:
    """List objects whose keys start with PREFIX.

    Example: kvctl store ls model/
    """
    if limit < 0:
        raise UsageError(f"--limit {limit} is negative", "give 0 or more")
    with _client(ctx, master) as client:
        objects, truncated = client.list(prefix, limit=limit)
    out = global_options(ctx).output(json_mode=json_)
    if json_:
        out.emit_json("store.ls", {"prefix": prefix, "truncated": truncated,
                                   "objects": [_info_row(o) for o in objects]})
        return
    if not objects:
        out.info(f"no objects under {prefix!r}")
        return
    table = Table(title=f"{plural(len(objects), 'object')} under {prefix!r}"
                  + (" (truncated)" if truncated else ""), title_justify="left")
    for col in ("key", "size", "tier", "replicas"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for o in objects:
        table.add_row(safe_cell(o.key), format_size(o.size), o.tier,
                      safe_cell(", ".join(o.replicas)))
    out.print(table)


@app.command()
def stat(
    ctx: typer.Context,
    key: KeyArg,
    master: MasterOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show an object's size, checksum, tier, replicas, lease and pin. Exits 1 when absent.

    Example: kvctl store stat model/block-0
    """
    with _client(ctx, master) as client:
        info = client.stat(key)
    out = global_options(ctx).output(json_mode=json_)
    row = _info_row(info)
    if json_:
        out.emit_json("store.stat", row)
        return
    table = Table(show_header=False, title=key, title_justify="left")
    table.add_column("field")
    table.add_column("value")
    for name, value in row.items():
        table.add_row(name, Text(str(value)))
    out.print(table)


@app.command("rm")
def rm(
    ctx: typer.Context,
    key: KeyArg,
    master: MasterOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove an object. Exits 1 when it was not there.

    Example: kvctl store rm model/block-0
    """
    from kvctl.store.errors import ObjectNotFoundError

    with _client(ctx, master) as client:
        existed = client.remove(key)
    if not existed:
        raise ObjectNotFoundError(key)
    out = global_options(ctx).output(json_mode=json_)
    if json_:
        out.emit_json("store.rm", {"key": key, "removed": True})
    else:
        out.info(f"removed {key!r}")


MooncakeMetricsOpt = Annotated[str | None, typer.Option(
    "--metrics", show_default=False,
    help="--backend mooncake: mooncake_master's HTTP metrics HOST:PORT or URL "
    "(default: the master's host, port 9003).")]


@app.command()
def status(
    ctx: typer.Context,
    master: MasterOpt = None,
    backend: BackendOpt = "kvctl",
    metrics: MooncakeMetricsOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show nodes, capacity, usage, evictions and objects per tier, each node's state
    (alive; suspect: silent past the node timeout, objects kept; restored: from the
    master's state, not registered again yet; dropped, lately, with why) and when it was
    last seen, and its SSD state (ok, full: offload paused while DRAM keeps serving, or
    off).

    With --backend mooncake: the mooncake_master's health, mounted segments, capacity and
    usage, read from its HTTP endpoint (--metrics).

    Example: kvctl store status --master 10.0.0.5:50051
    """
    _check_backend(backend)
    if backend == "mooncake":
        _mooncake_status(ctx, master, metrics, json_)
        return
    with _client(ctx, master) as client:
        st = client.status()
        address = client.leader
    out = global_options(ctx).output(json_mode=json_)
    if json_:
        out.emit_json("store.status", {"backend": "kvctl", "master": address,
                                       **_status_dict(st)})
        return
    out.print(status_headline(address, st))
    table = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "DRAM used", "objects", "SSD", "SSD used", "SSD state",
                "endpoint", "last seen"):
        table.add_column(col, overflow="fold")  # a narrow terminal wraps, never cuts
    for n in st.nodes:
        state = n.state or ("alive" if n.alive else "down")
        table.add_row(safe_cell(n.node_id), Text(state, style="" if state == "alive" else
                                            "bold red" if state == "dropped" else "yellow"),
                      f"{format_size(n.used_bytes)} / {format_size(n.capacity_bytes)}",
                      str(n.objects), n.ssd_policy,
                      f"{format_size(n.ssd_used_bytes)} / {format_size(n.ssd_capacity_bytes)}"
                      if n.ssd_policy != "off" else "-",
                      Text(n.ssd_state, style="bold red" if n.ssd_state == "full" else ""),
                      safe_cell(n.endpoint), f"{n.last_heartbeat_s:.1f} s ago")
    for n in st.dropped:
        table.add_row(safe_cell(n.node_id), Text("dropped", style="bold red"), "-", "-", "-",
                      "-", "-", safe_cell(n.dropped_why), f"{n.last_heartbeat_s:.1f} s ago")
    out.print(table)
    for n in st.nodes:
        if n.state == "suspect":
            out.print(Text(f"node {n.node_id}: suspect (silent {n.last_heartbeat_s:.1f} s): "
                           "no new placements, reads go to other replicas, its objects are "
                           "kept until its grace ends ('kvctl store node rm "
                           f"{n.node_id}' drops it now)", style="yellow"))
        if n.ssd_state == "full":
            out.print(Text(f"node {n.node_id}: SSD tier full, offload paused, DRAM serving: "
                           f"{n.ssd_error}", style="yellow"))
    if st.shared is not None:
        _print_shared(out, st.shared)


def status_headline(address: str, st: p.StoreStatus) -> str:
    """The first line of 'store status': every total the sum of the parts it names.

    The objects split by tier (``shared``: only in the shared tier); the DRAM of every node
    the table lists, alive nodes' and the others' (suspect, restored) apart; the objects
    unreadable now (every copy on a node that is not alive: kept until its grace ends)
    apart from those lost (forgotten)."""
    reserved = (f", {format_size(st.reserved_bytes)} of it reserved by clients for puts"
                if st.reserved_bytes else "")
    alive = [n for n in st.nodes if n.alive]
    others = [n for n in st.nodes if not n.alive]
    dram = (f"DRAM {format_size(st.used_bytes)} of {format_size(st.capacity_bytes)} used on "
            f"{plural(len(alive), 'alive node')}{reserved}")
    if others:
        states = "/".join(sorted({n.state or "down" for n in others}))
        dram += (f" + {format_size(sum(n.used_bytes for n in others))} of "
                 f"{format_size(sum(n.capacity_bytes for n in others))} on "
                 f"{plural(len(others), f'{states} node')} (no placements)")
    tiers = ", ".join(f"{k} {v}" for k, v in st.tiers.items())
    return (f"master {address}: {plural(st.objects, 'object')} (tiers {tiers}), "
            f"{st.unreadable} unreadable now (every copy on a node not alive: lost unless "
            f"it comes back), {st.lost} lost; {dram}; {plural(st.evictions, 'eviction')} "
            f"({st.ssd_evictions} from SSD); state {st.state}")


def _print_shared(out: Output, sh: p.SharedTierStatus) -> None:
    """The shared tier's line of 'store status' (and its errors, when there were any)."""
    fs = (f"; file system {format_size(sh.fs_free_bytes)} free of "
          f"{format_size(sh.fs_total_bytes)}" if sh.fs_total_bytes >= 0 else "")
    out.print(Text(f"shared tier {sh.root} ({sh.policy}, {sh.state}): "
                   f"{format_size(sh.used_bytes)} of {format_size(sh.capacity_bytes)} in "
                   f"{sh.files} of {sh.max_files} files, {sh.writes} written "
                   f"({sh.write_errors} failed), {sh.evictions} evicted, {sh.purged} purged, "
                   f"purge backlog {sh.purge_backlog}{fs}"
                   + (f"; {sh.packed_objects} objects in {sh.packs} packs (below "
                      f"{format_size(sh.pack_below)})" if sh.pack_below else ""),
                   style="bold red" if sh.state == "full" else ""))
    failed = {k: v for k, v in sh.errors.items() if v}
    if failed:
        out.print(Text("shared tier errors: " + ", ".join(f"{k} {v}" for k, v in
                                                          failed.items())
                       + (f"; last: {sh.last_error}" if sh.last_error else ""),
                       style="yellow"))


def _mooncake_status(ctx: typer.Context, master: str | None, metrics: str | None,
                     json_: bool) -> None:
    from kvctl.store.mooncake import probe_master
    from kvctl.store.mooncake_http import (
        default_metrics_url,
        normalize_metrics_url,
        read_master_status,
    )

    settings = global_options(ctx).settings(StoreSettings, master=master)
    if not settings.master:
        raise UsageError("--backend mooncake needs --master HOST:PORT of a mooncake_master",
                         "pass its RPC address, e.g. --master 10.0.0.1:50051")
    address = settings.master
    probe_master(address)  # a kvctl master or a dead port is named before HTTP is tried
    url = normalize_metrics_url(metrics) if metrics else default_metrics_url(address)
    st = read_master_status(address, url)
    out = global_options(ctx).output(json_mode=json_)
    if json_:
        out.emit_json("store.status", {"backend": "mooncake", **dataclasses.asdict(st)})
        return
    healthy = st.health == "ok" and st.service_ready
    out.print(Text(f"mooncake_master {address}: {st.health} ({st.role}, {st.ha_state}); "
                   f"{plural(len(st.segments), 'segment')}, {format_size(st.used_bytes)} of "
                   f"{format_size(st.capacity_bytes)} used, {plural(st.keys, 'key')}, {st.clients} "
                   f"clients (from {st.metrics_url})",
                   style="" if healthy else "bold red"))
    table = Table(title="segments", title_justify="left")
    for col in ("segment", "status", "used", "capacity", "use", "protocol", "endpoint"):
        table.add_column(col, justify="right" if col in ("used", "capacity", "use") else "left")
    for seg in st.segments:
        use = f"{seg.used_bytes / seg.capacity_bytes:.0%}" if seg.capacity_bytes else "-"
        table.add_row(safe_cell(seg.name), safe_cell(seg.status), format_size(seg.used_bytes),
                      format_size(seg.capacity_bytes), use, safe_cell(seg.protocol),
                      safe_cell(seg.endpoint))
    out.print(table)
    if not st.segments or st.capacity_bytes <= 0:
        out.warn(f"the master at {address} has no storage mounted: start a mooncake storage "
                 "process / client with global_segment_size > 0")


def _plain(obj: Any) -> Any:
    """Structs (encoded as arrays on the wire) as JSON-ready mappings."""
    fields = getattr(obj, "__struct_fields__", None)
    if fields is not None:
        return {f: _plain(getattr(obj, f)) for f in fields}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _status_dict(st: p.StoreStatus) -> dict[str, Any]:
    out: dict[str, Any] = _plain(st)
    return out


# ---------------------------------------------------------------- top


@app.command()
def top(
    ctx: typer.Context,
    master: MasterOpt = None,
    backend: BackendOpt = "kvctl",
    metrics: Annotated[str | None, typer.Option(
        "--metrics", show_default=False,
        help="Metrics HOST:PORT or URL. kvctl: the master's --metrics-port (default: the "
        "one a local 'kvctl store serve' published); mooncake: mooncake_master's HTTP "
        "port (default: the master's host, port 9003).")] = None,
    interval: Annotated[str, typer.Option(
        "--interval", help="Time between refreshes, and what rates are measured over.")
    ] = "1s",
    once: Annotated[bool, typer.Option(
        "--once", help="Print one view (rates over one --interval) and exit.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Watch a store live: nodes, capacity and usage per tier, hit/miss/eviction rates,
    ops/s and p99 per operation, recent errors. q or Ctrl-C quits.

    kvctl: status over the store protocol, rates from the master's metrics endpoint (start
    it with --metrics-port). mooncake: mooncake_master's /health, /get_segments_detail and
    /metrics (Mooncake exports no latency histogram: no p99). --json implies --once.

    Example: kvctl store top --master 10.0.0.5:50051 --metrics 10.0.0.5:9101
    """
    from kvctl.commands._top_screen import LIVE_NODES, render, watch
    from kvctl.top.session import TopSession, read_once
    from kvctl.top.sources import KvctlSource, MooncakeSource, Source
    from kvctl.units import parse_duration

    _check_backend(backend)
    interval_s = parse_duration(interval, what="--interval")
    if not 0.1 <= interval_s <= 3600:
        raise UsageError(f"--interval {interval} is not between 0.1 s and 1 h",
                         "use e.g. --interval 1s (rates are measured over it)")
    once = once or json_
    if not once and not sys.stdout.isatty():
        raise UsageError("the live view of 'store top' needs a terminal, and stdout is not one",
                         "for scripts use --once --json (or --once for one table)")
    opts = global_options(ctx)
    settings = opts.settings(StoreSettings, master=master)
    source: Source
    if backend == "mooncake":
        if not settings.master:
            raise UsageError("--backend mooncake needs --master HOST:PORT of a mooncake_master",
                             "pass its RPC address, e.g. --master 10.0.0.1:50051")
        from kvctl.store.mooncake import probe_master

        probe_master(settings.master)  # a kvctl master or a dead port is named first
        source = MooncakeSource(settings.master, metrics=metrics)
    else:
        from kvctl.store.embedded import discovered_metrics

        address = resolve_master(settings)
        source = KvctlSource(address, token=opts.settings(CommonSettings).token,
                             metrics=metrics or discovered_metrics(address))
    out = opts.output(json_mode=json_)
    try:
        if once:
            with stop_on_signal() as stop:
                view = read_once(source, interval_s, stop=stop)
            if json_:
                out.emit_json("store.top", view.to_json())
            else:
                out.print(render(view))
            return
        session = TopSession(source)
        view, problem = session.next()  # a wrong address fails here, before the screen

        def frame() -> Any:
            shown, stale = session.next()
            return render(shown, problem=stale, max_nodes=LIVE_NODES)

        with stop_on_signal() as stop:
            watch(render(view, problem=problem, max_nodes=LIVE_NODES), frame,
                  interval_s=interval_s,
                  console=out.console, stop=stop)
    finally:
        source.close()


# ---------------------------------------------------------------- smoke


@app.command()
def smoke(
    ctx: typer.Context,
    master: MasterOpt = None,
    backend: BackendOpt = "kvctl",
    metrics: MooncakeMetricsOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Validate a store end to end; exits 1 naming each failed check.

    Checks: sizes 4 KiB to 16 MiB, batches, concurrent clients, exists/remove, replica
    failover, eviction under pressure, SSD round trip, shared tier (the node that wrote an
    object is killed, a new client reads it); contents verified byte for byte.

    Without --master it starts its own store (kvctl: master + 2 nodes, one with SSD;
    mooncake: a mooncake_master and a storage process on loopback).

    Mooncake against --master: client-only (it mounts no segment into the pool); fails at
    once when the master's HTTP endpoint (--metrics) reports no storage; removes every key
    it wrote; names the segments that held its objects.

    Example: kvctl store smoke --master 10.0.0.5:50051 --json
    """
    _check_backend(backend)
    opts = global_options(ctx)
    settings = opts.settings(StoreSettings, master=master)
    common = opts.settings(CommonSettings)
    out = opts.output(json_mode=json_)
    with out.progress("store smoke", total=11 if backend == "mooncake" else 9) as bar:
        def step(name: str) -> None:
            bar.update(bar.task_ids[0], advance=1, description=f"store smoke: {name}")
            out.debug(f"check {name}")

        if backend == "mooncake":
            report = run_mooncake(settings.master or None, metrics_url=metrics,
                                  progress=step)
        else:
            report = run_kvctl(settings.master or None, token=common.token, progress=step,
                               transport=settings.transport)
    _render_smoke(out, report, json_)
    if report.failed:
        names = ", ".join(c.name for c in report.failed)
        first = report.failed[0]
        raise CheckFailedError(f"store smoke ({report.backend}): failed {names}: "
                               f"{first.detail}", "see the table above; rerun with -v")


def _render_smoke(out: Output, report: SmokeReport, json_: bool) -> None:
    if json_:
        out.emit_json("store.smoke", {"backend": report.backend, "target": report.target,
                                      "ok": not report.failed, "checks": report.checks,
                                      "segments": report.segments,
                                      "metrics_url": report.metrics_url})
        return
    table = Table(title=f"store smoke: {report.backend} ({report.target})",
                  title_justify="left")
    for col in ("check", "result", "time", "detail"):
        table.add_column(col)
    styles = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for c in report.checks:
        table.add_row(c.name, Text(c.status, style=styles[c.status]),
                      f"{c.duration_s:.2f} s", Text(c.detail))
    out.print(table)
    if report.segments:
        seg_table = Table(title="segments that held the smoke's objects (all removed)",
                          title_justify="left")
        for col in ("segment", "endpoint", "objects"):
            seg_table.add_column(col, justify="right" if col == "objects" else "left")
        for seg in report.segments:
            seg_table.add_row(safe_cell(seg.name), safe_cell(seg.endpoint), str(seg.objects))
        out.print(seg_table)
