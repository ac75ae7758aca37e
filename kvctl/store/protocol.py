"""The master protocol: versioned, size-limited msgpack messages over length-prefixed frames.

Every message travels in one :class:`~kvctl.net.framing.FrameCodec` frame (magic ``KVSM``)
whose *kind* byte is the protocol version (:data:`PROTOCOL_VERSION`); the payload is one
msgpack-encoded :mod:`msgspec` Struct from the :data:`Request` or :data:`Reply` tagged
unions. msgspec was chosen over json because it decodes straight into typed Structs and
rejects wrong shapes and types during decoding (so a malformed request becomes one error
reply, not a crash deep in the master), it carries ``bytes`` natively, and it encodes and
decodes a small message in about a microsecond: the master sits on every get and put, so
its codec is on the latency path.

Connection: the server speaks first with :class:`Hello` (version, whether a token is
required, a nonce, the frame limit). The client answers :class:`Login` (the HMAC of the
nonce, see :mod:`kvctl.net.auth`) and gets :class:`Ok` or :class:`Fail` (then the server
closes). After that each request gets exactly one reply, in order, except requests sent
of kinds that never get one (:class:`Commit`, :class:`Release`, :class:`PutAt`; the first
and last get one when they set ``ack``: once their objects are durable, or naming the keys
the master did not take, see :class:`Acked`). kvctl's client always sets ``ack``: a put
returns only once its object is durable in the master's state.

Attached bytes: a master serving a storage node in its own process (``kvctl store serve``)
says so in :attr:`Hello.attached_bytes`. A :class:`Get` with ``attached_bytes`` set may then
be answered with the bytes of some objects right behind the :class:`GetReply` frame: raw, in
the order of :attr:`GetReply.attached`, each exactly its slot's ``size`` bytes, at most the
smaller of both limits in all (never on a tenant's connection). The client checks them
against the slot's checksum like bytes read from the node (they are the node's bytes; the
master's core never reads them).

Limits: a frame over ``max_frame_bytes`` (default 4 MiB) is refused with a ``too_large``
error reply and the connection is closed; a frame that does not decode gets a
``bad_request`` reply and the connection stays usable.
"""

from __future__ import annotations

import socket
from typing import Final

import msgspec

from kvctl.net import auth
from kvctl.net.framing import FrameCodec, FrameError

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"KVSM"
#: Default largest master message, in bytes (master messages never carry object bytes).
DEFAULT_MAX_FRAME_BYTES: Final = 4 << 20
#: Largest key, in bytes of UTF-8.
MAX_KEY_BYTES: Final = 4096
#: Most keys in one batch request.
MAX_BATCH: Final = 4096
AUTH_CONTEXT: Final = b"kvctl-store/1"


