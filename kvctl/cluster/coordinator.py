"""The client side of the protocol: post jobs, follow their statuses, notice vanished hosts.

A :class:`Coordinator` holds one lease for the run: every job it posts rides on it, so if the
client dies (or is interrupted) its jobs vanish and the agents stop serving. It follows the
run's statuses and the liveness keys through one watch (:mod:`kvctl.metadata.watch`):
pushed by etcd, so a status or a vanished host is seen within milliseconds and an idle run
reads nothing; polled every ``poll_s`` (two range reads, whatever the cluster's size) where
the service cannot push. A host whose liveness key is gone (its agent's lease expired) makes
its pending jobs *missing*: the run goes on without it and reports when it was noticed.
Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from kvctl.cluster.agent import agree_policy
from kvctl.cluster.protocol import (
    FINAL_STATES,
    READY,
    REFUSED,
    ClusterKeys,
    Job,
    JobStatus,
    RunRecord,
    now,
    raw,
    seal,
    unseal,
)
from kvctl.errors import AuthError, KvctlError, UsageError
from kvctl.metadata import LeaseKeeper, MetadataClient, MetadataError
from kvctl.metadata.watch import Snapshot, Watch, apply_changes

_log = logging.getLogger("kvctl.cluster")

#: What :meth:`Coordinator.wait` waits for.
WAIT_FINAL = "final"
WAIT_READY = "ready"


@dataclasses.dataclass
class JobRef:
    """One posted job and what became of it.

    Attributes:
        job_id / host / kind: the job.
        key / status_key: where it and its status live.
        status: the agent's last status, ``None`` before the first.
        missing_at: Unix time the host was seen gone, while the job was pending.
        timed_out: the wait's deadline passed first.
        untrusted: the status did not verify (another token), with the reason.
    """

    job_id: str
    host: str
    kind: str
    key: str
    status_key: str
    status: JobStatus | None = None
    missing_at: float | None = None
    timed_out: bool = False
    untrusted: str | None = None

    @property
    def state(self) -> str | None:
        """The status's state, ``None`` when there is none yet."""
        return self.status.state if self.status is not None else None

    def settled(self, want: str) -> bool:
        """Whether waiting for ``want`` (``final`` or ``ready``) is over for this job."""
        if self.missing_at is not None or self.timed_out or self.untrusted:
            return True
        state = self.state
        return state in FINAL_STATES or (want == WAIT_READY and state == READY)

    def error(self) -> str | None:
        """Why the job has no usable result, or ``None``."""
        if self.untrusted:
            return self.untrusted
        if self.missing_at is not None:
            return f"{self.host} vanished (its agent's lease expired)"
        if self.status is not None and self.status.error:
            return self.status.error
        if self.timed_out:
            return f"{self.host} did not answer in time"
        return None


def new_job_id(run_id: str) -> str:
    """A job id nobody can guess before the job is posted: the run's id and 64 random bits
    (so nothing can be written at its key ahead of the client)."""
    return f"{run_id}-{secrets.token_hex(8)}"


