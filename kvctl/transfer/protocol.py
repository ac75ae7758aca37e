"""The kvctl transfer wire protocol (version 2), served by every target.

Connection setup (fixed-size messages)::

    server → client  HELLO   magic "KVTE", version u16, flags u8 (bit 0: auth required),
                             pad, nonce[32]
    client → server  ANSWER  magic "KVTE", version u16, pad[2],
                             HMAC-SHA256(token, "kvctl-transfer/1" || 0 || nonce) or zeros,
                             client nonce[32]
    server → client  VERDICT magic "KVTE", code u8 (0 ok, 1 auth refused, 2 bad version), pad[3],
                             proof[32]: auth.server_proof over both nonces (zeros: no token)

With a token both sides prove they know it (a client checks the proof and refuses a target
that cannot give it), and every frame then carries a 16-byte MAC
(:class:`kvctl.net.auth.FrameMac`, keyed by :func:`kvctl.net.auth.session_key` over both
nonces) right after its control part: after a request's entries (a NOTIFY's: after its
body) and after a response's header, covering an error response's text as well (it
follows the MAC). A relay that passed a real handshake through cannot
inject, alter, replay or reorder frames. Bulk data (WRITE and READ payload) is not covered.

Then requests, each answered by one response, in order::

    request   type u8, flags u8, pad u16, tag u32, count u32, payload u64
              count * entry (seg_id u32, offset u64, length u64)
              payload bytes (WRITE: the data, entries in order; NOTIFY: the message)
    response  type u8 (RESP), status u8, pad u16, tag u32, index u32, payload u64
              payload bytes (READ ok: the data, entries in order; error: a UTF-8 message)

All integers little-endian. Limits: at most :data:`MAX_ENTRIES` entries and
``max_frame_bytes`` of payload per frame; a WRITE's payload must equal the sum of its entry
lengths. A frame that breaks these rules, an unknown type or bad magic closes that connection;
an entry outside every registered buffer is answered with ``OUT_OF_RANGE`` (the WRITE payload
is drained) and the connection stays usable.
"""

from __future__ import annotations

import enum
import struct

MAGIC = b"KVTE"
VERSION = 2
AUTH_CONTEXT = b"kvctl-transfer/1"

HELLO = struct.Struct("<4sHBx32s")
#: An answer's first bytes (magic, version): how long the rest is depends on the version.
ANSWER_HEAD = struct.Struct("<4sH2x")
ANSWER = struct.Struct("<4sH2x32s32s")
#: Version 1's answer (no client nonce), read only to refuse it with BAD_VERSION.
ANSWER_V1 = struct.Struct("<4sH2x32s")
VERDICT = struct.Struct("<4sB3x32s")
HEADER = struct.Struct("<BBHIIQ")
ENTRY = struct.Struct("<IQQ")

FLAG_AUTH = 1
MAX_ENTRIES = 65536
MAX_NOTIFY_BYTES = 64 * 1024
DEFAULT_MAX_FRAME_BYTES = 256 << 20


class FrameType(enum.IntEnum):
    """Request and response types."""

    READ = 1
    WRITE = 2
    NOTIFY = 3
    PING = 4
    RESP = 0x80


class WireStatus(enum.IntEnum):
    """Response status codes."""

    OK = 0
    NO_SEGMENT = 1
    OUT_OF_RANGE = 2
    CLOSING = 3
    INTERNAL = 4


class Verdict(enum.IntEnum):
    """Handshake outcomes."""

    OK = 0
    AUTH_REFUSED = 1
    BAD_VERSION = 2


NO_INDEX = 0xFFFFFFFF
