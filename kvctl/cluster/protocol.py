"""What agents and clients write in the metadata service, and how it is signed.

Keys, under ``kvctl/[<cluster_id>/]cluster/``:

==============================  =====================================  ======================
key                             value                                  written by (lease)
==============================  =====================================  ======================
``policy``                      :class:`Policy`: whether a token rules  the first holder of the
                                                                       token (no lease)
``hosts/<host>``                :class:`HostRecord`: the host's facts  its agent (agent's)
``alive/<host>``                the agent's id (cheap liveness polls)  its agent (agent's)
``runs/<run_id>``               :class:`RunRecord`: the run is live,   the client (client's)
                                until ``expires_at`` (re-signed every
                                TTL/3)
``jobs/<host>/<job_id>``        :class:`Job`: work for that agent      the client (client's)
``status/<run>/<host>/<job>``   :class:`JobStatus`: ready/done/failed  the agent (agent's)
==============================  =====================================  ======================

A pair of a cluster bench costs :data:`kvctl.cluster.scheduler.WRITES_PER_PAIR` writes: the
client puts the target's job, the target's agent publishes ``ready`` with its address, the
client puts the initiator's job, the initiator's agent publishes the result, the client
deletes both jobs, and each agent deletes its status when it sees its job gone. A killed
client's jobs vanish with its lease (agents then stop serving); a killed agent's record,
liveness key and statuses vanish with its lease, which is how a client learns it is gone.

Every value is an :class:`Envelope` ``{"kind", "body", "sig"}``. With a token (``KVCTL_TOKEN``)
``sig`` is ``HMAC-SHA256(token, context || key || kind || body)``: a document is bound to its
key, so it cannot be replayed under another one, and a reader with the token rejects any
document without a valid signature (etcd itself checks nothing). The token never appears in
any document.

A job is also bound to its run: its body carries the run id, the run's nonce (random per
run) and an expiry, and an agent starts it only while ``runs/<run_id>`` holds a signed
:class:`RunRecord` with that nonce that has not expired (:func:`run_is_live`). The record
rides on the run's lease and is re-signed with a later expiry every TTL/3, so a job copied
back after its run ended finds no record, or a copied record that expires within a TTL (plus
:data:`CLOCK_SKEW_S`); a running job whose run record goes is stopped. Job ids carry 64
random bits, so nobody can write at a job's key before the client does.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, TypeVar

import msgspec

from kvctl.errors import AuthError, UsageError
from kvctl.metadata import key_prefix
from kvctl.net import auth

#: HMAC context of every cluster document.
SIGN_CONTEXT = b"kvctl-cluster/1"
#: Seconds a run record's expiry (and a job's) is trusted past, for clocks that differ
#: between hosts (NTP keeps them within milliseconds).
CLOCK_SKEW_S = 5.0
#: The signed message that proves a policy's writer knows the token.
POLICY_PROOF = b"kvctl-cluster-policy/1"

T = TypeVar("T")

# Job kinds an agent serves.
TARGET = "target"
BENCH = "bench"
RUNBOOK = "runbook"
STORE_MASTER = "store-master"
STORE_NODE = "store-node"
STORE_CLIENT = "store-client"
KEYS = "keys"
JOB_KINDS = (TARGET, BENCH, RUNBOOK, STORE_MASTER, STORE_NODE, STORE_CLIENT, KEYS)

# Job states an agent reports.
READY = "ready"  # a serving job is up (target, store master, store node); it holds on
DONE = "done"  # finished; result attached
FAILED = "failed"  # error and hint attached
REFUSED = "refused"  # never started: unsigned, unknown kind, bad parameters
FINAL_STATES = (DONE, FAILED, REFUSED)


class ClusterKeys:
    """The key layout of one cluster (``cluster_id`` as ``common.cluster_id``)."""

    def __init__(self, cluster_id: str = "") -> None:
        self.root = key_prefix(cluster_id) + "cluster/"
        self.policy = self.root + "policy"
        self.hosts_prefix = self.root + "hosts/"
        self.alive_prefix = self.root + "alive/"

    def host(self, host: str) -> str:
        """The host's record."""
        return self.hosts_prefix + host

    def alive(self, host: str) -> str:
        """The host's liveness key."""
        return self.alive_prefix + host

    def run(self, run_id: str) -> str:
        """The run's liveness record."""
        return f"{self.root}runs/{run_id}"

    def jobs_prefix(self, host: str) -> str:
        """Where the host's agent looks for work."""
        return f"{self.root}jobs/{host}/"

    def job(self, host: str, job_id: str) -> str:
        """One job for ``host``."""
        return self.jobs_prefix(host) + job_id

    def status_prefix(self, run_id: str) -> str:
        """Every status of one run (one list per client poll)."""
        return f"{self.root}status/{run_id}/"

    def status(self, run_id: str, host: str, job_id: str) -> str:
        """The status of one job."""
        return f"{self.status_prefix(run_id)}{host}/{job_id}"


