"""``--role target`` for every engine: kvctl's target, foreign targets, one rendezvous.

Not a second kvctl target: kvctl's engine is served by :mod:`kvctl.bench.target.kvctl`'s
:class:`~kvctl.bench.target.kvctl.BenchTarget`, which this set runs beside the foreign
drivers' targets. It sits over the drivers; that one sits under them.

``kvctl bench transfer --role target --engine kvctl --engine mooncake --engine nixl`` serves
all three for one sweep:

- kvctl's engine as :class:`~kvctl.bench.target.kvctl.BenchTarget` does (its metadata server at
  ``--listen``, or ``--metadata``);
- each foreign engine in a spawned process per transport of the sweep it can serve
  (:meth:`~kvctl.bench.engines.foreign.ForeignDriver.launch_target`), bound to the address
  peers reach this host at (``--advertise``, the ``--listen`` host, or for ``0.0.0.0`` the
  first interface address);
- one descriptor document per foreign engine in the same metadata service, under a lease and
  signed with the token (:mod:`kvctl.bench.engines.foreign`). Without kvctl's engine the
  metadata server runs alone, so ``--peer HOST:PORT`` still finds everything.

A transport an engine cannot serve (Mooncake has no shm; NIXL's shm does not cross hosts) is
listed as skipped; an engine that serves nothing is skipped too, and a target that serves
nothing at all is an error. ``close()`` withdraws the descriptors, stops the processes and
the kvctl target, in that order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from kvctl.bench.engines.base import driver_class
from kvctl.bench.engines.foreign import (
    ForeignDriver,
    ForeignTarget,
    descriptor_key,
    encode_descriptor,
)
from kvctl.bench.runner import Skipped
from kvctl.bench.target.child import ChildProcess
from kvctl.bench.target.kvctl import BenchTarget, TargetSpec
from kvctl.errors import UnavailableError
from kvctl.net.advertise import advertised_hosts
from kvctl.net.bind import parse_listen

_log = logging.getLogger("kvctl.bench")

#: Seconds a crashed target's descriptors outlive it.
DESCRIPTOR_TTL_S = 10.0


@dataclasses.dataclass(frozen=True)
class ServedTargets:
    """What a target set serves and where initiators find it.

    Attributes:
        metadata_url: the metadata service holding the descriptors.
        segment: the name they are published under.
        peer: what an initiator passes as ``--peer``.
        address: kvctl's engine's data address, ``None`` when it is not served.
        foreign: the foreign targets, one per engine and transport.
        skipped: engines or transports not served, and why.
        metrics: kvctl's target's metrics URL, when it serves one (``--metrics-port``).
    """

    metadata_url: str
    segment: str
    peer: str
    address: str | None
    foreign: tuple[ForeignTarget, ...]
    skipped: tuple[Skipped, ...]
    metrics: str | None = None

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines served, kvctl first."""
        names = ["kvctl"] if self.address is not None else []
        return tuple(dict.fromkeys(names + [t.engine for t in self.foreign]))


def foreign_host(spec: TargetSpec) -> str:
    """The address foreign targets bind and publish: ``--advertise``, else the listen host,
    else (``0.0.0.0``/``::``) this host's first interface address."""
    host, _ = parse_listen(spec.listen)
    return advertised_hosts(host, spec.advertise)[0]


