"""``kvctl agent``: this host's cluster agent, in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

from typing import Annotated

import typer

from kvctl.commands._common import JsonOpt, global_options, stop_on_signal, wait_until
from kvctl.config import CommonSettings
from kvctl.errors import UsageError
from kvctl.units import format_size, parse_duration, parse_size


def agent(
    ctx: typer.Context,
    metadata: Annotated[str | None, typer.Option(
        "--metadata", "-m", help="Metadata URL shared by the cluster (etcd://, redis://, "
        "http://, file://); default KVCTL_METADATA.", show_default=False)] = None,
    hostname: Annotated[str | None, typer.Option(
        "--hostname", help="Name to register under (default: this host's name).",
        show_default=False)] = None,
    advertise: Annotated[str | None, typer.Option(
        "--advertise", help="Address peers reach this host at (default: the one that "
        "routes to the metadata service).", show_default=False)] = None,
    rail: Annotated[list[str] | None, typer.Option(
        "--rail", help="A NIC rail, NAME (a NIC or interface here, at its IPv4 address) or "
        "NAME=ADDRESS; repeat in rail order (default: every active NIC with an IPv4 "
        "address, in name order).", show_default=False)] = None,
    ttl: Annotated[str, typer.Option(
        "--ttl", help="Lease TTL: a dead agent vanishes within it.")] = "10s",
    poll: Annotated[str, typer.Option(
        "--poll", help="How often to look for jobs where the metadata service cannot push "
        "them (file://, http://; etcd pushes at once).")] = "0.5s",
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Serve Prometheus metrics on this port of every interface, "
        "on loopback only with a token (0 = any free; default: off).",
        show_default=False)] = None,
    metrics_listen: Annotated[str | None, typer.Option(
        "--metrics-listen", help="Serve Prometheus metrics on HOST:PORT instead (loopback "
        "only with a token).", show_default=False)] = None,
    max_buffer: Annotated[str, typer.Option(
        "--max-buffer", help="Most memory one job may ask for (a target, a bench).")] = "2GiB",
    json_out: JsonOpt = False,
) -> None:
    """Register this host in the cluster and serve the jobs kvctl cluster posts.

    Registers hostname, addresses, kvctl version, GPUs, NICs (rates, states), a topo
    doctor summary and the transports offered, under a lease: killed, the host vanishes
    within --ttl. Serves bench targets (sized per request, freed after), benches, the
    single-host runbook, store roles and key manifests on request. KVCTL_TOKEN signs
    everything it publishes and refuses unsigned jobs.

    Rails: kvctl cluster bench --per-rail benches rail i of each host against rail i of
    the others, binding both ends to the rails' addresses; --rail names them where the
    default (active NICs with an address, in name order) is not the fabric's order.

    Example: kvctl agent --metadata etcd://10.0.0.5:2379 --metrics-port 9470

    Example: kvctl agent --metadata etcd://10.0.0.5:2379 --rail eth1 --rail eth2
    """
    import msgspec

    from kvctl.cluster.agent import Agent
    from kvctl.cluster.facts import collect_facts
    from kvctl.cluster.jobs import default_handlers
    from kvctl.metadata import open_metadata
    from kvctl.metadata.base import service_host
    from kvctl.metrics import ServerMetrics
    from kvctl.net.advertise import join_host_port
    from kvctl.net.bind import is_unspecified, parse_listen

    opts = global_options(ctx)
    out = opts.output(json_mode=json_out)
    common = opts.settings(CommonSettings, metadata=metadata)
    url = common.metadata
    if url.startswith("memory://"):
        raise UsageError("an agent needs a metadata service the other hosts share, not "
                         f"{url}", "give --metadata etcd://HOST:2379 (or set KVCTL_METADATA)")
    ttl_s = parse_duration(ttl, what="--ttl")
    poll_s = parse_duration(poll, what="--poll")
    if not 0 < poll_s < ttl_s:
        raise UsageError(f"--poll {poll} is not between 0 and --ttl {ttl}",
                         "poll several times per TTL, e.g. --ttl 10s --poll 0.5s")
    limit = parse_size(max_buffer, what="--max-buffer")
    if metrics_port is not None and metrics_listen is not None:
        raise UsageError("--metrics-port and --metrics-listen both given",
                         "give one: --metrics-port 9470, or --metrics-listen HOST:9470")
    client = open_metadata(url, token=common.token)
    metrics = None
    metrics_url = None
    try:
        if metrics_listen is not None or metrics_port is not None:
            host, port = (parse_listen(metrics_listen, default_port=9470) if metrics_listen
                          else ("0.0.0.0", metrics_port or 0))
            metrics = ServerMetrics("kvctl_agent")
            host, bound = metrics.serve_for(host, port, token=common.token)
        record, topology = collect_facts(hostname=hostname, toward=service_host(url),
                                         advertise=advertise, lease_ttl_s=ttl_s,
                                         poll_s=poll_s, rails=rail or ())
        if metrics is not None:
            # A wildcard bind is reached at the address the agent registers.
            shown = record.address if is_unspecified(host) else host
            metrics_url = f"http://{join_host_port(shown, bound)}/metrics"
            record = msgspec.structs.replace(record, metrics=metrics_url)
        handlers = default_handlers(topology=topology, config_file=opts.config_file(),
                                    max_region_bytes=limit)
        with stop_on_signal() as stop:
            running = Agent(client, record, handlers=handlers, token=common.token,
                            cluster_id=common.cluster_id, metrics=metrics).start()
            try:
                rec = running.record
                if json_out:
                    out.emit_json("agent.record", {
                        "hostname": rec.hostname, "agent_id": rec.agent_id,
                        "metadata": url, "address": rec.address, "addresses": rec.addresses,
                        "rails": [{"index": r.index, "nic": r.nic, "address": r.address}
                                  for r in rec.rails],
                        "transports": rec.transports, "engines": rec.engines,
                        "jobs": rec.jobs, "lease_ttl_s": rec.lease_ttl_s,
                        "poll_s": rec.poll_s, "metrics": metrics_url,
                        "auth": common.token is not None})
                out.info(f"agent {rec.hostname} registered in {url} at {rec.address} "
                         f"(lease {ttl_s:g} s; {len(rec.nics)} NIC(s), {len(rec.gpus)} "
                         f"GPU(s); jobs up to {format_size(limit)}); Ctrl-C stops it")
                wait_until(stop)
            finally:
                running.close()
    finally:
        if metrics is not None:
            metrics.close()
        client.close()
    out.info("agent stopped: registration withdrawn")
