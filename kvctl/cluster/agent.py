"""``kvctl agent``: one per host, registered under a lease, doing the work clients post.

The agent

1. checks the cluster's token policy (:class:`~kvctl.cluster.protocol.Policy`): without a
   token it refuses to join a cluster that has one; with one it writes the policy if there
   is none, and refuses a cluster that runs with another token;
2. registers its :class:`~kvctl.cluster.protocol.HostRecord` and a liveness key under a lease
   (:class:`~kvctl.metadata.LeaseKeeper`): killed, it vanishes within the TTL;
3. watches ``jobs/<host>/`` (pushed by etcd and ``memory://``, polled every ``poll_s``
   seconds elsewhere) and runs each new job in a thread of its own: the job's signature
   is checked first (a job a client without the token wrote is refused, with the reason
   in its status); a handler per kind (:mod:`kvctl.cluster.jobs`) publishes ``ready``
   for serving jobs (a target, a store node) and holds, or returns a result (``done``),
   or fails with the error's cause and hint;
4. stops a job whose key is gone (the client deleted it, or the client died and its lease
   took its jobs), and deletes the job's status once it has stopped.

Handlers are passed in, so a simulated cluster (tests, the planner's check) runs the real
protocol with stand-in work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

import msgspec

from kvctl.cluster.protocol import (
    DONE,
    FAILED,
    JOB_KINDS,
    READY,
    REFUSED,
    ClusterKeys,
    HostRecord,
    Job,
    JobStatus,
    Policy,
    now,
    peek,
    policy_proof,
    raw,
    seal,
    unseal,
)
from kvctl.errors import AuthError, KvctlError, UsageError
from kvctl.metadata import LeaseKeeper, MetadataClient, MetadataError
from kvctl.metadata.watch import Watch, apply_changes
from kvctl.metrics import ServerMetrics

_log = logging.getLogger("kvctl.cluster")

#: Seconds a closing agent waits for its jobs' threads.
CLOSE_WAIT_S = 20.0
#: Most jobs running at once on one agent (more wait their turn).
MAX_RUNNING = 16


class JobCancelledError(KvctlError):
    """The job's key is gone (the client stopped it, or the client died)."""


class JobContext:
    """What a handler may use while it runs one job.

    Attributes:
        job: the job.
        host: this host's record (its address, rails, token-free facts).
        token: the cluster token, for the listeners and clients the job starts.
        cancelled: set when the job's key disappears or the agent stops.
    """

    def __init__(self, agent: Agent, job: Job, cancelled: threading.Event) -> None:
        self._agent = agent
        self.job = job
        self.host = agent.record
        self.token = agent.token
        self.cancelled = cancelled
        self.started = time.monotonic()

    def params(self, cls: type[Any]) -> Any:
        """The job's parameters as ``cls``.

        Raises:
            UsageError: they do not decode as ``cls``.
        """
        from kvctl.cluster.protocol import decode_body

        return decode_body(f"job {self.job.job_id}", bytes(self.job.params), cls)

    def ready(self, result: Any) -> None:
        """Publish ``ready`` with ``result`` (where a serving job can be reached)."""
        self._agent.publish_status(self.job, READY, result=raw(result))

    def hold(self, check: Callable[[], str | None] | None = None, interval_s: float = 0.25
             ) -> None:
        """Serve until the job is cancelled or its ``hold_s`` runs out.

        Args:
            check: called every ``interval_s``; a string it returns fails the job with it
                (a child process that exited, a lost listener).

        Raises:
            KvctlError: ``check`` reported a failure.
        """
        deadline = self.started + self.job.hold_s
        while not self.cancelled.wait(interval_s):
            if check is not None:
                reason = check()
                if reason is not None:
                    raise KvctlError(reason, "see the agent's log on that host")
            if time.monotonic() >= deadline:
                _log.info("job %s held for %.0f s: stopping it", self.job.job_id,
                          self.job.hold_s)
                return

    def check_cancelled(self) -> None:
        """Raise :class:`JobCancelledError` when the job was cancelled."""
        if self.cancelled.is_set():
            raise JobCancelledError(f"job {self.job.job_id} was cancelled", None)


