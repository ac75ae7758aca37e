"""Helpers shared by the harnesses. Imports nothing from kvctl at module level, so a harness
run under atheris can import kvctl inside ``atheris.instrument_imports()``."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable

#: Longest one fuzz input may keep a connection busy, seconds (a hang is a finding).
PUMP_DEADLINE_S = 15.0


class FuzzFinding(AssertionError):  # noqa: N818 - a finding, not an error of ours
    """A property broke: a canary changed, a handler logged a crash, a peer hung."""


class Pump:
    """Client end of one connection, run in a helper thread: send ``data`` (then half-close),
    and read everything the server answers until it closes, concurrently (so neither side
    can block the other on a full socket buffer).

    ``first`` is called with the socket before sending (e.g. to read a greeting and return
    a handshake answer to put in front of ``data``).
    """

    def __init__(self, sock: socket.socket, data: bytes,
                 first: Callable[[socket.socket], bytes] | None = None) -> None:
        self.sock = sock
        self.data = data
        self.first = first
        self.received = bytearray()
        self.error: BaseException | None = None
        self.timed_out = False
        self._thread = threading.Thread(target=self._run, name="fuzz-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            prefix = self.first(self.sock) if self.first is not None else b""
            self._pump(prefix + self.data)
        except OSError:
            pass  # the server cut the connection: allowed, it is a bad client
        except BaseException as exc:  # noqa: BLE001 - reported to the fuzzing thread
            self.error = exc

    def _pump(self, out: bytes) -> None:
        view = memoryview(out)
        self.sock.setblocking(False)
        sel = selectors.DefaultSelector()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if view else 0)
        sel.register(self.sock, events)
        if not view:
            self.sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + PUMP_DEADLINE_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timed_out = True
                    return
                for _key, mask in sel.select(min(left, 1.0)):
                    if mask & selectors.EVENT_WRITE and view:
                        sent = self.sock.send(view[:65536])
                        view = view[sent:]
                        if not view:
                            self.sock.shutdown(socket.SHUT_WR)
                            sel.modify(self.sock, selectors.EVENT_READ)
                    if mask & selectors.EVENT_READ:
                        chunk = self.sock.recv(1 << 16)
                        if not chunk:
                            return
                        self.received += chunk
        finally:
            sel.close()

    def join(self) -> bytes:
        """Wait for the exchange to end; the server's answer."""
        self._thread.join(PUMP_DEADLINE_S + 5)
        if self._thread.is_alive() or self.timed_out:
            raise FuzzFinding("the connection was still open after "
                              f"{PUMP_DEADLINE_S} s: the server hangs on this input")
        if self.error is not None:
            raise self.error
        return bytes(self.received)


class ErrorTrap(logging.Handler):
    """Collects ERROR records (``_log.exception`` in a server's catch-all) of some loggers:
    a server that swallows a crash still logs it, and that counts as a finding."""

    def __init__(self, loggers: Iterable[str]) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        for name in loggers:
            logger = logging.getLogger(name)
            logger.addHandler(self)
            if logger.getEffectiveLevel() > logging.ERROR:
                logger.setLevel(logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def check(self) -> None:
        """Raise (and clear) when a crash was logged since the last check."""
        if self.records:
            record, self.records = self.records[0], []
            detail = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                detail += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            raise FuzzFinding(f"{record.name} logged a crash: {detail}")


class TcpPair:
    """Loopback TCP connection pairs (the servers set TCP options a socketpair lacks)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._address = self._listener.getsockname()[:2]

    def __call__(self) -> tuple[socket.socket, socket.socket]:
        """A connected ``(client, server)`` pair."""
        client = socket.create_connection(self._address, timeout=5.0)
        server, _ = self._listener.accept()
        client.settimeout(None)
        return client, server

    def close(self) -> None:
        self._listener.close()


def split_chunks(data: bytes, count_bytes: int = 2) -> list[bytes]:
    """Cut ``data`` into length-prefixed chunks (``count_bytes`` little-endian length each),
    so a mutating fuzzer can keep frame boundaries while changing their contents."""
    chunks: list[bytes] = []
    i = 0
    while i < len(data):
        n = int.from_bytes(data[i:i + count_bytes], "little")
        i += count_bytes
        chunks.append(data[i:i + n])
        i += n
    return chunks


def run_atheris(test_one_input: Callable[[bytes], None], argv: list[str]) -> None:
    """Hand ``test_one_input`` to atheris/libFuzzer with ``argv`` (never returns)."""
    import atheris  # the dev extra; only the atheris entry points need it

    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