class Coordinator:
    """Jobs of one run, on one lease. ``start()`` first; ``close()`` cancels what is left.

    Args:
        client: the metadata service (stays open).
        keys: the cluster's key layout.
        token: the cluster token (jobs are signed, statuses checked).
        ttl_s: the run's lease TTL: how long jobs outlive a dead client.
        poll_s: longest wait between checks of a stop or a deadline, and the poll interval
            of services that cannot push changes.
        run_id: the run's id (random when ``None``).
    """

    def __init__(self, client: MetadataClient, keys: ClusterKeys, *, token: str | None,
                 ttl_s: float = 10.0, poll_s: float = 0.2, run_id: str | None = None) -> None:
        if not poll_s > 0:
            raise UsageError(f"poll interval {poll_s} s is not positive", "use e.g. 0.2s")
        self.client = client
        self.keys = keys
        self.token = token
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.run_id = run_id or secrets.token_hex(8)
        self.nonce = secrets.token_hex(16)
        self._who = f"client@{socket.gethostname()}"
        self._keeper: LeaseKeeper | None = None
        self._renewer: threading.Thread | None = None
        self._closing = threading.Event()
        self._refs: dict[str, JobRef] = {}
        self._alive: dict[str, str] = {}
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        self._state: dict[str, bytes] = {}  # what the watch says is under its prefixes
        self._synced: set[str] = set()  # prefixes whose snapshot came

    def start(self) -> Self:
        """Check the token policy and take the run's lease.

        Raises:
            AuthError: the cluster requires a token we lack, or runs with another.
            MetadataError: the metadata service cannot be reached.
        """
        agree_policy(self.client, self.keys, self.token, who=self._who)
        watch = self.client.watch([self.keys.status_prefix(self.run_id),
                                   self.keys.alive_prefix], poll_s=self.poll_s)
        self._watch = watch
        try:
            deadline = time.monotonic() + max(self.ttl_s, 5.0)
            while not self._sync_now(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise MetadataError(f"no snapshot of the cluster from {self.client.url}",
                                        "check that the metadata service answers")
            self._keeper = LeaseKeeper(self.client, self.ttl_s,
                                       name=f"kvctl-cluster-run-{self.run_id}").start()
            self._publish_run()
        except BaseException:
            self._watch = None
            watch.close()
            keeper, self._keeper = self._keeper, None
            if keeper is not None:
                keeper.stop()
            raise
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"kvctl-cluster-run-record-{self.run_id}")
        self._renewer.start()
        return self

    def _publish_run(self) -> None:
        """(Re)write the run's record under its lease, valid for one more TTL."""
        keeper = self._require()
        key = self.keys.run(self.run_id)
        record = RunRecord(self.run_id, self.nonce, self._who, now() + self.ttl_s)
        keeper.publish(key, seal(key, "run", record, self.token))

    def _renew_loop(self) -> None:
        while not self._closing.wait(self.ttl_s / 3):
            try:
                self._publish_run()
            except (MetadataError, UsageError) as exc:  # the keeper writes it once it can
                _log.warning("run record of %s not renewed: %s", self.run_id, exc.cause)

    def close(self) -> None:
        """Revoke the lease (every job left vanishes, and the run record: agents stop
        whatever still runs for it). Idempotent."""
        self._closing.set()
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.join(timeout=10)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs

    def submit(self, host: str, kind: str, params: Any, *, hold_s: float) -> JobRef:
        """Post a job for ``host``'s agent.

        Raises:
            MetadataError: the put failed.
        """
        keeper = self._require()
        job_id = new_job_id(self.run_id)
        key = self.keys.job(host, job_id)
        issued = now()
        job = Job(job_id=job_id, run_id=self.run_id, kind=kind, host=host, issued_at=issued,
                  hold_s=hold_s, params=raw(params), nonce=self.nonce,
                  expires_at=issued + hold_s + self.ttl_s)
        ref = JobRef(job_id, host, kind, key, self.keys.status(self.run_id, host, job_id))
        with self._lock:
            self._refs[job_id] = ref
        keeper.publish(key, seal(key, "job", job, self.token))
        return ref

    def cancel(self, refs: Sequence[JobRef]) -> None:
        """Delete the jobs (their agents stop them and delete their statuses)."""
        keeper = self._keeper
        for ref in refs:
            with self._lock:
                self._refs.pop(ref.job_id, None)
            if keeper is None:
                continue
            try:
                keeper.unpublish(ref.key)
            except MetadataError as exc:
                _log.warning("could not delete job %s (%s); it ends with the run's lease",
                             ref.job_id, exc.cause)

    def _require(self) -> LeaseKeeper:
        if self._keeper is None:
            raise UsageError("the coordinator is not started", "call start() first")
        return self._keeper

    # ------------------------------------------------------------------ polling

    def refresh(self, wait_s: float = 0.0) -> bool:
        """Take in what changed (waiting up to ``wait_s`` for something): statuses of the
        run and liveness keys. ``False`` (logged) when the metadata service did not answer,
        or has not yet given a first view of both."""
        try:
            return self._sync_now(wait_s)
        except MetadataError as exc:
            _log.warning("following %s failed: %s", self.client.url, exc.cause)
            return False

    def _sync_now(self, wait_s: float) -> bool:
        watch = self._watch
        if watch is None:
            raise UsageError("the coordinator is not started", "call start() first")
        changes = watch.wait(wait_s)
        changed: set[str] = set()
        for change in changes:
            if isinstance(change, Snapshot):
                self._synced.add(change.prefix)
                changed.update(k for k in self._state if k.startswith(change.prefix))
                changed.update(change.entries)
            else:
                changed.add(change.key)
        apply_changes(self._state, changes)
        status_prefix = self.keys.status_prefix(self.run_id)
        alive_prefix = self.keys.alive_prefix
        with self._lock:
            if any(k.startswith(alive_prefix) for k in changed):
                self._alive = {k[len(alive_prefix):]: v.decode(errors="replace")
                               for k, v in self._state.items() if k.startswith(alive_prefix)}
            refs = dict(self._refs)
        by_key = {r.status_key: r for r in refs.values()}
        for key in changed:
            ref = by_key.get(key) if key.startswith(status_prefix) else None
            value = self._state.get(key)
            if ref is None or value is None:
                continue
            try:
                ref.status = unseal(key, value, "status", JobStatus, self.token)
                ref.untrusted = None
            except KvctlError as exc:
                ref.untrusted = f"status of {ref.host} not trusted: {exc.cause}"
        return self._synced >= {status_prefix, alive_prefix}

    def alive(self, host: str) -> bool:
        """Whether ``host``'s liveness key was there at the last poll."""
        with self._lock:
            return host in self._alive

    def wait(self, refs: Sequence[JobRef], *, want: str = WAIT_FINAL, timeout_s: float,
             stop: threading.Event | None = None) -> bool:
        """Poll until every job in ``refs`` is settled (see :meth:`JobRef.settled`), its host
        vanished, or ``timeout_s`` passed. ``False`` when ``stop`` was set first.

        Raises:
            AuthError: an agent refused a job for its signature (this client's token is
                missing or wrong).
        """
        deadline = time.monotonic() + timeout_s
        wait_s = 0.0
        while True:
            polled = self.refresh(wait_s)
            pending = [r for r in refs if not r.settled(want)]
            for ref in refs:
                status = ref.status
                if status is not None and status.state == REFUSED and status.error and (
                        "signed" in status.error or "token" in status.error):
                    raise AuthError(f"{ref.host} refused the run's jobs: {status.error}",
                                    status.hint or "set KVCTL_TOKEN as on the agents")
            if polled:
                for ref in pending:
                    if not self.alive(ref.host):
                        ref.missing_at = now()
                pending = [r for r in pending if r.missing_at is None]
            if not pending:
                return True
            if time.monotonic() >= deadline:
                for ref in pending:
                    ref.timed_out = True
                return True
            if stop is not None and stop.is_set():
                return False
            # the next changes end the wait at once; poll_s bounds how late a stop is seen
            wait_s = max(0.0, min(self.poll_s, deadline - time.monotonic()))