#: ``handler(ctx)`` runs one job; its return value (a Struct, or ``None``) is the result.
Handler = Callable[[JobContext], Any]


class _Running:
    def __init__(self, job: Job, thread: threading.Thread, cancelled: threading.Event) -> None:
        self.job = job
        self.thread = thread
        self.cancelled = cancelled
        self.status_key: str | None = None


#: Help text of ``kvctl_agent_jobs_refused_total``.
_REFUSED_DOC = "Jobs refused (unsigned, unknown kind, bad parameters)."


class Agent:
    """A registered host serving jobs. ``start()`` registers; ``close()`` deregisters.

    Args:
        client: the metadata service (stays open; the agent does not close it).
        record: this host's facts (:func:`kvctl.cluster.facts.collect_facts`).
        handlers: the job kinds served, by name (:func:`kvctl.cluster.jobs.default_handlers`).
        token: the cluster token; documents are signed and checked with it.
        cluster_id: the cluster's key namespace.
        metrics: where to count jobs (``None``: not counted).
    """

    def __init__(self, client: MetadataClient, record: HostRecord, *,
                 handlers: Mapping[str, Handler], token: str | None = None,
                 cluster_id: str = "", metrics: ServerMetrics | None = None) -> None:
        unknown = set(handlers) - set(JOB_KINDS)
        if unknown:
            raise UsageError(f"unknown job kind(s) {', '.join(sorted(unknown))}",
                             f"known: {', '.join(JOB_KINDS)}")
        self.client = client
        self.record = msgspec.structs.replace(record, jobs=sorted(handlers))
        self.handlers = dict(handlers)
        self.token = token
        self.keys = ClusterKeys(cluster_id)
        self.metrics = metrics
        self._keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._done: dict[str, str | None] = {}  # job id -> its status key, until the job goes
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._watch: Watch | None = None
        self._slots = threading.BoundedSemaphore(MAX_RUNNING)
        self.refused = 0
        if metrics is not None:
            metrics.gauge("jobs_running", "Jobs running now.", lambda: float(len(self._running)))
            metrics.gauge("registered", "1 while the lease is renewed, else 0.",
                          lambda: 1.0 if self._keeper is not None and self._keeper.healthy
                          else 0.0)
            metrics.counter("jobs_refused", _REFUSED_DOC)  # exported from the start, at 0

    @property
    def hostname(self) -> str:
        """The member's name."""
        return self.record.hostname

    @property
    def healthy(self) -> bool:
        """Whether the registration's lease is being renewed."""
        return self._keeper is not None and self._keeper.healthy

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Check the policy, register, and start polling for jobs.

        Raises:
            AuthError: the cluster requires a token this agent lacks, or uses another.
            MetadataError: the metadata service cannot be reached.
        """
        agree_policy(self.client, self.keys, self.token, who=self.hostname)
        keeper = LeaseKeeper(self.client, self.record.lease_ttl_s,
                             name=f"kvctl-agent-lease-{self.hostname}").start()
        self._keeper = keeper
        try:
            keeper.publish(self.keys.host(self.hostname),
                           seal(self.keys.host(self.hostname), "host", self.record, self.token))
            keeper.publish(self.keys.alive(self.hostname), self.record.agent_id.encode())
        except BaseException:
            self._keeper = None
            keeper.stop()
            raise
        self._poller = threading.Thread(target=self._poll_loop, name="kvctl-agent-poll",
                                        daemon=True)
        self._poller.start()
        _log.info("agent %s registered at %s (lease %.0f s; jobs polled every %.2f s "
                  "where the service cannot push them)",
                  self.hostname, self.client.url, self.record.lease_ttl_s, self.record.poll_s)
        return self

    def close(self) -> None:
        """Stop every job, withdraw the registration (the lease is revoked). Idempotent."""
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.close()  # wakes the poller
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.join(timeout=self.record.poll_s + 10)
        with self._lock:
            running = list(self._running.values())
        for r in running:
            r.cancelled.set()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for r in running:
            r.thread.join(timeout=max(0.1, deadline - time.monotonic()))
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ statuses

    def publish_status(self, job: Job, state: str, *, result: msgspec.Raw | None = None,
                       error: str | None = None, hint: str | None = None) -> str:
        """Publish ``job``'s status under this agent's lease; returns its key."""
        key = self.keys.status(job.run_id, self.hostname, job.job_id)
        status = JobStatus(job_id=job.job_id, run_id=job.run_id, kind=job.kind,
                           host=self.hostname, state=state, updated_at=now(), error=error,
                           hint=hint, result=result if result is not None
                           else msgspec.Raw(b"null"))
        keeper = self._keeper
        if keeper is None:
            raise UsageError("the agent is not registered", "call start() first")
        try:
            keeper.publish(key, seal(key, "status", status, self.token))
        except MetadataError as exc:  # kept by the keeper: published once the lease is back
            _log.warning("status of job %s not published yet: %s", job.job_id, exc.cause)
        with self._lock:
            if job.job_id in self._running:
                self._running[job.job_id].status_key = key
        return key

    def _withdraw(self, key: str | None) -> None:
        keeper = self._keeper
        if key is None or keeper is None:
            return
        try:
            keeper.unpublish(key)
        except MetadataError as exc:
            _log.warning("status %s not deleted (%s); it expires with the agent", key,
                         exc.cause)

    # ------------------------------------------------------------------ the job loop

    def _poll_loop(self) -> None:
        """Follow ``jobs/<host>/`` through a watch: pushed by etcd (a job starts within
        milliseconds of being posted) or polled every ``poll_s`` where the service cannot
        push (:mod:`kvctl.metadata.watch`)."""
        prefix = self.keys.jobs_prefix(self.hostname)
        jobs: dict[str, bytes] = {}
        while not self._stop.is_set():
            try:
                watch = self._watch
                if watch is None:
                    watch = self._watch = self.client.watch(prefix, poll_s=self.record.poll_s)
                changed = apply_changes(jobs, watch.wait(max(self.record.poll_s, 1.0)))
            except MetadataError as exc:
                _log.warning("cannot follow jobs at %s: %s", self.client.url, exc.cause)
                self._stop.wait(min(self.record.poll_s, 1.0))  # the watch retries meanwhile
                continue
            if changed and not self._stop.is_set():  # a stopping agent starts nothing
                self._sync(prefix, jobs)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def _sync(self, prefix: str, listing: Mapping[str, bytes]) -> None:
        present: set[str] = set()
        for key, value in listing.items():
            job_id = key[len(prefix):]
            if not job_id or "/" in job_id:
                continue
            present.add(job_id)
            with self._lock:
                known = job_id in self._running or job_id in self._done
            if not known:
                self._begin(key, job_id, value)
        with self._lock:
            gone_running = [r for i, r in self._running.items() if i not in present]
            gone_done = [(i, k) for i, k in self._done.items() if i not in present]
            for i, _ in gone_done:
                del self._done[i]
        for r in gone_running:
            r.cancelled.set()
        for _, status_key in gone_done:
            self._withdraw(status_key)

    def _begin(self, key: str, job_id: str, value: bytes) -> None:
        try:
            job = unseal(key, value, "job", Job, self.token)
            if job.job_id != job_id or job.host != self.hostname:
                raise UsageError(f"{key} holds job {job.job_id} for {job.host}",
                                 "only the cluster commands of kvctl write jobs")
            if job.kind not in self.handlers:
                raise UsageError(f"job kind {job.kind!r} is not served by {self.hostname}",
                                 f"this agent serves {', '.join(sorted(self.handlers))}")
        except (AuthError, UsageError) as exc:
            self._refuse(key, job_id, value, exc)
            return
        cancelled = threading.Event()
        thread = threading.Thread(target=self._run, args=(job, cancelled),
                                  name=f"kvctl-agent-{job.kind}-{job_id}", daemon=True)
        with self._lock:
            self._running[job_id] = _Running(job, thread, cancelled)
        _log.info("job %s (%s) from run %s: starting", job_id, job.kind, job.run_id)
        thread.start()

    def _refuse(self, key: str, job_id: str, value: bytes, exc: KvctlError) -> None:
        self.refused += 1
        if self.metrics is not None:
            self.metrics.counter("jobs_refused", _REFUSED_DOC).inc()
        _log.warning("refusing %s: %s", key, exc.cause)
        claimed = peek(key, value, "job", Job)
        status_key = None
        if claimed is not None and claimed.job_id == job_id:
            status_key = self.publish_status(claimed, REFUSED, error=exc.cause, hint=exc.hint)
        with self._lock:
            self._done[job_id] = status_key

    def _run(self, job: Job, cancelled: threading.Event) -> None:
        started = time.perf_counter()
        outcome = "ok"
        with self._slots:
            ctx = JobContext(self, job, cancelled)
            try:
                result = self.handlers[job.kind](ctx)
                if cancelled.is_set():  # nobody reads a status whose job is gone
                    outcome = "stopped" if job.kind in _SERVING else "cancelled"
                else:
                    self.publish_status(job, DONE,
                                        result=None if result is None else raw(result))
            except JobCancelledError:
                outcome = "cancelled"
            except KvctlError as exc:
                outcome = "error"
                _log.warning("job %s (%s) failed: %s", job.job_id, job.kind, exc.cause)
                self.publish_status(job, FAILED, error=exc.cause, hint=exc.hint)
            except Exception as exc:  # noqa: BLE001 - a handler bug must not stop the agent
                outcome = "exception"
                _log.exception("job %s (%s) crashed", job.job_id, job.kind)
                self.publish_status(job, FAILED, error=f"unexpected {type(exc).__name__}: "
                                    f"{exc}", hint="a bug in kvctl: report the agent's log")
        if self.metrics is not None:
            self.metrics.record(f"job_{job.kind}", time.perf_counter() - started, outcome)
        with self._lock:
            running = self._running.pop(job.job_id, None)
            self._done[job.job_id] = running.status_key if running is not None else None
            gone = cancelled.is_set()
        if gone:  # the job key is already gone: nothing will ask for this status again
            with self._lock:
                key = self._done.pop(job.job_id, None)
            self._withdraw(key)
        _log.info("job %s (%s): %s in %.1f s", job.job_id, job.kind, outcome,
                  time.perf_counter() - started)


#: Kinds that serve until cancelled (being cancelled is how they end normally).
_SERVING = frozenset({"target", "store-master", "store-node"})


def check_policy(client: MetadataClient, keys: ClusterKeys, token: str | None) -> Policy | None:
    """The cluster's token policy, checked against ``token`` (nothing is written).

    Raises:
        AuthError: the cluster runs with a token and ``token`` is ``None``, or with another.
        MetadataError: the metadata service cannot be reached.
    """
    stored = client.get(keys.policy)
    if stored is None:
        return None
    try:
        policy = msgspec.json.decode(stored, type=Policy)
    except msgspec.DecodeError:
        raise UsageError(f"{keys.policy} in {client.url} is not a kvctl cluster policy",
                         "another program writes under kvctl/; give this cluster its own "
                         "cluster id (KVCTL_CLUSTER_ID)") from None
    if policy.auth == "none":
        return policy
    if not token:
        raise AuthError(
            f"the cluster at {client.url} requires the shared token (its policy, written by "
            f"{policy.written_by}, signs every document) and KVCTL_TOKEN is not set here",
            "set KVCTL_TOKEN as on the other hosts; if the cluster no longer uses a token, "
            f"delete {keys.policy} from the metadata service")
    if policy.proof != policy_proof(token):
        raise AuthError(
            f"the cluster at {client.url} runs with another token (policy written by "
            f"{policy.written_by})",
            "set the same KVCTL_TOKEN on every agent and client")
    return policy


def agree_policy(client: MetadataClient, keys: ClusterKeys, token: str | None, *,
                 who: str) -> None:
    """:func:`check_policy`, then, holding a token where no policy requires one yet, write
    the policy so that agents and clients without the token are refused from now on.

    Raises:
        AuthError: as :func:`check_policy`.
        MetadataError: the metadata service cannot be reached.
    """
    policy = check_policy(client, keys, token)
    if token and (policy is None or policy.auth == "none"):
        client.put(keys.policy, msgspec.json.encode(
            Policy("hmac-sha256", policy_proof(token), who)))
