"""``kvctl cluster runbook``: every host's own runbook, the fabric, the store and the keys,
through the agents, as one verdict table per host and for the cluster.

Phases, each bounded, each reported even when one before it failed:

1. **host**: the single-host runbook (or the one given) on every host at once, through its
   agent; each of its checks becomes a row of that host.
2. **transfer**: :func:`~kvctl.cluster.bench.run_cluster_bench` over the hosts; a host's row
   fails when it is a culprit of the diagnosis, one of its pairs failed, or it went missing.
3. **store**: a store master on the first host, a storage node on every host, a client on
   every host writing its own objects, then every client reading every other host's
   objects byte for byte; the master's view of the nodes, and each node's process checked
   at the end (a node that died is named with how it died).
4. **keys**: every host computes block keys for the same prompts with the same profile;
   the manifests are compared (:func:`kvctl.keys.compare.compare`) against the first host's.

A host whose agent vanishes fails its remaining rows ("agent vanished"). The run passes when
no row fails; ``kvctl cluster runbook`` then exits 0, else 1, as ``kvctl runbook`` does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvctl.cluster.bench import ClusterBenchOptions, ClusterBenchReport, run_cluster_bench
from kvctl.cluster.coordinator import WAIT_FINAL, WAIT_READY, Coordinator, JobRef
from kvctl.cluster.protocol import (
    DONE,
    KEYS,
    READY,
    RUNBOOK,
    STORE_CLIENT,
    STORE_MASTER,
    STORE_NODE,
    KeysParams,
    RunbookParams,
    RunbookResult,
    StoreClientParams,
    StoreClientResult,
    StoreMasterParams,
    StoreMasterReady,
    StoreNodeParams,
    StoreNodeReady,
)
from kvctl.cluster.registry import HostEntry
from kvctl.errors import KvctlError, UsageError
from kvctl.runbook.model import Verdict
from kvctl.wording import plural

_log = logging.getLogger("kvctl.cluster")

#: Rows that concern the cluster as a whole, not one host.
CLUSTER = "cluster"


@dataclasses.dataclass(frozen=True)
class ClusterCheck:
    """One row of the verdict table.

    Attributes:
        host: the host it is about, or :data:`CLUSTER`.
        check: what was checked (``host: topo doctor: findings``, ``store: node``...).
        verdict: pass, fail or skip.
        measured: what was found, for people.
        hint: how to fix a failure.
    """

    host: str
    check: str
    verdict: Verdict
    measured: str = ""
    hint: str | None = None


@dataclasses.dataclass(frozen=True)
class ClusterRunbookOptions:
    """What the cluster runbook runs.

    Attributes:
        host_runbook: YAML text of the per-host runbook (``None``: the built-in single-host).
        host_runbook_name: its name, for the rows.
        bench: the cross-host matrix (``None``: skipped).
        store: run the store phase.
        store_capacity_bytes / store_objects / store_object_bytes / store_replicas: its size.
        keys_profile: the key profile every host computes (``None``: skip the keys phase).
        prompts_jsonl: the prompts (``None``: :func:`builtin_prompts`).
        phase_timeout_s: longest a phase may take.
    """

    host_runbook: str | None = None
    host_runbook_name: str = "single-host"
    bench: ClusterBenchOptions | None = None
    store: bool = True
    store_capacity_bytes: int = 64 << 20
    store_objects: int = 8
    store_object_bytes: int = 256 << 10
    store_replicas: int = 2
    keys_profile: str | None = "kvctl:sha256"
    prompts_jsonl: str | None = None
    phase_timeout_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class ClusterRunbookReport:
    """The verdict table and what it came from.

    Attributes:
        hosts: hosts checked, in order.
        rows: every check, host by host and phase by phase, then the cluster's rows.
        bench: the transfer phase's report, if it ran.
        passed: no row failed.
        duration_s: wall time, seconds.
    """

    hosts: tuple[str, ...]
    rows: tuple[ClusterCheck, ...]
    bench: ClusterBenchReport | None
    passed: bool
    duration_s: float

    def failed(self) -> list[ClusterCheck]:
        """The failed rows."""
        return [r for r in self.rows if r.verdict is Verdict.FAIL]


def builtin_prompts(count: int = 4, tokens: int = 96, seed: int = 17) -> str:
    """A small, fixed prompts file (JSON lines of token ids) every host hashes alike."""
    rng = random.Random(seed)
    lines = [json.dumps({"id": f"cluster-{i}", "tokens": [rng.randrange(1, 150_000)
                                                           for _ in range(tokens)]})
             for i in range(count)]
    return "\n".join(lines) + "\n"


class _Phase:
    """Rows collected per host, and a host's agent vanishing noted once."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.rows: list[ClusterCheck] = []
        self.gone: set[str] = set()

    def add(self, host: str, check: str, verdict: Verdict, measured: str = "",
            hint: str | None = None) -> None:
        self.rows.append(ClusterCheck(host, check, verdict, measured, hint))

    def job_failed(self, ref: JobRef, check: str) -> None:
        if ref.missing_at is not None:
            self.gone.add(ref.host)
            self.add(ref.host, check, Verdict.FAIL, "agent vanished (its lease expired)",
                     "check the host and restart kvctl agent there")
        else:
            status = ref.status
            self.add(ref.host, check, Verdict.FAIL, ref.error() or "no result",
                     status.hint if status is not None else "see the agent's log")

    def live(self) -> list[str]:
        return [h for h in self.hosts if h not in self.gone]


