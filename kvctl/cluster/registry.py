"""The registered hosts, as a client sees them: trusted or not, alive, versions, findings.

A host is *live* while its agent's record is in the metadata service (the record rides on
the agent's lease, so a dead agent drops out within its TTL). With a token, a record that is
not signed with it is *untrusted*: listed with the reason, never given work. Version skew is
judged against the most common version among trusted hosts.
"""

from __future__ import annotations

import collections
import dataclasses

from kvctl.cluster.protocol import ClusterKeys, HostRecord, peek, unseal
from kvctl.errors import KvctlError
from kvctl.metadata import MetadataClient


@dataclasses.dataclass(frozen=True)
class HostEntry:
    """One ``hosts/<name>`` record.

    Attributes:
        name: the host's name (its key).
        record: what it registered; for an untrusted host what it *claims* (may be ``None``
            when even that does not decode).
        trusted: signed with our token (always ``True`` without a token).
        problem: why it is untrusted or unreadable, else ``None``.
        skew: its version differs from the cluster's most common one.
    """

    name: str
    record: HostRecord | None
    trusted: bool
    problem: str | None = None
    skew: bool = False

    @property
    def usable(self) -> bool:
        """Whether work may be given to it."""
        return self.trusted and self.record is not None


def read_hosts(client: MetadataClient, keys: ClusterKeys, token: str | None
               ) -> list[HostEntry]:
    """Every registered host, by name.

    Raises:
        MetadataError: the metadata service cannot be reached.
    """
    entries: list[HostEntry] = []
    for key, value in client.list(keys.hosts_prefix).items():
        name = key[len(keys.hosts_prefix):]
        if not name or "/" in name:
            continue
        try:
            record = unseal(key, value, "host", HostRecord, token)
        except KvctlError as exc:
            entries.append(HostEntry(name, peek(key, value, "host", HostRecord), False,
                                     exc.cause))
            continue
        if record.hostname != name:
            entries.append(HostEntry(name, record, False,
                                     f"{key} holds the record of {record.hostname}"))
            continue
        entries.append(HostEntry(name, record, True))
    versions = collections.Counter(e.record.version for e in entries
                                   if e.trusted and e.record is not None)
    common = versions.most_common(1)[0][0] if versions else None
    return [dataclasses.replace(e, skew=e.record is not None and common is not None
                                and e.record.version != common)
            for e in sorted(entries, key=lambda e: e.name)]


def majority_version(entries: list[HostEntry]) -> str | None:
    """The most common kvctl version among trusted hosts."""
    versions = collections.Counter(e.record.version for e in entries if e.usable and e.record)
    return versions.most_common(1)[0][0] if versions else None
