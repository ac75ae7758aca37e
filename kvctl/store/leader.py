"""Who leads the store's masters, as the leader key says: read by clients, written by
:mod:`kvctl.store.master.election`.

Masters sharing one etcd state campaign for ``kvctl/[<cluster>/]store/leader``; its value
names the leader (advertised address, host, pid, run) and its mod revision is the leader's
term. The master's election writes it; a client (:mod:`kvctl.store.rpc`) only reads it to
find whom to connect to, so the key's name, its value and :func:`read_leader` live here,
where both may import them without the client importing the master.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
from pathlib import Path

from kvctl.errors import UsageError
from kvctl.metadata import key_prefix, open_metadata
from kvctl.metadata.etcd import EtcdMetadata

#: The leader key under the cluster's prefix.
LEADER_KEY = "store/leader"


def leader_key(cluster_id: str = "") -> str:
    """The etcd key the masters of ``cluster_id`` campaign for."""
    return key_prefix(cluster_id) + LEADER_KEY


def this_host() -> str:
    """Names this host and pid namespace (a pid means the same process only within it)."""
    boot = pidns = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    with contextlib.suppress(OSError):
        pidns = str(Path("/proc/self/ns/pid").stat().st_ino)
    return f"{socket.gethostname()}/{boot}/{pidns}"


@dataclasses.dataclass(frozen=True)
class LeaderInfo:
    """The leader as its key names it.

    Attributes:
        address: ``host:port`` clients and nodes reach it at.
        term: its term (the revision of its claim).
        host: :func:`this_host` of the leader.
        pid: the leader's process id.
        run: a random name of the leader's run.
    """

    address: str
    term: int
    host: str = ""
    pid: int = 0
    run: str = ""

    @classmethod
    def parse(cls, raw: bytes, term: int) -> LeaderInfo | None:
        """The leader a key value names (``term``: the key's mod revision, the term unless
        the value names one), or ``None`` for a value kvctl did not write."""
        try:
            data = json.loads(raw)
            return cls(str(data["address"]), int(data.get("term", term)),
                       str(data.get("host", "")), int(data.get("pid", 0)),
                       str(data.get("run", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        return f"{self.address} (term {self.term}, pid {self.pid})"


def read_leader(url: str, *, cluster_id: str = "", token: str | None = None,
                timeout_s: float = 2.0) -> LeaderInfo | None:
    """The current leader of ``cluster_id``'s masters on etcd ``url`` (``None``: none).

    Raises:
        MetadataError: etcd cannot be reached.
    """
    client = open_metadata(url, token=token, timeout_s=timeout_s)
    try:
        if not isinstance(client, EtcdMetadata):
            raise UsageError(f"{url} is not etcd: masters elect a leader only on etcd",
                             "use an etcd:// URL")
        entry = client.get_entry(leader_key(cluster_id))
    finally:
        client.close()
    return None if entry is None else LeaderInfo.parse(*entry)