def check_host_name(name: str) -> str:
    """``name`` if it can be a key part (a hostname: no ``/``, no spaces).

    Raises:
        UsageError: an empty name, or one with ``/``, whitespace or unprintable characters.
    """
    if not name or len(name) > 253 or not name.isprintable() or "/" in name or \
            any(c.isspace() for c in name):
        raise UsageError(f"host name {name!r} cannot name a cluster member",
                         "give --hostname a name without '/' or spaces")
    return name


# ---------------------------------------------------------------- documents


class Envelope(msgspec.Struct, frozen=True):
    """A stored document: its kind, its body (exact bytes, signed) and the signature."""

    kind: str
    body: msgspec.Raw
    sig: str | None = None


def _mac(token: str, key: str, kind: str, body: bytes) -> bytes:
    return auth.respond(token, key.encode() + b"\0" + kind.encode() + b"\0" + body,
                        SIGN_CONTEXT)


def seal(key: str, kind: str, body: Any, token: str | None) -> bytes:
    """``body`` (a Struct) as the value of ``key``, signed when there is a token."""
    raw = msgspec.json.encode(body)
    sig = _mac(token, key, kind, raw).hex() if token else None
    return msgspec.json.encode(Envelope(kind, msgspec.Raw(raw), sig))


def unseal(key: str, value: bytes, kind: str, cls: type[T], token: str | None) -> T:
    """The body of the document stored at ``key``, its signature checked with a token.

    Without a token nothing can be checked and any document is taken as it is.

    Raises:
        AuthError: with a token, the document is unsigned or signed with another token.
        UsageError: not a cluster document of ``kind`` (a bad or foreign value).
    """
    return decode_body(key, verify(key, value, kind, token), cls)


def verify(key: str, value: bytes, kind: str, token: str | None) -> bytes:
    """The body of the ``kind`` document stored at ``key``, its signature checked with a
    token (as :func:`unseal`, without decoding the body).

    Raises:
        AuthError: with a token, the document is unsigned or signed with another token.
        UsageError: not a cluster document of ``kind``.
    """
    envelope = _envelope(key, value)
    if envelope.kind != kind:
        raise UsageError(f"{key} holds a {envelope.kind!r} document, not {kind!r}",
                         "check the cluster id (common.cluster_id) and kvctl versions")
    body = bytes(envelope.body)
    if token:
        if envelope.sig is None:
            raise AuthError(f"{key} is not signed: its writer runs without the cluster's token",
                            "set the same KVCTL_TOKEN on every agent and client")
        try:
            sig = bytes.fromhex(envelope.sig)
        except ValueError:
            sig = b""
        if not auth.check_response(token, key.encode() + b"\0" + kind.encode() + b"\0" + body,
                                   SIGN_CONTEXT, sig):
            raise AuthError(f"{key} is signed with another token (or was copied from "
                            "another key)",
                            "set the same KVCTL_TOKEN on every agent and client")
    return body


def peek(key: str, value: bytes, kind: str, cls: type[T]) -> T | None:
    """The body without checking its signature (to answer an untrusted job, or to show what
    an untrusted agent claims), or ``None`` when it does not decode."""
    with contextlib.suppress(UsageError):
        envelope = _envelope(key, value)
        if envelope.kind == kind:
            return decode_body(key, bytes(envelope.body), cls)
    return None


