"""``kvctl agent``: one per host, registered under a lease, doing the work clients post.

The agent

1. checks the cluster's token policy (:class:`~kvctl.cluster.protocol.Policy`): without a
   token it refuses to join a cluster that has one; with one it writes the policy if there
   is none, and refuses a cluster that runs with another token;
2. registers its :class:`~kvctl.cluster.protocol.HostRecord` and a liveness key under a lease
   (:class:`~kvctl.metadata.LeaseKeeper`): killed, it vanishes within the TTL;
3. watches ``jobs/<host>/`` (pushed by etcd and ``memory://``, polled every ``poll_s``
   seconds elsewhere) and runs each new job in a thread of its own. What it judges is the
   value at a key, not the key: a job that is unsigned or badly signed (with a token), a
   copy of one it already ran, expired, or whose run is not live (no signed run record with
   its nonce, :func:`~kvctl.cluster.protocol.run_is_live`) is *dropped*: no status, no
   work, one hash and at most one HMAC, counted (``kvctl_agent_jobs_dropped_total``) and
   logged at most once per :data:`DROP_LOG_S`. A value that lands later at the same key (the
   client's genuine job after a forgery) is judged afresh. A trusted job of a kind it does
   not serve is *refused* (a signed status says why); a handler per kind
   (:mod:`kvctl.cluster.jobs`) publishes ``ready`` for serving jobs (a target, a store
   node) and holds, or returns a result (``done``), or fails with the error's cause and
   hint;
4. stops a job whose key is gone (the client deleted it, or the client died and its lease
   took its jobs), or whose run record is gone or expired (checked every
   :data:`RUN_CHECK_S` once the job's key was written again, since a key can only outlive
   its run's lease that way, and every :data:`RUN_SWEEP_S` otherwise), and deletes the
   job's status once it has stopped.

Handlers are passed in, so a simulated cluster (tests, the planner's check) runs the real
protocol with stand-in work.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

import msgspec

from kvctl.cluster.protocol import (
    CLOCK_SKEW_S,
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
    RunRecord,
    decode_body,
    now,
    peek,
    policy_proof,
    raw,
    run_is_live,
    seal,
    unseal,
    verify,
)
from kvctl.errors import AuthError, KvctlError, UsageError
from kvctl.metadata import LeaseKeeper, MetadataClient, MetadataError
from kvctl.metadata.watch import Snapshot, Watch, apply_changes
from kvctl.metrics import ServerMetrics

_log = logging.getLogger("kvctl.cluster")

#: Seconds a closing agent waits for its jobs' threads.
CLOSE_WAIT_S = 20.0
#: Most jobs running at once on one agent (more wait their turn).
MAX_RUNNING = 16
#: Seconds between checks that the run of a running job is still live, once its key was
#: written again (re-put, or overwritten: the only ways a job's key outlives its run's lease).
RUN_CHECK_S = 1.0
#: Seconds between those checks for the other running jobs (a run that stopped renewing,
#: a service that cannot show a re-put): one read per run, so a large cluster's agents
#: add little to the metadata service's load.
RUN_SWEEP_S = 30.0
#: Seconds between two log lines about dropped jobs (the others are counted in the next).
DROP_LOG_S = 10.0
#: Most started jobs remembered by value, so that a copy of one is never started again.
MAX_CONSUMED = 100_000


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
        self.stopped_why: str | None = None
        self.rewritten = False  # its key was written again while it ran
        self.checked_at = time.monotonic()
        self.thread = thread
        self.cancelled = cancelled
        self.status_key: str | None = None


#: Help text of ``kvctl_agent_jobs_refused_total``.
_REFUSED_DOC = "Trusted jobs refused with a status (unknown kind, bad parameters)."
#: Help text of ``kvctl_agent_jobs_dropped_total``.
_DROPPED_DOC = ("Jobs dropped without a status (unsigned, badly signed, expired, copies, "
                "their run not live).")


def fingerprint(value: bytes) -> bytes:
    """What identifies one value at a job key (its signature with it): 128 bits of BLAKE2b."""
    return hashlib.blake2b(value, digest_size=16).digest()


class Agent:
    """A registered host serving jobs. ``start()`` registers; ``close()`` deregisters.

    Args:
        client: the metadata service (stays open; the agent does not close it).
        record: this host's facts (:func:`kvctl.cluster.facts.collect_facts`).
        handlers: the job kinds served, by name (:func:`kvctl.cluster.jobs.default_handlers`).
        token: the cluster token; documents are signed and checked with it.
        cluster_id: the cluster's key namespace.
        metrics: where to count jobs (``None``: not counted).
        clock_skew_s: how far past their expiry run records and jobs are still trusted.
    """

    def __init__(self, client: MetadataClient, record: HostRecord, *,
                 handlers: Mapping[str, Handler], token: str | None = None,
                 cluster_id: str = "", metrics: ServerMetrics | None = None,
                 clock_skew_s: float = CLOCK_SKEW_S) -> None:
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
        self.clock_skew_s = clock_skew_s
        self._seen: dict[str, bytes] = {}  # job id -> fingerprint of the value last judged
        self._consumed: dict[bytes, float] = {}  # fingerprint of a started job -> until when
        self._run_checked = 0.0
        self._drop_logged = -DROP_LOG_S
        self._drop_unlogged = 0
        self.refused = 0
        self.dropped = 0
        if metrics is not None:
            metrics.gauge("jobs_running", "Jobs running now.", lambda: float(len(self._running)))
            metrics.gauge("registered", "1 while the lease is renewed, else 0.",
                          lambda: 1.0 if self._keeper is not None and self._keeper.healthy
                          else 0.0)
            metrics.counter("jobs_refused", _REFUSED_DOC)  # exported from the start, at 0
            metrics.counter("jobs_dropped", _DROPPED_DOC)

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
            wait_s = max(self.record.poll_s, 1.0)
            if self._running:
                wait_s = min(wait_s, RUN_CHECK_S)
            try:
                watch = self._watch
                if watch is None:
                    watch = self._watch = self.client.watch(prefix, poll_s=self.record.poll_s)
                changes = watch.wait(wait_s)
            except MetadataError as exc:
                _log.warning("cannot follow jobs at %s: %s", self.client.url, exc.cause)
                self._stop.wait(min(self.record.poll_s, 1.0))  # the watch retries meanwhile
                continue
            changed: set[str] = set()
            for change in changes:
                if isinstance(change, Snapshot):
                    changed.update(k for k in jobs if k.startswith(change.prefix))
                    changed.update(change.entries)
                else:
                    changed.add(change.key)
            apply_changes(jobs, changes)
            if self._stop.is_set():  # a stopping agent starts nothing
                break
            if changed:
                self._sync(prefix, jobs, changed)
            self._check_runs()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def _sync(self, prefix: str, listing: Mapping[str, bytes], changed: set[str]) -> None:
        """Judge the values at the job keys that ``changed`` (only those: a flood of junk
        costs each junk key once, not once per later change)."""
        for key in sorted(changed):
            job_id = key[len(prefix):]
            if not key.startswith(prefix) or not job_id or "/" in job_id:
                continue
            value = listing.get(key)
            if value is None:
                self._gone(job_id)
                continue
            mark = fingerprint(value)
            with self._lock:
                running = self._running.get(job_id)
                if running is not None:  # a write at a running job's key: check its run often
                    running.rewritten = True
                if self._seen.get(job_id) == mark:
                    continue  # this very value was judged already
                self._seen[job_id] = mark
                handled = running is not None or job_id in self._done
            if handled:  # another value at the key of a job that ran: a forgery or a copy
                self._drop(key, "it replaces a job this agent already took")
            else:
                self._begin(key, job_id, value, mark)

    def _gone(self, job_id: str) -> None:
        """The job's key is gone: stop the job, or withdraw its status."""
        with self._lock:
            self._seen.pop(job_id, None)
            running = self._running.get(job_id)
            done = job_id in self._done
            status_key = self._done.pop(job_id, None)
        if running is not None:
            running.cancelled.set()
        elif done:
            self._withdraw(status_key)

    def _drop(self, key: str, why: str) -> None:
        """Leave a job unanswered: counted, and logged at most once per DROP_LOG_S."""
        self.dropped += 1
        if self.metrics is not None:
            self.metrics.counter("jobs_dropped", _DROPPED_DOC).inc()
        at = time.monotonic()
        with self._lock:
            self._drop_unlogged += 1
            if at - self._drop_logged < DROP_LOG_S:
                return
            count, self._drop_unlogged, self._drop_logged = self._drop_unlogged, 0, at
        _log.warning("dropped %s: %s (%d job(s) dropped without an answer since the last "
                     "such line; kvctl_agent_jobs_dropped_total counts them all)",
                     key, why, count)

    def _run_record(self, run_id: str) -> RunRecord | None:
        """The signed record of ``run_id``, ``None`` when there is none to trust.

        Raises:
            MetadataError: it cannot be read.
        """
        key = self.keys.run(run_id)
        stored = self.client.get(key)
        if stored is None:
            return None
        try:
            return unseal(key, stored, "run", RunRecord, self.token)
        except KvctlError:
            return None

    def _consumed_at(self, mark: bytes) -> bool:
        with self._lock:
            until = self._consumed.get(mark)
        return until is not None and until >= now()

    def _consume(self, mark: bytes, job: Job) -> None:
        with self._lock:
            if len(self._consumed) >= MAX_CONSUMED:
                at = now()
                for m in [m for m, u in self._consumed.items() if u < at]:
                    del self._consumed[m]
                for m in list(self._consumed)[:max(0, len(self._consumed) - MAX_CONSUMED + 1)]:
                    del self._consumed[m]
            self._consumed[mark] = job.expires_at + self.clock_skew_s

    def _begin(self, key: str, job_id: str, value: bytes, mark: bytes) -> None:
        try:  # nothing is written for a value that is not verifiably the client's
            body = verify(key, value, "job", self.token)
        except (AuthError, UsageError) as exc:
            self._drop(key, exc.cause)
            return
        try:
            job = decode_body(key, body, Job)
            if job.job_id != job_id or job.host != self.hostname:
                raise UsageError(f"{key} holds job {job.job_id} for {job.host}",
                                 "only the cluster commands of kvctl write jobs")
        except UsageError as exc:
            self._refuse(key, job_id, value, exc)
            return
        if self._consumed_at(mark):
            self._drop(key, "a copy of a job this agent already ran")
            return
        try:
            why = run_is_live(job, self._run_record(job.run_id), now(),
                              skew_s=self.clock_skew_s)
        except MetadataError as exc:
            with self._lock:  # judged again at the next change or snapshot
                self._seen.pop(job_id, None)
            _log.warning("job %s waits: its run record cannot be read (%s)", job_id, exc.cause)
            return
        if why is not None:
            self._drop(key, why)
            return
        if job.kind not in self.handlers:
            self._refuse(key, job_id, value, UsageError(
                f"job kind {job.kind!r} is not served by {self.hostname}",
                f"this agent serves {', '.join(sorted(self.handlers))}"))
            return
        self._consume(mark, job)
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

    def _check_runs(self) -> None:
        """Stop running jobs whose run is no longer live: every RUN_CHECK_S those whose key
        was written again, every RUN_SWEEP_S the others."""
        at = time.monotonic()
        if at - self._run_checked < RUN_CHECK_S:
            return
        self._run_checked = at
        with self._lock:
            running = [r for r in self._running.values() if not r.cancelled.is_set()
                       and (r.rewritten or at - r.checked_at >= RUN_SWEEP_S)]
        records: dict[str, RunRecord | None] = {}
        for r in running:
            r.checked_at = at
            run_id = r.job.run_id
            if run_id not in records:
                try:
                    records[run_id] = self._run_record(run_id)
                except MetadataError:
                    continue  # unknown is not gone: the job's key still decides
            why = run_is_live(r.job, records[run_id], now(), skew_s=self.clock_skew_s)
            if why is not None:
                _log.warning("stopping job %s (%s): %s", r.job.job_id, r.job.kind, why)
                r.stopped_why = why
                r.cancelled.set()

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
            f"remove the policy with 'kvctl cluster reset-policy --metadata {client.url} "
            f"--yes' (it deletes {keys.policy})")
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