def run_cluster_runbook(coordinator: Coordinator, entries: Sequence[HostEntry],
                        options: ClusterRunbookOptions, *,
                        progress: Callable[[str], None] | None = None,
                        stop: threading.Event | None = None) -> ClusterRunbookReport:
    """Run every phase over the usable hosts in ``entries`` (see the module docstring).

    Raises:
        UsageError: no usable host is registered.
        AuthError: the agents refuse this client's jobs.
    """
    t0 = time.monotonic()
    notify = progress or (lambda _m: None)
    usable = [e.name for e in entries if e.usable]
    if options.bench is not None and options.bench.hosts:
        usable = [h for h in usable if h in options.bench.hosts]
    if not usable:
        raise UsageError("no usable host is registered",
                         "start kvctl agent on every host, then kvctl cluster ls")
    phase = _Phase(usable)
    for entry in entries:
        if not entry.usable:
            phase.add(entry.name, "registration", Verdict.FAIL,
                      entry.problem or "record unreadable",
                      "set the same KVCTL_TOKEN and kvctl version on every host")
    notify("host runbooks")
    _host_runbooks(coordinator, phase, options, stop)
    bench: ClusterBenchReport | None = None
    if options.bench is not None and len(phase.live()) >= 2:
        notify("transfer matrix")
        bench = run_cluster_bench(
            coordinator, [e for e in entries if e.name in phase.live()],
            dataclasses.replace(options.bench, hosts=tuple(phase.live())),
            on_event=lambda e: notify(f"transfer: {e.message}"), stop=stop)
        _bench_rows(phase, bench)
    elif options.bench is not None:
        phase.add(CLUSTER, "transfer matrix", Verdict.SKIP, "fewer than two live hosts")
    if options.store and phase.live():
        notify("store smoke")
        _store(coordinator, phase, options, stop)
    if options.keys_profile is not None and phase.live():
        notify("keys")
        _keys(coordinator, phase, options, stop)
    rows = sorted(phase.rows, key=lambda r: (r.host == CLUSTER, _host_order(phase, r.host)))
    passed = not any(r.verdict is Verdict.FAIL for r in rows)
    return ClusterRunbookReport(tuple(usable), tuple(rows), bench, passed,
                                time.monotonic() - t0)


def _host_order(phase: _Phase, host: str) -> int:
    return phase.hosts.index(host) if host in phase.hosts else len(phase.hosts)


def _host_runbooks(c: Coordinator, phase: _Phase, options: ClusterRunbookOptions,
                   stop: threading.Event | None) -> None:
    params = RunbookParams(yaml=options.host_runbook, name=options.host_runbook_name)
    refs = [c.submit(h, RUNBOOK, params, hold_s=options.phase_timeout_s) for h in phase.live()]
    try:
        c.wait(refs, want=WAIT_FINAL, timeout_s=options.phase_timeout_s, stop=stop)
        for ref in refs:
            if ref.state != DONE or ref.status is None:
                phase.job_failed(ref, f"runbook {options.host_runbook_name}")
                continue
            result = ref.status.result_as(RunbookResult)
            for row in result.results:
                phase.add(ref.host, f"runbook: {row.check}", Verdict(row.verdict),
                          row.measured, row.hint)
    finally:
        c.cancel(refs)


