"""Shared-token authentication that never sends the token.

Connection-oriented listeners (transfer targets, store master and nodes) run a
challenge-response: the server sends a random nonce, the client answers
``HMAC-SHA256(token, context || nonce)``, the server compares in constant time. The store
master proves itself back (:func:`server_proof` over both nonces), so a client never hands
its data to a server that does not know the token. Request-
oriented listeners (the HTTP metadata server) sign each request with :func:`sign_request`
over a timestamp, a nonce and the request itself, checked by :func:`verify_request` with a
replay window. Tokens appear in no message, log line or exception text.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvctl.errors import ConfigError

NONCE_BYTES = 32
DIGEST_BYTES = 32


def secret(token: str) -> bytes:
    """The token's bytes (UTF-8).

    Raises:
        ConfigError: the token is not UTF-8 text (a lone surrogate: an environment
            variable or file holding bytes that are not UTF-8); the token is not shown.
    """
    try:
        return token.encode()
    except UnicodeEncodeError:
        raise ConfigError("the token is not valid UTF-8 text",
                          "set KVCTL_TOKEN (or --token, or the token file) to UTF-8 text, "
                          "e.g. the output of 'openssl rand -hex 32'") from None


def new_nonce() -> bytes:
    """A fresh random challenge."""
    return os.urandom(NONCE_BYTES)


def respond(token: str, nonce: bytes, context: bytes) -> bytes:
    """The answer to ``nonce`` for a listener of kind ``context`` (e.g. ``b"kvctl-tcp/1"``)."""
    return hmac.new(secret(token), context + b"\0" + nonce, hashlib.sha256).digest()


def transcript(*messages: bytes | bytearray | memoryview) -> bytes:
    """A digest of a handshake's messages as sent (each length-prefixed, so no two
    sequences of messages share a digest): passed to :func:`server_proof` and
    :func:`session_key`, it binds every field of the greeting, the login and the login
    reply, so a relay that rewrites any of them (a reply's namespace) breaks the proof."""
    h = hashlib.sha256(b"kvctl-transcript/1")
    for message in messages:
        h.update(len(message).to_bytes(8, "little"))
        h.update(message)
    return h.digest()


def server_proof(token: str, server_nonce: bytes, client_nonce: bytes, context: bytes,
                 transcript: bytes = b"") -> bytes:
    """The server's half of mutual authentication: it knows ``token`` too. Bound to both
    nonces of this handshake (and to ``transcript``, a :func:`transcript` of the messages
    around them, where the protocol has one), and in another domain than :func:`respond`,
    so neither a client's answer nor an old proof can stand in for it."""
    return hmac.new(secret(token), context + b"\0server\0" + server_nonce + client_nonce
                    + transcript, hashlib.sha256).digest()


def check_response(token: str, nonce: bytes, context: bytes, answer: bytes) -> bool:
    """Whether ``answer`` proves knowledge of ``token`` (constant-time compare)."""
    return hmac.compare_digest(respond(token, nonce, context), answer)


def sign_request(token: str, method: str, path: str, body: bytes, *, now: float | None = None
                 ) -> dict[str, str]:
    """Headers that authenticate one HTTP request: timestamp, nonce and signature."""
    timestamp = f"{(time.time() if now is None else now):.3f}"
    nonce = os.urandom(16).hex()
    mac = _request_mac(token, method, path, body, timestamp, nonce)
    return {"X-Kvctl-Time": timestamp, "X-Kvctl-Nonce": nonce, "X-Kvctl-Signature": mac}


#: The header that carries an HTTP answer's signature (:func:`sign_reply`).
REPLY_HEADER = "X-Kvctl-Reply"


def sign_reply(token: str, request_signature: str, status: int, body: bytes) -> str:
    """The signature of one HTTP answer: its status and body, bound to the request it
    answers by that request's signature (which covers the request's method, path, time,
    nonce and body), so neither a forged answer nor one recorded for another request
    passes :func:`check_reply`."""
    message = b"\n".join([b"kvctl-reply/1", request_signature.encode("ascii", "replace"),
                          str(status).encode(), hashlib.sha256(body).digest()])
    return hmac.new(secret(token), message, hashlib.sha256).hexdigest()


def check_reply(token: str, request_signature: str, status: int, body: bytes,
                signature: str) -> bool:
    """Whether ``signature`` is the server's for this answer to this request."""
    return hmac.compare_digest(sign_reply(token, request_signature, status, body),
                               signature.encode("ascii", "replace").decode())


class RequestVerifier:
    """Checks signed HTTP requests: valid MAC, timestamp within ``window_s``, nonce unseen.

    With ``journal`` (a file), every nonce taken is appended to it and the nonces of the
    last ``window_s`` are read back on start, so a request refused as a replay stays
    refused after a restart (issue 27.6). The file holds what the window needs: it is
    rewritten with the live nonces only once it holds twice as many lines (at least 4096).
    It is not fsync()ed: it outlives the process, not a crash of the host.
    """

    def __init__(self, token: str, *, window_s: float = 30.0, max_nonces: int = 65536,
                 journal: Path | None = None, now: float | None = None) -> None:
        self._token = token
        self._window_s = window_s
        self._max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._journal = journal
        self._journal_fd = -1
        self._journal_lines = 0
        if journal is not None:
            self._load(journal, time.time() if now is None else now)

    def _load(self, journal: Path, now: float) -> None:
        try:
            text = journal.read_text("ascii", errors="replace")
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            raise ConfigError(f"cannot read the replay journal {journal}: "
                              f"{exc.strerror or exc}",
                              "check the data directory's permissions") from None
        for line in text.splitlines():
            sent_text, _, nonce = line.partition(" ")
            try:
                sent = float(sent_text)
            except ValueError:
                continue  # a line cut by a crash mid-write
            if nonce and len(nonce) <= 64 and abs(now - sent) <= self._window_s:
                self._seen[nonce] = sent
        while len(self._seen) > self._max_nonces:
            self._seen.popitem(last=False)
        self._rewrite(journal)

    def _rewrite(self, journal: Path) -> None:
        """Replace the journal with the nonces held now (atomically); reopen it to append."""
        temp = journal.with_name(journal.name + ".tmp")
        data = "".join(f"{sent:.3f} {nonce}\n" for nonce, sent in self._seen.items())
        try:
            temp.write_text(data, "ascii")
            temp.replace(journal)
            fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"cannot write the replay journal {journal}: "
                              f"{exc.strerror or exc}",
                              "check the data directory's permissions and free space") from None
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        self._journal_fd = fd
        self._journal_lines = len(self._seen)

    def close(self) -> None:
        """Close the journal (safe to call twice)."""
        with self._lock:
            if self._journal_fd >= 0:
                os.close(self._journal_fd)
                self._journal_fd = -1

    def sign_reply(self, request_signature: str, status: int, body: bytes) -> str:
        """:func:`sign_reply` with this verifier's token."""
        return sign_reply(self._token, request_signature, status, body)

    def __repr__(self) -> str:
        return f"RequestVerifier(window_s={self._window_s})"  # never shows the token

    def verify(self, method: str, path: str, body: bytes, headers: dict[str, str],
               *, now: float | None = None) -> bool:
        """Whether the request carries a fresh, valid signature (its nonce then taken).

        Raises:
            ConfigError: the journal cannot be written (the request is not to be served).
        """
        timestamp = headers.get("X-Kvctl-Time", "")
        nonce = headers.get("X-Kvctl-Nonce", "")
        signature = headers.get("X-Kvctl-Signature", "")
        try:
            sent = float(timestamp)
        except ValueError:
            return False
        now = time.time() if now is None else now
        if abs(now - sent) > self._window_s or not nonce or len(nonce) > 64 or \
                not (nonce.isascii() and nonce.isalnum()):  # clients send hex
            return False
        expected = _request_mac(self._token, method, path, body, timestamp, nonce)
        if not hmac.compare_digest(expected, signature):
            return False
        with self._lock:
            if nonce in self._seen:
                return False
            # Nonces whose time is past the window go (oldest first): their requests are
            # refused by time alone.
            while self._seen and now - next(iter(self._seen.values())) > self._window_s:
                self._seen.popitem(last=False)
            self._seen[nonce] = sent
            while len(self._seen) > self._max_nonces:
                self._seen.popitem(last=False)
            if self._journal is not None:
                self._remember(self._journal, nonce, sent)
        return True

    def _remember(self, journal: Path, nonce: str, sent: float) -> None:
        """Append a taken nonce to the journal before the request is served (under the
        lock); compact it when it holds twice what the window needs."""
        if self._journal_lines >= max(4096, 2 * len(self._seen)):
            self._rewrite(journal)  # the new nonce is in _seen: written with the rest
            return
        if self._journal_fd < 0:
            raise ConfigError("the replay journal is closed", "restart the metadata server")
        try:
            os.write(self._journal_fd, f"{sent:.3f} {nonce}\n".encode("ascii", "replace"))
        except OSError as exc:
            del self._seen[nonce]  # not remembered: not accepted
            raise ConfigError(f"cannot append to the replay journal {journal}: "
                              f"{exc.strerror or exc}", "check the data directory's free "
                              "space") from None
        self._journal_lines += 1


