"""Engines kvctl does not own (Mooncake, NIXL): their targets, and how an initiator finds them.

A foreign engine's target is always a process of its own, spawned with
:class:`~kvctl.bench.target.child.ChildProcess`: on loopback the driver spawns it (zero setup);
across hosts ``kvctl bench transfer --role target --engine ...`` spawns one per engine and
transport (:mod:`kvctl.bench.target.serve`). Either way the target reports a
:class:`ForeignTarget`: where it serves, what it runs, and what an initiator needs to address
its buffer (Mooncake: the session ``host:rpc_port``; NIXL: the agent metadata).

Across hosts the target publishes one descriptor document per engine in the metadata service
the kvctl target uses (its embedded server at ``--listen``, or ``--metadata``), under
``kvctl/bench/<segment>/<engine>`` and a lease, so a crashed target's descriptors vanish. With
a token the document carries an HMAC of its body: an initiator with the token rejects a
document a target without it wrote (the metadata server already refuses unsigned requests
when it has the token), so a token on one side only is an error on both sides.

:class:`ForeignDriver` is the driver half both engines share: the local region (host or GPU
memory, :mod:`kvctl.bench.region`), the target spawned here or looked up, ``prepare``
per transport. Foreign drivers run in a child process
of their own (:mod:`kvctl.bench.isolated`): NIXL 1.5.1 crashes at exit in any process
that created an agent, and that must not become kvctl's exit code.
"""

from __future__ import annotations

import abc
import base64
import binascii
import dataclasses
import json
import logging
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import psutil

from kvctl.bench.engines.base import DriverPlan, EngineDriver, PathInfo
from kvctl.bench.region import LocalRegion, check_gpu
from kvctl.bench.target.child import ChildProcess
from kvctl.errors import AuthError, KvctlError, UnavailableError, UsageError
from kvctl.metadata import key_prefix, open_metadata
from kvctl.nativelog import component_of, send_native_output_to_log
from kvctl.net import auth
from kvctl.net.advertise import route_source
from kvctl.net.bind import LOOPBACK, is_loopback
from kvctl.units import format_size

_log = logging.getLogger("kvctl.bench")

#: Identifier of the descriptor document layout.
DESCRIPTOR_KIND = "kvctl.bench.foreign/1"
#: HMAC context of a descriptor document's signature.
SIGN_CONTEXT = b"kvctl-bench-foreign/1"
#: Seconds a spawned target may take to report ready.
TARGET_START_S = 60.0


@dataclasses.dataclass(frozen=True)
class ForeignTarget:
    """One foreign engine's target, serving one transport.

    Attributes:
        engine: ``mooncake`` or ``nixl``.
        transport: the transport asked for (``tcp``, ``rdma``, ``shm``, ``auto``).
        used: what the target really runs (Mooncake: ``tcp``/``rdma`` as installed; NIXL:
            ``ucx-tcp``, ``ucx-sm`` or ``ucx``).
        host: the address the target serves at (its routable address, or loopback).
        address: virtual address of the target's buffer in its process.
        region_bytes: the buffer's size.
        session: Mooncake's session id, ``host:rpc_port``.
        agent: NIXL's agent name.
        agent_metadata: NIXL's agent metadata (connection info and registered memory).
        location: where the target's buffer is, ``cpu:N`` or ``cuda:N`` (NIXL addresses
            GPU memory as ``VRAM`` of that device).
    """

    engine: str
    transport: str
    used: str
    host: str
    address: int
    region_bytes: int
    session: str = ""
    agent: str = ""
    agent_metadata: bytes = dataclasses.field(default=b"", repr=False)
    location: str = "cpu:0"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the agent metadata base64-encoded)."""
        doc = dataclasses.asdict(self)
        doc["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ForeignTarget:
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: a field is missing or has the wrong type.
        """
        try:
            target = cls(engine=str(doc["engine"]), transport=str(doc["transport"]),
                         used=str(doc["used"]), host=str(doc["host"]),
                         address=int(doc["address"]), region_bytes=int(doc["region_bytes"]),
                         session=str(doc.get("session", "")), agent=str(doc.get("agent", "")),
                         agent_metadata=base64.b64decode(str(doc.get("agent_metadata", "")),
                                                         validate=True),
                         location=str(doc.get("location", "cpu:0")))
        except (KeyError, TypeError, binascii.Error) as exc:
            raise ValueError(f"bad target descriptor: {exc}") from None
        return target