def _bench_rows(phase: _Phase, bench: ClusterBenchReport) -> None:
    culprits = {c.subject.host: c for c in bench.diagnosis.culprits}
    missing = {m.host for m in bench.missing}
    phase.gone |= missing
    for host in bench.hosts:
        mine = [o for o in bench.outcomes if host in (o.a.host, o.b.host)]
        failed = [o for o in mine if o.state == "failed"]
        values = sorted(o.gbps for o in mine if o.gbps is not None)
        median = values[len(values) // 2] if values else None
        measured = (f"{len(values)} pair(s) verified, median {median:.3g} GB/s"
                    if median is not None else "no pair measured")
        if host in missing:
            phase.add(host, "transfer matrix", Verdict.FAIL, "agent vanished during the bench",
                      "check the host and restart kvctl agent there")
        elif host in culprits:
            c = culprits[host]
            phase.add(host, "transfer matrix", Verdict.FAIL,
                      f"likely culprit: {c.slow_pairs} of {c.measured_pairs} pairs below "
                      f"{bench.diagnosis.slow_fraction:.0%} of the cluster median, "
                      f"median {c.median_gbps or 0.0:.3g} GB/s",
                      f"check {c.subject.label()}: kvctl topo doctor there, its link and cable")
        elif failed:
            phase.add(host, "transfer matrix", Verdict.FAIL,
                      f"{len(failed)} pair(s) failed: {failed[0].error}",
                      "rerun 'kvctl cluster bench -v' for each pair's errors")
        else:
            phase.add(host, "transfer matrix", Verdict.PASS, measured)
    d = bench.diagnosis
    bad = bool(d.slow) or bool(bench.failed) or bool(bench.missing)
    phase.add(CLUSTER, "transfer matrix", Verdict.FAIL if bad else Verdict.PASS, d.summary(),
              d.note)


def _store(c: Coordinator, phase: _Phase, options: ClusterRunbookOptions,
           stop: threading.Event | None) -> None:
    timeout = min(options.phase_timeout_s, 120.0)
    hosts = phase.live()
    refs: list[JobRef] = []
    try:
        master_ref = c.submit(hosts[0], STORE_MASTER, StoreMasterParams(),
                              hold_s=options.phase_timeout_s)
        refs.append(master_ref)
        c.wait([master_ref], want=WAIT_READY, timeout_s=timeout, stop=stop)
        if master_ref.state != READY or master_ref.status is None:
            phase.job_failed(master_ref, "store: master")
            return
        master = master_ref.status.result_as(StoreMasterReady).master
        phase.add(hosts[0], "store: master", Verdict.PASS, f"serving at {master}")
        nodes = {h: c.submit(h, STORE_NODE, StoreNodeParams(
            master=master, capacity_bytes=options.store_capacity_bytes, node_id=h),
            hold_s=options.phase_timeout_s) for h in hosts}
        refs.extend(nodes.values())
        c.wait(list(nodes.values()), want=WAIT_READY, timeout_s=timeout, stop=stop)
        replicas = max(1, min(options.store_replicas, len(hosts)))
        run = f"kvctl-cluster-smoke/{c.run_id}"

        def clients(phase_name: str, extra: Callable[[str], StoreClientParams]
                    ) -> dict[str, JobRef]:
            jobs = {h: c.submit(h, STORE_CLIENT, extra(h), hold_s=timeout) for h in hosts
                    if h not in phase.gone}
            refs.extend(jobs.values())
            c.wait(list(jobs.values()), want=WAIT_FINAL, timeout_s=timeout, stop=stop)
            return jobs

        writes = clients("write", lambda h: StoreClientParams(
            master=master, phase="write", prefix=f"{run}/{h}", count=options.store_objects,
            size_bytes=options.store_object_bytes, replicas=replicas))
        _client_rows(phase, writes, "store: write", f"{options.store_objects} x "
                     f"{options.store_object_bytes // 1024} KiB put")
        written = [h for h, r in writes.items() if _client_ok(r)]
        reads = clients("read", lambda h: StoreClientParams(
            master=master, phase="read", count=options.store_objects,
            size_bytes=options.store_object_bytes,
            read_prefixes=[f"{run}/{o}" for o in written if o != h] or [f"{run}/{h}"]))
        _client_rows(phase, reads, "store: read", "read back byte for byte from the other "
                     "hosts' clients")
        status = clients("status", lambda h: StoreClientParams(master=master, phase="status"))
        view = next((r.status.result_as(StoreClientResult) for r in status.values()
                     if r.state == DONE and r.status is not None), None)
        c.refresh()
        _node_rows(phase, nodes, view)
    finally:
        c.cancel(refs)


def _client_ok(ref: JobRef) -> bool:
    if ref.state != DONE or ref.status is None:
        return False
    return ref.status.result_as(StoreClientResult).failed == 0


def _client_rows(phase: _Phase, refs: dict[str, JobRef], check: str, what: str) -> None:
    for host, ref in refs.items():
        if ref.state != DONE or ref.status is None:
            phase.job_failed(ref, check)
            continue
        result = ref.status.result_as(StoreClientResult)
        if result.failed:
            phase.add(host, check, Verdict.FAIL, f"{result.failed} of "
                      f"{result.ok + result.failed} failed: {'; '.join(result.errors[:2])}",
                      "'kvctl store status --master HOST:PORT' shows the nodes")
        else:
            phase.add(host, check, Verdict.PASS, f"{plural(result.ok, 'object')}: {what}")


def _node_rows(phase: _Phase, nodes: dict[str, JobRef], view: StoreClientResult | None
               ) -> None:
    seen = {n.node_id: n for n in view.nodes} if view is not None else {}
    for host, ref in nodes.items():
        if ref.state != READY or ref.status is None:  # exited, failed to start, or gone
            phase.job_failed(ref, "store: node")
            continue
        ready = ref.status.result_as(StoreNodeReady)
        node = seen.get(ready.node_id)
        if view is not None and (node is None or not node.alive):
            phase.add(host, "store: node", Verdict.FAIL,
                      f"node {ready.node_id} at {ready.endpoint} is "
                      f"{'not registered' if node is None else 'not alive'} at the master",
                      "see the agent's log on that host")
        else:
            objects = f", {plural(node.objects, 'object')}" if node is not None else ""
            phase.add(host, "store: node", Verdict.PASS,
                      f"node {ready.node_id} at {ready.endpoint}{objects}")


def _keys(c: Coordinator, phase: _Phase, options: ClusterRunbookOptions,
          stop: threading.Event | None) -> None:
    from kvctl.keys.compare import compare
    from kvctl.keys.manifest import read_manifest

    params = KeysParams(profile=options.keys_profile or "kvctl:sha256",
                        prompts_jsonl=options.prompts_jsonl or builtin_prompts())
    refs = {h: c.submit(h, KEYS, params, hold_s=options.phase_timeout_s)
            for h in phase.live()}
    try:
        c.wait(list(refs.values()), want=WAIT_FINAL, timeout_s=min(options.phase_timeout_s,
                                                                  120.0), stop=stop)
        with tempfile.TemporaryDirectory(prefix="kvctl-cluster-keys-") as tmp:
            paths: dict[str, Path] = {}
            for host, ref in refs.items():
                if ref.state != DONE or ref.status is None:
                    phase.job_failed(ref, "keys: agree")
                    continue
                path = Path(tmp) / f"{host}.json"
                path.write_bytes(bytes(ref.status.result))
                paths[host] = path
            if not paths:
                return
            try:
                manifests = {h: read_manifest(p) for h, p in paths.items()}
            except KvctlError as exc:
                phase.add(CLUSTER, "keys: agree", Verdict.FAIL, exc.cause, exc.hint)
                return
            first = next(iter(manifests))
            for host, manifest in manifests.items():
                if host == first:
                    continue
                result = compare([manifests[first], manifest])
                bad = [r for r in result.results if r.status != "match"]
                if bad:
                    why = "; ".join(x.detail for x in bad[0].causes) or bad[0].status
                    phase.add(host, "keys: agree", Verdict.FAIL,
                              f"{len(bad)} of {len(result.results)} prompts differ from "
                              f"{first}: prompt {bad[0].prompt} at block "
                              f"{bad[0].first_diverging_block}: {why}",
                              "kvctl verify-keys compare on the two manifests shows why")
                else:
                    phase.add(host, "keys: agree", Verdict.PASS,
                              f"{len(result.results)} prompts, same keys as {first}")
            if first in manifests:
                keys = sum(len(p.keys) for p in manifests[first].prompts)
                phase.add(first, "keys: agree", Verdict.PASS,
                          f"reference: {keys} keys, profile {params.profile}")
    finally:
        c.cancel(list(refs.values()))