def _envelope(key: str, value: bytes) -> Envelope:
    try:
        return msgspec.json.decode(value, type=Envelope)
    except msgspec.DecodeError as exc:
        raise UsageError(f"{key} is not a kvctl cluster document: {exc}",
                         "another program writes under kvctl/; give this cluster its own "
                         "cluster id") from None


def decode_body(key: str, body: bytes, cls: type[T]) -> T:
    """Decode and validate a document body (or a nested raw field) as ``cls``."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.DecodeError as exc:
        raise UsageError(f"{key}: bad {getattr(cls, '__name__', cls)} document: {exc}",
                         "run the same kvctl version on agents and clients") from None


def raw(body: Any) -> msgspec.Raw:
    """``body`` encoded once, to nest inside another document."""
    return msgspec.Raw(msgspec.json.encode(body))


# ---------------------------------------------------------------- policy


class Policy(msgspec.Struct, frozen=True):
    """Whether the cluster runs with a token.

    Attributes:
        auth: ``hmac-sha256`` (every document signed) or ``none``.
        proof: HMAC of :data:`POLICY_PROOF` under the token (hex), so holders of the token
            recognise each other's policy and tell "another token" from "no token".
        written_by: host (or ``client@host``) that wrote it, for the error message.
    """

    auth: str
    proof: str | None
    written_by: str


def policy_proof(token: str) -> str:
    """The proof a policy under ``token`` carries."""
    return auth.respond(token, POLICY_PROOF, SIGN_CONTEXT).hex()


# ---------------------------------------------------------------- host records


class GpuFact(msgspec.Struct, frozen=True):
    """One GPU as ``kvctl topo`` sees it (memory in bytes, ``None`` without NVML)."""

    name: str
    model: str
    memory_bytes: int | None = None
    numa_node: int | None = None


class NicFact(msgspec.Struct, frozen=True):
    """One NIC: an RDMA device or an Ethernet NIC from ``kvctl topo``, or a plain netdev.

    Attributes:
        kind: ``rdma``, ``ethernet`` (topo) or ``netdev`` (an interface topo does not list,
            e.g. a virtual NIC).
        state: ``active``, ``down`` or ``unknown``.
        rate_gbps: port rate in Gbit/s (decimal), ``None`` when unknown.
        netdev: its network interface, if any; ``addresses``: that interface's IPv4 ones.
    """

    name: str
    kind: str
    state: str
    rate_gbps: float | None = None
    netdev: str | None = None
    addresses: list[str] = []
    numa_node: int | None = None


class Rail(msgspec.Struct, frozen=True):
    """A NIC a rail-by-rail bench uses: rail ``index`` of this host is ``nic`` at ``address``."""

    index: int
    nic: str
    address: str


class FindingFact(msgspec.Struct, frozen=True):
    """One ``kvctl topo doctor`` finding."""

    check: str
    severity: str
    subject: str
    message: str
    hint: str


class DoctorSummary(msgspec.Struct, frozen=True):
    """``kvctl topo doctor`` on the host: counts by severity and the findings, or why the
    topology could not be read (``error``)."""

    errors: int = 0
    warnings: int = 0
    infos: int = 0
    findings: list[FindingFact] = []
    error: str | None = None


class HostRecord(msgspec.Struct, frozen=True):
    """What an agent registers about its host.

    Attributes:
        hostname: the member's name (its key).
        agent_id: random per agent process (a restarted agent has a new one).
        version: kvctl version of the agent.
        pid / started_at: the agent process and its start (Unix time, seconds).
        address: where peers reach this host (routes toward the metadata service, or
            ``--advertise``); ``addresses``: every interface address.
        gpus / nics / rails: hardware; rails are the active NICs with an address, in order.
        doctor: ``kvctl topo doctor`` summary.
        transports: transports this host offers (``shm`` same-host only, ``tcp``, ``rdma``).
        engines: transfer engines that can run here (``kvctl``, ``mooncake``, ``nixl``).
        jobs: job kinds it serves.
        lease_ttl_s / poll_s: how fast it vanishes after a crash and picks up work.
        metrics: its Prometheus endpoint, if serving one.
    """

    hostname: str
    agent_id: str
    version: str
    pid: int
    started_at: float
    address: str
    addresses: list[str] = []
    gpus: list[GpuFact] = []
    nics: list[NicFact] = []
    rails: list[Rail] = []
    doctor: DoctorSummary = DoctorSummary()
    transports: list[str] = []
    engines: list[str] = []
    jobs: list[str] = []
    lease_ttl_s: float = 10.0
    poll_s: float = 0.5
    metrics: str | None = None


# ---------------------------------------------------------------- jobs


class RunRecord(msgspec.Struct, frozen=True):
    """A client run that is live: written under the run's lease at ``runs/<run_id>`` and
    re-signed every TTL/3 with a later ``expires_at``.

    Attributes:
        run_id / nonce: the run, and 128 random bits of it its jobs repeat.
        client: ``client@host``, for logs.
        expires_at: Unix time after which the record no longer proves the run live.
    """

    run_id: str
    nonce: str
    client: str
    expires_at: float


class Job(msgspec.Struct, frozen=True):
    """Work for one agent.

    Attributes:
        job_id: ``<run_id>-<64 random bits, hex>``; ``run_id``: the client run it belongs to.
        kind: one of :data:`JOB_KINDS`; ``params``: that kind's parameters.
        host: the agent it is for.
        issued_at: when the client wrote it (Unix time, seconds; informational).
        hold_s: longest a serving job stays up, or a finite job may run, in seconds.
        nonce: the run's nonce (:class:`RunRecord`): the job runs only while that run's
            record is live. Empty in jobs of kvctl before issue 27 (refused with a token).
        expires_at: Unix time after which the job is not started and is stopped if running
            (``issued_at + hold_s`` plus the run's TTL). ``0``: as ``nonce``.
    """

    job_id: str
    run_id: str
    kind: str
    host: str
    issued_at: float
    hold_s: float
    params: msgspec.Raw
    nonce: str = ""
    expires_at: float = 0.0


def run_is_live(job: Job, record: RunRecord | None, at: float, *,
                skew_s: float = CLOCK_SKEW_S) -> str | None:
    """Why ``job`` must not run (its run is gone, another run, expired), or ``None``.

    ``record`` is what ``runs/<job.run_id>`` holds, its signature already checked (``None``:
    nothing, or nothing trusted); ``at`` is now (Unix time).
    """
    if not job.nonce or not job.expires_at:
        return "it names no run nonce or expiry (a client of an older kvctl)"
    if at > job.expires_at + skew_s:
        return f"it expired {at - job.expires_at:.0f} s ago"
    if record is None:
        return f"its run {job.run_id} is not live (no signed run record)"
    if record.run_id != job.run_id or record.nonce != job.nonce:
        return f"it names another instance of run {job.run_id} (a copy of an older job)"
    if at > record.expires_at + skew_s:
        return f"its run {job.run_id} stopped renewing {at - record.expires_at:.0f} s ago"
    return None


class JobStatus(msgspec.Struct, frozen=True):
    """An agent's answer to a job.

    Attributes:
        state: ``ready``, ``done``, ``failed`` or ``refused``.
        error / hint: why it failed or was refused, and the fix.
        result: the kind's result document (``ready``: where it serves; ``done``: results).
        updated_at: Unix time of this status, seconds.
    """

    job_id: str
    run_id: str
    kind: str
    host: str
    state: str
    updated_at: float
    error: str | None = None
    hint: str | None = None
    result: msgspec.Raw = msgspec.Raw(b"null")

    def result_as(self, cls: type[T]) -> T:
        """The result document as ``cls``.

        Raises:
            UsageError: there is none, or it does not decode as ``cls``.
        """
        body = bytes(self.result)
        if body.strip() == b"null":
            raise UsageError(f"job {self.job_id} on {self.host} ({self.state}) has no result",
                             "see the agent's log on that host")
        return decode_body(f"result of job {self.job_id} on {self.host}", body, cls)


class SweepParams(msgspec.Struct, frozen=True):
    """The sweep a bench job runs (as :class:`kvctl.bench.spec.Sweep`)."""

    ops: list[str]
    transports: list[str]
    block_sizes_bytes: list[int]
    batch_sizes: list[int]
    duration_s: float | None = None
    iterations: int | None = None
    warmup: int = 2
    verify: bool = True
    threads: int = 1
    local_location: str = "cpu:0"
    remote_location: str = "cpu:0"
    model: str | None = None
    tokens_per_block: int | None = None
    kv_bytes_per_token: int | None = None


class TargetParams(msgspec.Struct, frozen=True):
    """Serve a bench target: a segment of ``region_bytes`` at ``address`` (this host's
    primary address when ``None``; a rail's address in a rail-by-rail bench)."""

    region_bytes: int
    engines: list[str]
    transports: list[str]
    address: str | None = None
    location: str = "cpu:0"


class TargetReady(msgspec.Struct, frozen=True):
    """Where the target serves: ``peer`` is what the initiator passes as ``--peer``."""

    peer: str
    address: str
    engines: list[str]
    skipped: list[str] = []


class BenchParams(msgspec.Struct, frozen=True):
    """Initiate a sweep against ``peer``; kvctl's TCP connections leave from
    ``local_address`` (a rail's address in a rail-by-rail bench; ``None``: the kernel's
    route)."""

    peer: str
    sweep: SweepParams
    engines: list[str]
    timeout_s: float = 10.0
    local_address: str | None = None


class RowSummary(msgspec.Struct, frozen=True):
    """One configuration's result, as much of :class:`kvctl.bench.result.ResultRow` as a
    cluster report uses (GB/s decimal)."""

    engine: str
    op: str
    transport: str
    block_size_bytes: int
    batch_size: int
    gbps: float
    errors: int
    verified: bool | None
    path: str
    requests: int
    elapsed_s: float
    line_rate_gbps: float | None = None
    batch_latency_p50_us: float | None = None
    batch_latency_p99_us: float | None = None


class BenchResult(msgspec.Struct, frozen=True):
    """A bench job's rows and what it could not run."""

    rows: list[RowSummary]
    skipped: list[str] = []


class RunbookParams(msgspec.Struct, frozen=True):
    """Run a runbook: ``yaml`` (its text), or the built-in single-host runbook."""

    yaml: str | None = None
    name: str = "single-host"


class CheckRow(msgspec.Struct, frozen=True):
    """One row of a runbook's verdict table."""

    check: str
    verdict: str
    measured: str = ""
    threshold: str = ""
    hint: str | None = None


class RunbookResult(msgspec.Struct, frozen=True):
    """A runbook's verdict table on one host."""

    name: str
    passed: bool
    duration_s: float
    results: list[CheckRow]


class StoreMasterParams(msgspec.Struct, frozen=True):
    """Run a store master on this host (its primary address, any port)."""

    address: str | None = None


class StoreMasterReady(msgspec.Struct, frozen=True):
    """The master's address."""

    master: str
    pid: int


class StoreNodeParams(msgspec.Struct, frozen=True):
    """Run a storage node for ``master``."""

    master: str
    capacity_bytes: int
    node_id: str


class StoreNodeReady(msgspec.Struct, frozen=True):
    """The node, as it registered with the master."""

    node_id: str
    endpoint: str
    pid: int


class StoreClientParams(msgspec.Struct, frozen=True):
    """A store client on this host.

    ``phase``: ``write`` puts ``count`` objects of ``size_bytes`` under ``prefix``; ``read``
    reads ``count`` objects under each of ``read_prefixes`` and checks every byte (content is
    a function of the key); ``status`` reports the master's view of its nodes.
    """

    master: str
    phase: str
    prefix: str = ""
    count: int = 0
    size_bytes: int = 0
    read_prefixes: list[str] = []
    replicas: int = 1


class NodeView(msgspec.Struct, frozen=True):
    """A node as the master reports it."""

    node_id: str
    alive: bool
    objects: int
    used_bytes: int
    endpoint: str


class StoreClientResult(msgspec.Struct, frozen=True):
    """What a store-client phase did: objects ok and failed, the first errors, and (phase
    ``status``) the master's nodes."""

    ok: int
    failed: int
    errors: list[str] = []
    nodes: list[NodeView] = []


class KeysParams(msgspec.Struct, frozen=True):
    """Compute block keys for ``prompts_jsonl`` (a prompts file's text) with a profile."""

    profile: str
    prompts_jsonl: str
    block_size: int | None = None


def now() -> float:
    """Unix time, seconds (statuses and records carry it for people)."""
    return time.time()