class TargetSet:
    """The targets of ``--role target`` for ``engines`` over ``transports``.

    Args:
        spec: kvctl's target spec; its region size, listen address, metadata, segment, token
            and advertised hosts apply to every engine.
        engines: engine names (validated).
        transports: the sweep's transports.
    """

    def __init__(self, spec: TargetSpec, engines: Sequence[str], transports: Sequence[str]
                 ) -> None:
        self.spec = spec
        self.engines = tuple(engines)
        self.transports = tuple(transports)
        self._kvctl: BenchTarget | None = None
        self._server: Any = None
        self._client: Any = None
        self._keeper: Any = None
        self._children: list[ChildProcess] = []
        self.info: ServedTargets | None = None

    def start(self) -> ServedTargets:
        """Serve every engine that can serve here and publish the foreign descriptors.

        Raises:
            UsageError: bad listen address or location; the segment name is taken.
            UnavailableError: no engine could serve anything (the reasons are listed).
            MetadataError: the metadata service cannot take the descriptors.
        """
        try:
            self.info = self._start()
        except BaseException:
            self.close()
            raise
        return self.info

    def _start(self) -> ServedTargets:
        from kvctl.metadata import LeaseKeeper, MetadataServer, open_metadata

        spec = self.spec
        address: str | None = None
        metrics: str | None = None
        if "kvctl" in self.engines:
            self._kvctl = BenchTarget(spec)
            info = self._kvctl.start()
            url, peer, address, metrics = info.metadata_url, info.peer, info.address, info.metrics
        elif spec.metadata is None:
            host, port = parse_listen(spec.listen)
            self._server = MetadataServer(host, port, token=spec.token,
                                          advertise=spec.advertise).start()
            url = self._server.url
            peer = url.removeprefix("http://")
        else:
            url, peer = spec.metadata, spec.segment
        skipped: list[Skipped] = []
        served: list[ForeignTarget] = []
        foreign = [e for e in self.engines if e != "kvctl"]
        if foreign:
            self._client = open_metadata(url, token=spec.token)
            self._keeper = LeaseKeeper(self._client, DESCRIPTOR_TTL_S,
                                       name="kvctl-bench-descriptors").start()
            host = foreign_host(spec)
            for name in foreign:
                targets = self._serve(name, host, skipped)
                if targets:
                    self._keeper.publish(descriptor_key(spec.segment, name),
                                         encode_descriptor(name, targets, spec.token))
                    served.extend(targets)
        if address is None and not served:
            reasons = "; ".join(f"{s.engine}{'/' + s.transport if s.transport else ''}: "
                                f"{s.reason}" for s in skipped)
            raise UnavailableError(f"no engine can serve here: {reasons}",
                                   next((s.hint for s in skipped if s.hint), None))
        return ServedTargets(metadata_url=url, segment=spec.segment, peer=peer,
                             address=address, foreign=tuple(served), skipped=tuple(skipped),
                             metrics=metrics)

    def _serve(self, name: str, host: str, skipped: list[Skipped]) -> list[ForeignTarget]:
        """Spawn ``name``'s targets, one per transport it can serve; skips are recorded."""
        cls = driver_class(name)
        reason = cls.unavailable_reason()
        if reason is not None or not issubclass(cls, ForeignDriver):
            skipped.append(Skipped(name, None, f"engine {name} unavailable: "
                                   f"{reason or 'it has no foreign target'}", cls.install_hint))
            return []
        targets: list[ForeignTarget] = []
        for transport in dict.fromkeys(self.transports):
            try:
                child, target = cls.launch_target(self.spec.region_bytes, transport, host,
                                                  self.spec.location, self.spec.nics)
            except UnavailableError as exc:
                _log.info("%s: not serving %s: %s", name, transport, exc.cause)
                skipped.append(Skipped(name, transport, exc.cause, exc.hint))
                continue
            self._children.append(child)
            targets.append(target)
            _log.info("%s target serving %s (%s) at %s", name, transport, target.used,
                      target.session or target.host)
        if not targets:
            skipped.append(Skipped(name, None, f"{name} serves none of "
                                   f"{', '.join(self.transports)} here",
                                   "give a transport it has, e.g. --transport tcp"))
        return targets

    def close(self) -> None:
        """Withdraw the descriptors, stop the foreign targets, then kvctl's. Idempotent."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        client, self._client = self._client, None
        if client is not None:
            client.close()
        children, self._children = self._children, []
        for child in reversed(children):
            child.stop()
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        kvctl, self._kvctl = self._kvctl, None
        if kvctl is not None:
            kvctl.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