def _request_mac(token: str, method: str, path: str, body: bytes, timestamp: str,
                 nonce: str) -> str:
    message = b"\n".join([method.upper().encode(), path.encode(), timestamp.encode(),
                          nonce.encode(), hashlib.sha256(body).digest()])
    return hmac.new(secret(token), message, hashlib.sha256).hexdigest()


#: Bytes of the MAC that follows each frame's control part on an authenticated connection.
FRAME_MAC_BYTES = 16


def session_key(token: str, server_nonce: bytes, client_nonce: bytes, context: bytes,
                transcript: bytes = b"") -> bytes:
    """The key of one authenticated connection: bound to the token, to both nonces of its
    handshake and to its ``transcript`` (see :func:`server_proof`), in a domain of its own
    (no answer or proof is ever equal to it)."""
    return hmac.new(secret(token), context + b"\0session\0" + server_nonce + client_nonce
                    + transcript, hashlib.sha256).digest()


class FrameMac:
    """Per-frame MACs of one connection, after a handshake with a token.

    A relay that passed a real handshake through (a man in the middle who knows no token)
    still holds the connection; with these MACs it can neither inject, alter, drop, replay
    nor reorder a frame's control part, since each MAC covers the direction, the frame's
    sequence number in that direction and its bytes. Bulk payload (a WRITE's or a READ's
    data) is not covered: it is checked end to end where it matters (``--verify``, the
    store's checksums).
    """

    __slots__ = ("_keyed", "_recv_seq", "_recv_tag", "_send_seq", "_send_tag")

    def __init__(self, key: bytes, *, client: bool) -> None:
        # Keyed once; each frame copies the keyed state (about 2 us of CPU for a small
        # frame, 4 us for one of 128 entries; hmac.digest re-keys each time and is slower).
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)
        self._send_tag, self._recv_tag = (b"c", b"s") if client else (b"s", b"c")
        self._send_seq = 0
        self._recv_seq = 0

    def __repr__(self) -> str:
        return f"FrameMac(sent={self._send_seq}, received={self._recv_seq})"  # no key

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytes:
        """The MAC of the next frame this side sends, made of ``parts``."""
        mac = self._mac(self._send_tag, self._send_seq, parts)
        self._send_seq += 1
        return mac

    def check(self, mac: bytes | bytearray | memoryview,
              *parts: bytes | bytearray | memoryview) -> bool:
        """Whether ``mac`` is right for the next frame received, made of ``parts``."""
        ok = hmac.compare_digest(self._mac(self._recv_tag, self._recv_seq, parts), bytes(mac))
        self._recv_seq += 1
        return ok

    def _mac(self, direction: bytes, seq: int,
             parts: tuple[bytes | bytearray | memoryview, ...]) -> bytes:
        h = self._keyed.copy()
        h.update(direction + seq.to_bytes(8, "little"))
        for part in parts:
            h.update(part)
        return h.digest()[:FRAME_MAC_BYTES]
