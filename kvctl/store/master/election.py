"""Leader election of store masters that share one etcd state (``--state etcd://...``).

Every master started with the same etcd URL and cluster id campaigns for one key,
``kvctl/[<cluster>/]store/leader``, whose value names the leader (its advertised address,
host and pid; :mod:`kvctl.store.leader` has the key, its value and how clients read it):

- **Claim**: a lease of ``ttl_s`` is granted, then one transaction puts the key under that
  lease only if it is absent (etcd compare ``create_revision == 0``), and puts
  ``.../store/term`` (no lease) beside it. Exactly one master wins; the transaction's
  revision, which the term key keeps as its mod revision, is its **term**, increasing from
  leader to leader (every claim is a newer etcd revision).
- **Standby**: a master that lost reads the key every ``poll_s`` and claims it once it is
  gone (the leader's lease expired, or it resigned). It loads nothing, writes nothing and
  listens on nothing meanwhile. A leader recorded on this very host (same hostname, boot
  and pid namespace) whose pid is gone is replaced at once (compare on its mod revision):
  a master restarted after a crash does not wait out the TTL.
- **Leading**: a keeper renews the lease every ``ttl_s / 3`` and reads the term key back.
  A master may serve while its last renewal is under ``ttl_s`` old (measured from before
  the renewal was sent, so never longer than etcd keeps the lease). Past that, the next
  request renews first (one at a time): a master SIGSTOPped past its TTL learns whether
  it lost before it answers anything. While etcd cannot be reached at all, the master
  keeps serving reads (nobody can be elected through an etcd that answers no one); its
  writes fail anyway.
- **A lapsed lease** (etcd stalled or out of reach for longer than the TTL, the leader
  key gone with it): the leader takes the key back under a new lease, in one transaction
  that also requires the term key unchanged, so it keeps leading in the same term only
  if no other master claimed in between.
- **Fencing**: every state transaction of the leader carries ``mod_revision(term key) ==
  term`` (:class:`~kvctl.store.state.writebehind.MetadataState`), so once another master has
  claimed, nothing the old leader sends applies, whether it was paused, cut off or its
  request was still on the wire when it died.
- **Nodes follow the lease, not the grace**: a leader whose renewals have failed for
  ``ttl_s`` (cut off from etcd while etcd answers the others) may serve reads, but it
  refuses storage nodes (:meth:`Election.sure`): they register with whoever the leader
  key names, so a standby that claims meanwhile has the nodes and can take puts.
- **Deposed**: another master's claim (seen in the term key, by a failed take-back or by
  a fenced write) ends the leadership for good (:meth:`Election.check` answers why);
  ``kvctl store master`` then stops serving and exits, and a supervisor starting it again
  makes it a standby.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

from kvctl.errors import UsageError
from kvctl.metadata import MetadataError, key_prefix, open_metadata
from kvctl.metadata.base import LeaseExpiredError, LeaseId
from kvctl.metadata.etcd import EtcdMetadata
from kvctl.store.leader import LeaderInfo, leader_key, this_host
from kvctl.transfer.shmfiles import pid_alive

_log = logging.getLogger("kvctl.store.master")

#: Default lease of the leader key, seconds: a dead leader is replaced about this long
#: after its last renewal.
DEFAULT_TTL_S = 5.0
#: The key whose mod revision is the current term (written by every claim, no lease).
TERM_KEY = "store/term"


class Election:
    """One master's part in the election (see the module docstring). Thread-safe.

    Args:
        url: the etcd URL of the master state.
        address: where this master serves (what clients and nodes are told).
        cluster_id: key namespace of the store.
        token: unused by etcd (kept for kvctl's own metadata server).
        ttl_s: the leader key's lease, seconds.
        poll_s: how often a standby reads the key (default ``min(1, ttl_s / 4)``).

    Raises:
        UsageError: ``url`` is not etcd, or a TTL that is not positive.
    """

    def __init__(self, url: str, *, address: str, cluster_id: str = "",
                 token: str | None = None, ttl_s: float = DEFAULT_TTL_S,
                 poll_s: float | None = None) -> None:
        if not ttl_s > 0:
            raise UsageError(f"leader lease {ttl_s} s is not positive",
                             "set store.ha_ttl (KVCTL_STORE_HA_TTL) to a few seconds")
        self.ttl_s = ttl_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, ttl_s / 4)
        client = open_metadata(url, token=token, timeout_s=min(2.0, max(0.2, ttl_s / 2)))
        if not isinstance(client, EtcdMetadata):
            client.close()
            raise UsageError(f"{url} is not etcd: masters elect a leader only on etcd",
                             "use an etcd:// URL, or run one master at a time")
        self._etcd = client
        self.url = url
        self.key = leader_key(cluster_id)
        self.term_key = key_prefix(cluster_id) + TERM_KEY
        self.address = address
        self._run = secrets.token_hex(8)
        self._fields = {"address": address, "host": this_host(), "pid": os.getpid(),
                        "run": self._run}
        #: this master's term once it leads (the leader key's mod revision), else 0.
        self.term = 0
        self._lease: LeaseId | None = None
        self._check = threading.Lock()  # one renewal at a time
        self._valid_until = 0.0
        self._reachable = True
        self._result_at = 0.0
        self._deposed: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._listeners_lock = threading.Lock()  # a listener is called once, late or not
        self._ended = threading.Event()
        self._keeper: threading.Thread | None = None
        self._seen: tuple[int, bool] | None = None  # the last leader term logged

    # ------------------------------------------------------------------ standby

    def campaign(self, stop: threading.Event) -> bool:
        """Stand by until this master holds the leader key (``True``) or ``stop`` is set
        (``False``)."""
        unreachable = False
        while not stop.is_set():
            try:
                if self.try_once():
                    return True
                unreachable = False
            except MetadataError as exc:
                if not unreachable:
                    _log.warning("store master: campaigning through %s failed (%s); "
                                 "retrying", self.url, exc.cause)
                unreachable = True
            stop.wait(self.poll_s)
        return False

    def try_once(self, *, standby: bool = True) -> bool:
        """Claim the leader key if nobody holds it (``True``: this master leads now, its
        lease kept from here on), else ``False`` (:meth:`leader` names who leads).
        ``standby=False``: a master that will not wait (``store serve``) logs no
        "standby ... taking over once its lease expires".

        Raises:
            MetadataError: etcd cannot be reached.
        """
        if not self._try(standby=standby):
            return False
        self._keeper = threading.Thread(target=self._keep, daemon=True,
                                        name="kvctl-master-lease")
        self._keeper.start()
        return True

    def leader(self) -> LeaderInfo | None:
        """Who holds the leader key now (``None``: nobody, or a value kvctl did not write)."""
        entry = self._etcd.get_entry(self.key)
        return None if entry is None else LeaderInfo.parse(*entry)

    def _try(self, *, standby: bool = True) -> bool:
        entry = self._etcd.get_entry(self.key)
        replace = 0
        if entry is not None:
            info = LeaderInfo.parse(*entry)
            if info is None or not self._gone(info):
                if standby:
                    self._standing_by(info, entry[1])
                return False
            replace = entry[1]
            _log.warning("store master: leader %s ran on this host and is gone; taking "
                         "over without waiting for its lease", info.describe())
        won, term = self._claim(replace=replace)
        if not won:
            entry = self._etcd.get_entry(self.key)
            if entry is not None and standby:
                self._standing_by(LeaderInfo.parse(*entry), term)
            return False
        self.term = term
        _log.warning("store master: leading as %s (term %d, lease %g s)", self.address,
                     term, self.ttl_s)
        return True

    def _claim(self, *, replace: int = 0, term: int = 0) -> tuple[bool, int]:
        """Grant a lease and claim the key under it (see :meth:`EtcdMetadata.claim`);
        when won, the lease is this master's and its validity starts."""
        sent = time.monotonic()
        lease = self._etcd.grant_lease(self.ttl_s)
        try:
            # A take-back names its term (the key's revision is no longer the term's).
            value = json.dumps({**self._fields, **({"term": term} if term else {})})
            won, revision = self._etcd.claim(self.key, value.encode(), lease=lease,
                                             term_key=self.term_key, replace=replace,
                                             term=term)
        except BaseException:
            with contextlib.suppress(MetadataError):
                self._etcd.revoke(lease)
            raise
        if not won:
            with contextlib.suppress(MetadataError):
                self._etcd.revoke(lease)
            return False, revision
        self._lease = lease
        self._valid_until = sent + self.ttl_s
        self._result_at = time.monotonic()
        return True, revision

    def _gone(self, info: LeaderInfo) -> bool:
        """Whether ``info`` names a master of this host whose process has ended."""
        return (info.host == this_host() and info.pid > 0 and info.pid != os.getpid()
                and not pid_alive(info.pid))

    def _standing_by(self, info: LeaderInfo | None, revision: int) -> None:
        if self._seen == (revision, info is None):
            return
        self._seen = (revision, info is None)
        if info is None:
            _log.warning("store master: standby; %s holds a value kvctl did not write",
                         self.key)
        else:
            _log.warning("store master: standby; leader is %s; taking over once its "
                         "lease (up to %g s) expires", info.describe(), self.ttl_s)

    # ------------------------------------------------------------------ leading

    @property
    def fence(self) -> tuple[str, int]:
        """``(term key, term)``: the condition every state write of this leader carries."""
        return self.term_key, self.term

    def on_deposed(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(why)`` once when the leadership ends (from any thread); at
        once when it already has (``store serve`` registers after starting its node,
        which a stalled etcd may outlast: it would serve deposed, never told)."""
        with self._listeners_lock:
            why = self._deposed
            if why is None:
                self._listeners.append(listener)
                return
        listener(why)

    def _keep(self) -> None:
        while not self._ended.wait(self.ttl_s / 3):
            with self._check:
                self._renew()
            if self._deposed is not None:
                return

    def _renew(self) -> None:
        """One lease renewal and a read of the term key back (``_check`` held)."""
        if self._deposed is not None or self._lease is None:
            return
        sent = time.monotonic()
        try:
            try:
                self._etcd.keepalive(self._lease)
                lapsed = self._etcd.get_entry(self.key) is None  # (deleted by hand)
            except LeaseExpiredError:
                lapsed = True
            if lapsed:
                self._take_back()
                return
            entry = self._etcd.get_entry(self.term_key)
        except MetadataError as exc:
            if self._reachable:
                _log.warning("store master (term %d): cannot renew its lease: %s",
                             self.term, exc.cause)
            self._reachable = False
            self._result_at = time.monotonic()
            return
        self._result_at = time.monotonic()
        if entry is None or entry[1] != self.term:
            self._lost(0 if entry is None else entry[1])
            return
        if not self._reachable:
            _log.warning("store master (term %d): lease renewed again", self.term)
        self._reachable = True
        self._valid_until = sent + self.ttl_s

    def _take_back(self) -> None:
        """The lease lapsed (or the key is gone): claim the key again in this term if no
        other master claimed since, else this master was deposed."""
        won, term = self._claim(term=self.term)
        self._reachable = True
        if won:
            _log.warning("store master (term %d): its lease had lapsed (etcd stalled or "
                         "out of reach for more than %g s) and no other master claimed "
                         "since: leading again in the same term", self.term, self.ttl_s)
        else:
            self._lost(term)

    def _lost(self, term: int) -> None:
        holder = None
        with contextlib.suppress(MetadataError):
            entry = self._etcd.get_entry(self.key)
            holder = None if entry is None else LeaderInfo.parse(*entry)
        who = holder.describe() if holder is not None else "another master"
        self.depose(f"{who} claimed the lead (term {term} > {self.term})" if term else
                    "the term key is gone")

    def check(self) -> str | None:
        """``None`` while this master may serve; else why it may not (it was deposed).
        Cheap while the lease is fresh; past it, the lease is renewed first."""
        if self._deposed is not None:
            return self._deposed
        now = time.monotonic()
        if now < self._valid_until:
            return None
        if not self._reachable and now - self._result_at < self.ttl_s:
            return None  # etcd answers nobody: nobody else can have been elected
        with self._check:
            if self._result_at < now:  # nothing newer came while we waited: renew now
                self._renew()
        return self._deposed

    def sure(self) -> str | None:
        """``None`` while this master *knows* it leads: its last lease renewal was sent
        under ``ttl_s`` ago, so no other master can have claimed; else why not. Never
        blocks (it reads what the keeper last learnt), so a request handler may ask it
        under the master's lock.

        :meth:`check` lets a master cut off from etcd go on serving reads (an etcd that
        answers nobody elects nobody); but etcd may answer everyone else (a partition),
        and the standby that claims then needs the storage nodes: they must not go on
        heartbeating this master. Nodes are served only while this is ``None``
        (:meth:`~kvctl.store.master.liveness.LivenessMixin.fence_nodes`), so they move to
        whoever the leader key names.
        """
        if self._deposed is not None:
            return self._deposed
        late = time.monotonic() - self._valid_until
        if late < 0:
            return None
        return (f"its lease on {self.url} was last renewed {self.ttl_s + late:.1f} s ago "
                f"(lease {self.ttl_s:g} s): another master may lead now")

    def depose(self, why: str) -> None:
        """End the leadership for good (``why`` is logged and answered to requests)."""
        listeners: list[Callable[[str], None]] = []
        with self._listeners_lock:
            first = self._deposed is None
            if first:
                self._deposed = why
                listeners, self._listeners = self._listeners, []
        if first:
            _log.error("store master (term %d): deposed: %s; it stops serving", self.term,
                       why)
        self._ended.set()
        for listener in listeners:
            listener(why)

    @property
    def deposed(self) -> str | None:
        """Why the leadership ended, or ``None`` while it holds (or never started)."""
        return self._deposed

    def close(self) -> None:
        """Resign (the lease is revoked, so a standby takes over at its next read) and
        close the etcd client. Safe to call twice."""
        self._ended.set()
        if self._keeper is not None:
            self._keeper.join(timeout=3)
        lease, self._lease = self._lease, None
        if lease is not None and self._deposed is None:
            with contextlib.suppress(MetadataError):
                self._etcd.revoke(lease)
                _log.info("store master (term %d): resigned", self.term)
        self._etcd.close()