class Struct(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Base of every message (encoded as msgpack arrays: smaller and faster than maps)."""


# ---- shared shapes -----------------------------------------------------------------------


class Location(Struct, frozen=True):
    """Where one replica's bytes are: ``size`` bytes at ``offset`` of a node's segment."""

    node_id: str
    segment: str
    offset: int
    size: int


class NodeAddress(Struct, frozen=True):
    """How clients reach a node's data path: its transfer-engine segment, the engine's
    endpoint and the segment descriptor (JSON, as the engine publishes it)."""

    node_id: str
    segment: str
    endpoint: str
    host_id: str
    descriptor: bytes = b""


class ObjectInfo(Struct, frozen=True):
    """Metadata of one object as the master reports it (``tier`` is dram, ssd or dram+ssd)."""

    key: str
    size: int
    checksum: int
    version: int
    replicas: list[str]
    ssd_replicas: list[str]
    tier: str
    pinned: bool
    lease_remaining_s: float
    age_s: float


class PutItem(Struct, frozen=True):
    key: str
    size: int
    checksum: int


class PutSlot(Struct, frozen=True, tag="ps"):
    """Where to write one object (``skip`` when the same bytes are already stored)."""

    key: str
    version: int
    locations: list[Location]
    skip: bool = False


class GetSlot(Struct, frozen=True, tag="gs"):
    """Where to read one object; ``pending`` while its put is not committed yet."""

    key: str
    size: int
    checksum: int
    version: int
    locations: list[Location]
    pending: bool = False
    #: the object's shared-tier file, as the master names it (empty: none); a client reads
    #: it directly when no location is given or none could be read (kvctl.store.sharedtier)
    shared: str = ""
    #: ``shared`` is a pack file and the object's record starts at this byte of it (-1:
    #: the file is the object's own)
    shared_at: int = -1


class ErrorInfo(Struct, frozen=True, tag="err"):
    """A per-item or whole-request failure.

    ``code``: not_found, evicted, bad_request, too_large, unauthorized, forbidden (a tenant
    named a key outside its namespace, or asked for a node-only operation), full, version,
    unavailable, internal; in a get reply also reply_full (:data:`REPLY_FULL`: left out of
    a full reply, ask again).
    """

    code: str
    cause: str
    hint: str = ""


class NodeStatus(Struct, frozen=True):
    node_id: str
    alive: bool
    capacity_bytes: int
    used_bytes: int
    objects: int
    ssd_capacity_bytes: int
    ssd_used_bytes: int
    ssd_objects: int
    ssd_policy: str
    endpoint: str
    last_heartbeat_s: float
    #: ``off`` (no SSD tier), ``ok``, or ``full`` (the disk refused a write: offload to this
    #: node's SSD is paused and retried later; DRAM keeps serving).
    ssd_state: str = "off"
    #: Why the SSD tier is not ``ok`` (the node's last error), else empty.
    ssd_error: str = ""
    #: ``alive``, ``suspect`` (silent past the node timeout: no placements, no reads, its
    #: objects kept until its grace ends), ``restored`` (from a restarted master's state,
    #: not registered again yet) or ``dropped`` (in :attr:`StoreStatus.dropped` only).
    state: str = ""
    #: for a dropped node, why it was dropped.
    dropped_why: str = ""


class StoreStatus(Struct, frozen=True):
    nodes: list[NodeStatus]
    objects: int
    capacity_bytes: int
    used_bytes: int
    evictions: int
    ssd_evictions: int
    lost: int
    #: objects per tier (``dram``, ``ssd``, ``dram+ssd``, ``shared``: only in the shared
    #: tier); they add up to ``objects``.
    tiers: dict[str, int]
    state: str
    high_watermark: float
    evict_ratio: float
    #: bytes held by clients' reservations (see :class:`Reserve`), included in used_bytes.
    reserved_bytes: int = 0
    #: nodes dropped lately (state ``dropped``, ``last_heartbeat_s`` since they were last
    #: heard from, ``dropped_why``), most recent last.
    dropped: list[NodeStatus] = msgspec.field(default_factory=list)
    #: the shared tier (``kvctl store master --shared-tier``), ``None`` without one.
    shared: SharedTierStatus | None = None
    #: objects kept but unreadable now: every copy is on a node that is not alive
    #: (suspect), none in the shared tier; lost if the node is dropped (``lost`` counts the
    #: objects already forgotten). ``capacity_bytes``/``used_bytes`` count alive nodes only.
    unreadable: int = 0


class SharedTierStatus(Struct, frozen=True):
    """The shared tier's usage and health (see :mod:`kvctl.store.sharedtier`)."""

    root: str
    policy: str
    used_bytes: int
    capacity_bytes: int
    files: int
    max_files: int
    #: objects evicted from the tier by its quota (least recently used first)
    evictions: int = 0
    #: files written / writes that failed
    writes: int = 0
    write_errors: int = 0
    #: orphan files (named by no index entry) and evicted files deleted so far
    purged: int = 0
    #: files waiting to be deleted (evicted, removed, or found orphaned)
    purge_backlog: int = 0
    #: failures by errno name (ENOSPC, EDQUOT, ESTALE, EIO, other), and reported files found
    #: bad (ENOENT: missing, corrupt: torn, truncated, flipped or foreign)
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    #: ``ok`` or ``full`` (a write was refused for lack of space: writes paused a while)
    state: str = "ok"
    last_error: str = ""
    #: the file system's free and total bytes (statvfs), -1 when unknown
    fs_free_bytes: int = -1
    fs_total_bytes: int = -1
    #: files clients reported bad / reports not taken (the verification queue was full,
    #: or the file was verified good a moment ago) / reported files the master found bad
    #: itself and dropped from the index (counted in ``errors`` as ``ENOENT`` or
    #: ``corrupt`` too)
    reports: int = 0
    reports_dropped: int = 0
    bad_files: int = 0
    #: objects smaller than this are packed several to a file (0: off); how many of the
    #: ``files`` are packs, and the copies they hold
    pack_below: int = 0
    packs: int = 0
    packed_objects: int = 0



# ---- tasks the master hands to nodes --------------------------------------------------------


class Task(Struct, frozen=True):
    """A node job: ``persist`` (DRAM → SSD), ``load`` (SSD → DRAM), ``drop`` (SSD file),
    ``shared`` (DRAM → the shared tier's file ``path``) or ``pack`` (several objects'
    DRAM → one pack file ``path`` of the shared tier).

    ``free_after`` on persist: the DRAM range is freed by the master when the job is done
    (write-back eviction).
    """

    task_id: int
    op: str
    key: str
    version: int
    offset: int
    size: int
    checksum: int
    free_after: bool = False
    #: op ``shared``: the shared-tier file to write, as the master names it.
    path: str = ""
    #: op ``pack``: the objects written as records of the pack file ``path`` (``key`` is
    #: empty, ``version`` the pack's id, ``offset``, ``size`` and ``checksum`` 0)
    entries: list[PackEntry] = msgspec.field(default_factory=list)


class PackEntry(Struct, frozen=True, array_like=True):
    """One object of a ``pack`` task: its DRAM range on the node and its record's byte
    ``at`` in the pack; ``free_after`` as a ``shared`` task's (a write-back)."""

    key: str
    version: int
    offset: int
    size: int
    checksum: int
    at: int
    free_after: bool = False


class TaskReport(Struct, frozen=True):
    """Outcome of a task: ``ok``, or ``corrupt`` (the SSD copy failed its checksum), or
    an ``error`` text; ``full`` when the SSD refused the write for lack of space."""

    task_id: int
    ok: bool
    corrupt: bool = False
    error: str = ""
    full: bool = False
    #: still running (a shared-tier write on the node's writer thread): the task stays in
    #: flight and its report comes with a later heartbeat.
    pending: bool = False
    #: op ``pack`` (``ok``): indices of the entries not written (their DRAM changed)
    failed: list[int] = msgspec.field(default_factory=list)


# ---- requests ------------------------------------------------------------------------------


class Login(Struct, frozen=True, tag="login"):
    answer: bytes
    role: str = "client"
    #: the client's challenge: the master's :class:`Ok` answers it with ``proof``
    client_nonce: bytes = b""


class Put(Struct, frozen=True, tag="put"):
    items: list[PutItem]
    replicas: int = 1


class Reserve(Struct, frozen=True, tag="reserve"):
    """Space the client places puts in itself: ``size`` bytes on ``replicas`` distinct live
    nodes (the master may grant less; see :class:`Reservation`)."""

    size: int
    replicas: int = 1


class PutAt(Struct, frozen=True, tag="put_at"):
    """Objects the client wrote inside its reservation (no reply unless ``ack``): each
    ``keys[i]`` of ``sizes[i]`` bytes with ``checksums[i]`` at ``offsets[i]`` from the start
    of every replica's range. Such objects are visible once the master takes this message (like a
    :class:`Commit`). ``end`` gives the rest of the reservation back once the master has
    taken ``count`` PutAt messages for it, this one included (a client's reports travel on
    several connections, so the end may arrive before some of them)."""

    reservation: int
    keys: list[str] = msgspec.field(default_factory=list)
    sizes: list[int] = msgspec.field(default_factory=list)
    checksums: list[int] = msgspec.field(default_factory=list)
    offsets: list[int] = msgspec.field(default_factory=list)
    end: bool = False
    count: int = 0
    #: ask for a reply once the master has recorded these objects durably (its journal
    #: or etcd took them): :class:`Ok`, :class:`Acked` naming the keys it did not take (a
    #: node of the reservation is not alive, the reservation is gone, a key outside its
    #: unused space), or :class:`Fail` naming why none is durable.
    ack: bool = False


class Commit(Struct, frozen=True, tag="commit"):
    """Mark puts as written (``ok``) or abandoned (``ok=False``)."""

    keys: list[str]
    versions: list[int]
    ok: bool = True
    #: ask for a reply once the master has recorded the commit durably (its journal or
    #: etcd took it): :class:`Ok`, :class:`Acked` naming the puts it did not commit (no
    #: longer pending, or a replica's node is not alive), or :class:`Fail` naming why
    #: none is durable.
    ack: bool = False


class Get(Struct, frozen=True, tag="get"):
    """Locations of ``keys``; also ends the leases named in ``release_*`` (piggybacked
    :class:`Release` of earlier gets, saving a message per get)."""

    keys: list[str]
    lease: bool = True
    release_keys: list[str] = msgspec.field(default_factory=list)
    release_versions: list[int] = msgspec.field(default_factory=list)
    #: the most object bytes this client takes behind the reply (0: none; see above).
    attached_bytes: int = 0


class Release(Struct, frozen=True, tag="release"):
    """End the leases a get took once the bytes are read (no reply). Without it a lease
    lasts its TTL, which covers a client that dies mid-read."""

    keys: list[str]
    versions: list[int]


class SharedBad(Struct, frozen=True, tag="shared_bad"):
    """Shared-tier files a client found bad (torn, truncated, flipped, missing): ``keys``
    at ``versions``, as get answers named them (no reply). Best effort: the master reads
    each file itself and drops its index entry only if it is bad
    (:mod:`kvctl.store.sharedtier.reports`)."""

    keys: list[str]
    versions: list[int]


class Exists(Struct, frozen=True, tag="exists"):
    keys: list[str]


class Remove(Struct, frozen=True, tag="remove"):
    keys: list[str]


class ListKeys(Struct, frozen=True, tag="list"):
    prefix: str = ""
    limit: int = 10000


class Stat(Struct, frozen=True, tag="stat"):
    key: str


class Pin(Struct, frozen=True, tag="pin"):
    key: str
    pinned: bool = True


class Status(Struct, frozen=True, tag="status"):
    pass


class Nodes(Struct, frozen=True, tag="nodes"):
    pass


#: What a node's SSD tier may do (:attr:`RegisterNode.ssd_policy`): the node checks its own
#: setting against these, the master what a node registers with.
SSD_POLICIES = ("off", "write-through", "write-back")


class RegisterNode(Struct, frozen=True, tag="register"):
    node_id: str
    epoch: str
    segment: str
    endpoint: str
    host_id: str
    capacity_bytes: int
    ssd_capacity_bytes: int = 0
    ssd_policy: str = "off"
    descriptor: bytes = b""
    #: task ids of the shared-tier writes this node was handed and has not reported yet
    #: (``None``: a node that does not say); registering again with its epoch kept (its
    #: connection broke, a heartbeat's reply may be lost), the master fails the others
    running: list[int] | None = None


class DropNode(Struct, frozen=True, tag="drop_node"):
    """Drop a node now with its objects' copies on it (an operator's request; admin only).
    A node still running registers again with new memory."""

    node_id: str


class Heartbeat(Struct, frozen=True, tag="heartbeat"):
    """Liveness plus finished tasks; the master answers with new tasks, waiting up to
    ``wait_s`` for some to appear (a long poll)."""

    node_id: str
    epoch: str
    reports: list[TaskReport] = msgspec.field(default_factory=list)
    wait_s: float = 0.0


Request = (
    Login | Put | Commit | Get | Release | Exists | Remove | ListKeys | Stat | Pin | Status | Nodes
    | RegisterNode | Heartbeat | Reserve | PutAt | DropNode | SharedBad
)


# ---- replies -------------------------------------------------------------------------------


class Hello(Struct, frozen=True, tag="hello"):
    """The server's greeting. ``instance`` names this run of the master: a reservation is
    only good on connections to the instance that granted it."""

    version: int
    auth: bool
    nonce: bytes
    max_frame_bytes: int
    instance: str = ""
    #: the most object bytes this master sends behind one :class:`GetReply` (0: it hosts
    #: no node, so never).
    attached_bytes: int = 0
    #: this master takes :class:`SharedBad` (an older one would answer it, a message that
    #: gets no reply, and the connection would be out of step)
    shared_reports: bool = False
    #: 1: this master's login proof and session key cover the greeting, the login and the
    #: login reply as sent (:func:`login_transcript`); 0 (a master before issue 27.5): only
    #: the two nonces, so a relay could rewrite the reply's namespace. Clients refuse 0.
    login_binding: int = 0


class Ok(Struct, frozen=True, tag="ok"):
    """Success without data. After a login, ``namespace`` is the key prefix the connection
    is confined to (``"<tenant>/"``), empty for the shared (admin) token."""

    namespace: str = ""
    #: after a login with a ``client_nonce``: the master's proof that it knows the token
    proof: bytes = b""


class Fail(Struct, frozen=True, tag="fail"):
    error: ErrorInfo


class PutReply(Struct, frozen=True, tag="put_r"):
    slots: list[PutSlot | ErrorInfo]


class Reservation(Struct, frozen=True, tag="reserve_r"):
    """A granted :class:`Reserve`: ``reservation`` names it in :class:`PutAt`; one location
    per replica node (all the same ``size``); objects inside start at multiples of
    ``alignment`` bytes. Unused for ``ttl_s`` (no :class:`PutAt`), it is given back."""

    reservation: int
    locations: list[Location]
    alignment: int
    ttl_s: float


class GetReply(Struct, frozen=True, tag="get_r"):
    slots: list[GetSlot | ErrorInfo]
    #: indices of the slots whose bytes follow this frame, in that order.
    attached: list[int] = msgspec.field(default_factory=list)
    #: per attached slot, the index of the location (replica) the bytes came from.
    attached_from: list[int] = msgspec.field(default_factory=list)


class Acked(Struct, frozen=True, tag="acked"):
    """The answer to a :class:`Commit` or :class:`PutAt` that asked for ``ack`` when the
    master did not take some of its keys: ``refused[i]`` is the index of such a key in the
    request, ``errors[i]`` why (nothing of it is visible). Every other key is durably
    recorded. (When it took every key the answer is :class:`Ok`; when its state could not
    record them, :class:`Fail`.)"""

    refused: list[int] = msgspec.field(default_factory=list)
    errors: list[ErrorInfo] = msgspec.field(default_factory=list)


class Bools(Struct, frozen=True, tag="bools"):
    values: list[bool]


class KeyList(Struct, frozen=True, tag="keys"):
    objects: list[ObjectInfo]
    truncated: bool = False


class StatReply(Struct, frozen=True, tag="stat_r"):
    info: ObjectInfo


class StatusReply(Struct, frozen=True, tag="status_r"):
    status: StoreStatus


class NodesReply(Struct, frozen=True, tag="nodes_r"):
    nodes: list[NodeAddress]


class Tasks(Struct, frozen=True, tag="tasks"):
    tasks: list[Task]


Reply = (
    Hello | Ok | Fail | PutReply | GetReply | Bools | KeyList | StatReply | StatusReply
    | NodesReply | Tasks | Reservation | Acked
)


def fit_key_list(objects: list[ObjectInfo], truncated: bool, max_frame_bytes: int) -> KeyList:
    """A :class:`KeyList` of the first ``objects`` that fit one frame of ``max_frame_bytes``
    (long keys make a listing big); ``truncated`` when any were left out."""
    budget = max_frame_bytes - 1024  # the reply's own fields and msgpack headers
    encode = msgspec.msgpack.encode
    for count, info in enumerate(objects):
        budget -= len(encode(info))
        if budget < 0:
            return KeyList(objects=objects[:count], truncated=True)
    return KeyList(objects=objects, truncated=truncated)


#: The code of a get slot the master left out because its reply was full (a frame holds
#: at most ``max_frame_bytes``): not an error of the key; the client asks for it again.
REPLY_FULL: Final = "reply_full"
#: Slots above this many are measured before a get reply is sent (fewer always fit a frame).
_FIT_ABOVE = 64


def fit_get_reply(reply: GetReply, max_frame_bytes: int) -> tuple[GetReply, list[int]]:
    """``reply`` cut to fit one frame of ``max_frame_bytes``: the slots past what fits (long
    keys, many replicas, long shared-tier paths, causes naming keys) become
    :data:`REPLY_FULL` errors, for the client to ask again. Also the indices of those slots
    (their leases are the caller's to end). A reply of few slots is returned as it is."""
    slots = reply.slots
    n = len(slots)
    if n <= _FIT_ABOVE:
        return reply, []
    encode = msgspec.msgpack.encode
    full = ErrorInfo(code=REPLY_FULL, cause="reply full", hint="ask for this key again")
    held = len(encode(full))
    # The reply's own fields, its attached lists (one int each at most) and its frame MAC.
    budget = max_frame_bytes - 1024 - 10 * n
    used = 0
    for i, slot in enumerate(slots):
        used += len(encode(slot))
        if used + held * (n - i - 1) > budget:  # (slots before i fit with the rest held)
            return GetReply(slots=[*slots[:i], *[full] * (n - i)]), list(range(i, n))
    return reply, []


def check_key(key: str) -> ErrorInfo | None:
    """An error when ``key`` is empty, too long or not printable; ``None`` when valid (the
    master's rule, also checked by clients before a message that gets no reply)."""
    if not key:
        return ErrorInfo(code="bad_request", cause="empty key", hint="give a non-empty key")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return ErrorInfo(code="bad_request", cause=f"key {key!r} is not valid UTF-8",
                         hint="keys are UTF-8 text: check the bytes (or the shell's locale)")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return ErrorInfo(code="bad_request", cause=f"key of {len(key)} characters is too long",
                         hint=f"keep keys under {MAX_KEY_BYTES} bytes")
    if not key.isprintable():
        return ErrorInfo(code="bad_request", cause=f"key {key!r} has unprintable characters",
                         hint="use printable keys")
    return None


#: The :attr:`Hello.login_binding` this version speaks (and requires).
LOGIN_BINDING: Final = 1


def login_transcript(hello: bytes | bytearray | memoryview,
                     login: bytes | bytearray | memoryview, reply: Ok) -> bytes:
    """What a login's proof and session key are bound to (issue 27.5): the greeting's and
    the login's payloads as sent, and every field of the login reply but its proof (the
    namespace), so a relay that rewrites any of them makes the client refuse the master."""
    return auth.transcript(hello, login,
                           msgspec.msgpack.encode(msgspec.structs.replace(reply, proof=b"")))


class MacError(FrameError):
    """A message failed its MAC check: forged, altered, replayed or reordered on the way."""


class Codec:
    """Frames plus msgspec encoding for one side of a connection (not thread-safe).

    After a login with a token both sides set :attr:`mac` (keyed by the handshake, see
    :func:`kvctl.net.auth.session_key`): every message then ends with a 16-byte MAC over its
    encoding, numbered per direction, so a relay that passed a real login through can
    neither inject, alter, replay nor reorder requests (attached object bytes are not
    covered: the client checks them against their checksums).
    """

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.frames = FrameCodec(MAGIC, max_payload_bytes=max_frame_bytes)
        self._encoder = msgspec.msgpack.Encoder()
        self._requests = msgspec.msgpack.Decoder(Request)
        self._replies = msgspec.msgpack.Decoder(Reply)
        #: set after an authenticated login: seals what this side sends, checks what it gets
        self.mac: auth.FrameMac | None = None

    def _payload(self, message: msgspec.Struct) -> bytes:
        payload = self._encoder.encode(message)
        return payload if self.mac is None else payload + self.mac.seal(payload)

    def _opened(self, payload: bytes | bytearray | memoryview) -> bytes | memoryview:
        if self.mac is None:
            return payload if isinstance(payload, bytes | memoryview) else bytes(payload)
        view = memoryview(payload)
        size = auth.FRAME_MAC_BYTES
        if len(view) < size or not self.mac.check(view[-size:], view[:-size]):
            raise MacError("a message failed its MAC check (altered, injected or replayed on "
                           "the way)", "the connection is closed; if it repeats, something "
                           "between the hosts rewrites traffic")
        return view[:-size]

    def send(self, sock: socket.socket, message: msgspec.Struct) -> None:
        """Encode ``message`` and send it as one frame of the current version."""
        self.frames.send(sock, PROTOCOL_VERSION, self._payload(message))

    def encode(self, message: msgspec.Struct) -> bytes:
        """One complete frame (header + payload) for ``message``."""
        payload = self._payload(message)
        return self.frames.encode_header(PROTOCOL_VERSION, len(payload)) + payload

    def decode_request(self, payload: bytes) -> Request:
        """Decode a request payload (raises ``msgspec.DecodeError`` / ``ValidationError``,
        or :class:`MacError` on an authenticated connection)."""
        return self._requests.decode(self._opened(payload))

    def decode_reply(self, payload: bytes) -> Reply:
        """Decode a reply payload (raises ``msgspec.DecodeError`` / ``ValidationError``,
        or :class:`MacError` on an authenticated connection)."""
        return self._replies.decode(self._opened(payload))