def descriptor_key(segment: str, engine: str) -> str:
    """The metadata key of ``engine``'s descriptor document for a target named ``segment``."""
    return f"{key_prefix()}bench/{segment}/{engine}"


def _body(targets: Sequence[ForeignTarget]) -> bytes:
    return json.dumps([t.to_json() for t in targets], sort_keys=True,
                      separators=(",", ":")).encode()


def encode_descriptor(engine: str, targets: Sequence[ForeignTarget], token: str | None) -> bytes:
    """The descriptor document of ``engine``'s targets, signed when there is a token."""
    body = _body(targets)
    signature = auth.respond(token, body, SIGN_CONTEXT).hex() if token else None
    return json.dumps({"kind": DESCRIPTOR_KIND, "engine": engine,
                       "targets": [t.to_json() for t in targets],
                       "signature": signature}).encode()


def decode_descriptor(raw: bytes, token: str | None, *, where: str) -> dict[str, ForeignTarget]:
    """The targets of a descriptor document by transport, its signature checked.

    Raises:
        AuthError: with a token, the document is unsigned or signed with another token.
        UsageError: the document is not a descriptor kvctl wrote.
    """
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("kind") != DESCRIPTOR_KIND:
            raise ValueError(f"kind is not {DESCRIPTOR_KIND}")
        targets = [ForeignTarget.from_json(t) for t in doc["targets"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"the engine descriptor at {where} is unreadable: {exc}",
                         "run the same kvctl version on both hosts") from None
    if token is not None:
        signature = doc.get("signature")
        if not isinstance(signature, str):
            raise AuthError(f"the engine descriptor at {where} is not signed: the target runs "
                            "without a token, this host has one",
                            "set the same KVCTL_TOKEN on both hosts (or on neither)")
        try:
            answer = bytes.fromhex(signature)
        except ValueError:
            answer = b""
        if not auth.check_response(token, _body(targets), SIGN_CONTEXT, answer):
            raise AuthError(f"the engine descriptor at {where} is signed with another token",
                            "set the same KVCTL_TOKEN on both hosts")
    return {t.transport: t for t in targets}


def rendezvous(plan: DriverPlan) -> tuple[str, str]:
    """The metadata URL and segment name where ``plan``'s peer publishes its descriptors.

    Without ``--metadata`` the peer ``HOST:PORT`` is the target's own metadata server and the
    segment has its default name; with it, the peer is the segment's name.
    """
    from kvctl.bench.target.kvctl import DEFAULT_SEGMENT

    if plan.peer is None:
        raise UsageError("a loopback plan has no rendezvous", "give a peer")
    if plan.metadata is not None:
        return plan.metadata, plan.peer
    return f"http://{plan.peer}", DEFAULT_SEGMENT


def fetch_targets(plan: DriverPlan, engine: str) -> dict[str, ForeignTarget]:
    """``engine``'s targets that ``plan``'s peer serves, by transport.

    Raises:
        UnavailableError: the peer serves no target of that engine (hint: how to start one).
        MetadataError: the metadata service is unreachable or refused us (token).
        AuthError: the descriptor's signature does not match our token.
    """
    url, segment = rendezvous(plan)
    key = descriptor_key(segment, engine)
    with open_metadata(url, token=plan.token) as client:
        raw = client.get(key)
    if raw is None:
        raise UnavailableError(
            f"the target at {plan.peer} serves no {engine} engine ({key} is absent in {url})",
            f"start the target with --engine {engine} (e.g. kvctl bench transfer --role target "
            f"--engine kvctl --engine {engine} --listen 0.0.0.0:7400)")
    return decode_descriptor(raw, plan.token, where=f"{url} {key}")


def local_host_toward(peer_host: str) -> str:
    """This host's address that reaches ``peer_host``: loopback for a loopback peer.

    Raises:
        UnavailableError: no route to the peer.
    """
    if is_loopback(peer_host):
        return peer_host
    source = route_source(peer_host)
    if source is None:
        raise UnavailableError(f"no route from this host to {peer_host}",
                               "check the target's address and this host's routes "
                               f"(ip route get {peer_host})")
    return source


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (``None``: no interface does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def stdout_to_stderr() -> None:
    """In an engine's process: native libraries' output (fd 1 and 2: UCX's errors, NIXL's
    INFO lines, Mooncake's glog) goes to this process's log file (:mod:`kvctl.nativelog`,
    named after the process), Python's stderr stays on the terminal, and kvctl's stdout
    carries only its results (``--json``)."""
    send_native_output_to_log(component_of(multiprocessing.current_process().name))


def launch_target(target_main: Callable[..., None], args: tuple[Any, ...], *, name: str,
                  hint: str) -> tuple[ChildProcess, ForeignTarget]:
    """Spawn a foreign target (``target_main(*args, conn)``) and wait until it serves.

    The child sends ``("ready", ForeignTarget)`` or ``("error", cause, hint, unavailable)``.

    Raises:
        UnavailableError: it cannot serve here (or did not start in time).
        KvctlError: it failed for another reason.
    """
    child = ChildProcess(target_main, args, name=name, hint=hint)
    message = child.start(TARGET_START_S)
    if message[0] != "ready":
        child.stop()
        cls = UnavailableError if message[3] else KvctlError
        raise cls(message[1], message[2])
    target: ForeignTarget = message[1]
    return child, target


class ForeignDriver(EngineDriver):
    """The shared half of the Mooncake and NIXL drivers (the local region, a target per
    transport).

    Subclasses say which transports they have (:meth:`check_transport`), how to spawn a
    target (:meth:`launch_target`), and how to connect this side to one (:meth:`_connect`,
    undone by :meth:`_release`).
    """

    isolated: ClassVar[bool] = True
    #: The engine's name in messages (``Mooncake``).
    label: ClassVar[str]

    def __init__(self) -> None:
        self._plan: DriverPlan | None = None
        self._published: dict[str, ForeignTarget] | None = None
        self._target: ForeignTarget | None = None
        self._transport: str | None = None
        self._child: ChildProcess | None = None
        self._info: PathInfo | None = None
        self._region: LocalRegion | None = None

    @classmethod
    def check_locations(cls, plan: DriverPlan) -> None:
        """Refuse buffer locations this engine cannot register (both sides ``cpu:N`` or
        ``cuda:N``; GPUs checked here when this host allocates them).

        Raises:
            UsageError: a ``file:PATH`` side.
            UnavailableError: a GPU this host does not have.
        """
        for what, where in (("local", plan.local), ("remote", plan.remote)):
            if where.kind not in ("cpu", "cuda"):
                raise UsageError(f"the {cls.label} driver benchmarks cpu:N and cuda:N memory, "
                                 f"not {where} ({what})",
                                 f"use --{what}-location cpu:0 (or cuda:0)")
            if where.kind == "cuda" and (what == "local" or plan.peer is None):
                check_gpu(where.index)

    @classmethod
    @abc.abstractmethod
    def check_transport(cls, transport: str, *, cross_host: bool) -> None:
        """Raise :class:`UnavailableError` when this engine has no ``transport`` (``cross_host``:
        for a peer on another host)."""

    @classmethod
    @abc.abstractmethod
    def launch_target(cls, region_bytes: int, transport: str, host: str,
                      location: str = "cpu:0", nics: Sequence[str] = ()
                      ) -> tuple[ChildProcess, ForeignTarget]:
        """Spawn a target serving ``region_bytes`` at ``location`` (``cpu:N``, ``cuda:N``)
        over ``transport`` at ``host``, on the RDMA NICs ``nics`` when given (``--nic``;
        else topo's ranking for ``location``).

        Raises:
            UnavailableError: the engine cannot serve that transport or location here.
        """

    @abc.abstractmethod
    def _connect(self, target: ForeignTarget) -> PathInfo:
        """Set up this side (engine, local region) to reach ``target``; return the path."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Undo :meth:`_connect` (keeps the local region). Safe to call twice."""

    def start(self, plan: DriverPlan) -> None:
        self.check_locations(plan)
        self._plan = plan
        if plan.peer is not None:
            self._published = fetch_targets(plan, self.name)

    def prepare(self, transport: str) -> PathInfo:
        plan = self._require_plan()
        if transport == self._transport and self._info is not None:
            return self._info
        self.check_transport(transport, cross_host=plan.peer is not None)
        self._disconnect()
        target = self._target_for(transport)
        try:
            info = self._connect(target)
        except BaseException:
            self._disconnect()
            raise
        self._target, self._transport, self._info = target, transport, info
        return info

    def _ready(self, transport: str) -> None:
        if self._transport != transport:
            self.prepare(transport)

    def _target_for(self, transport: str) -> ForeignTarget:
        plan = self._require_plan()
        if self._published is None:
            self._child, spawned = self.launch_target(plan.region_bytes, transport, LOOPBACK,
                                                      str(plan.remote), plan.nics)
            return spawned
        target = self._published.get(transport)
        if target is None:
            served = ", ".join(sorted(self._published)) or "none"
            raise UnavailableError(
                f"the target at {plan.peer} serves {self.label} over {served}, not {transport}",
                f"start the target with --transport {transport} (and --engine {self.name})")
        if target.region_bytes < plan.region_bytes:
            raise UsageError(
                f"the {self.label} target at {plan.peer} has "
                f"{format_size(target.region_bytes)}, the sweep needs "
                f"{format_size(plan.region_bytes)} (largest block x largest batch x threads)",
                "run the initiator command the target printed, or restart the target with "
                "this sweep's --block-size/--batch-size/--threads")
        if target.location.partition(":")[0] != plan.remote.kind:
            raise UsageError(
                f"the {self.label} target at {plan.peer} serves {target.location} memory, "
                f"the sweep asks for --remote-location {plan.remote}",
                f"give --remote-location {target.location}, or restart the target with "
                f"--remote-location {plan.remote}")
        return target

    def _local_region(self, extra_bytes: int) -> LocalRegion:
        """The local region (``region_bytes + extra_bytes`` at the plan's local location),
        allocated on first use and kept across transports."""
        if self._region is None:
            plan = self._require_plan()
            self._region = LocalRegion(plan.region_bytes + extra_bytes, plan.local)
        return self._region

    def local_view(self, offset: int, length: int) -> memoryview:
        if self._region is None:
            raise UsageError(f"{self.label} driver not prepared", "call prepare() first")
        return self._region.view(offset, length)

    def sync_local(self, offset: int, length: int) -> None:
        if self._region is not None:
            self._region.sync(offset, length)

    def refresh_local(self, offset: int, length: int) -> None:
        if self._region is not None:
            self._region.refresh(offset, length)

    def _require_plan(self) -> DriverPlan:
        if self._plan is None:
            raise UsageError(f"{self.label} driver not started", "call start() first")
        return self._plan

    def _disconnect(self) -> None:
        self._transport = None
        self._target = None
        self._info = None
        self._release()
        child, self._child = self._child, None
        if child is not None:
            child.stop()

    def close(self) -> None:
        self._disconnect()
        region, self._region = self._region, None
        if region is not None:
            region.close()
