"""Reliability fixtures: a store cluster whose master and nodes are separate processes, value
patterns that carry their own key and version, and a proxy that truncates connections.

``store_cluster()`` starts ``python -m kvctl store master`` and ``... store node`` processes
(node timeout 1.5 s) that a test can SIGKILL, SIGSTOP/SIGCONT or restart on the same port;
every process is stopped at the end and the shared-memory files of killed nodes removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from kvctl.store.client import StoreClient

ROOT = Path(__file__).resolve().parents[2]
#: The master declares a node dead after this much heartbeat silence, seconds.
NODE_TIMEOUT_S = 1.5
CARD_DEADLINE_S = 30.0


def node_states(client: StoreClient) -> dict[str, str]:
    """Each node's liveness state (alive, suspect, ...) as the master reports it."""
    return {n.node_id: n.state for n in client.status().nodes}


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition"
             ) -> float:
    """Poll ``cond`` until true (returns the seconds it took) or fail after ``timeout_s``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


@contextlib.contextmanager
def kept_logging() -> Iterator[None]:
    """Undo the root logging setup an in-process CLI run makes (its handler writes to the
    captured stderr of this test, which is closed once the test ends)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


# ---------------------------------------------------------------- self-describing values

_HEAD = struct.Struct("<16sQI")  # key digest, version, body length


def make_value(key: str, version: int, size: int) -> bytes:
    """Bytes unique to (key, version): a header naming both, then a keyed pseudo-random body.

    Any bytes a get returns can be checked with :func:`decode_value` alone: torn, stale or
    another key's bytes never pass.
    """
    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
    body_len = max(0, size - _HEAD.size)
    seed = hashlib.blake2b(f"{key}\0{version}".encode(), digest_size=64).digest()
    body = (seed * (body_len // 64 + 1))[:body_len]
    return _HEAD.pack(digest, version, body_len) + body


def decode_value(key: str, data: bytes) -> int:
    """The version ``data`` holds for ``key``; raises ``AssertionError`` on any wrong byte."""
    assert len(data) >= _HEAD.size, f"{key}: {len(data)} bytes is shorter than a header"
    _, version, body_len = _HEAD.unpack_from(data)
    expected = make_value(key, version, _HEAD.size + body_len)
    assert data == expected, f"{key}: wrong bytes (claims version {version}, {len(data)} B)"
    return int(version)


# ---------------------------------------------------------------- processes


def _cleanup_shm(pid: int) -> None:
    # A SIGKILLed node cannot unlink its shared-memory segment.
    for path in Path("/dev/shm").glob(f"kvctl-*-{pid}-*"):
        path.unlink(missing_ok=True)


class StoreProc:
    """``python -m kvctl store ARGS --json`` in its own process; ``card`` is its first JSON
    document (address, node id...)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "store", *args, "--json"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**os.environ, "KVCTL_STORE_NODE_TIMEOUT": str(NODE_TIMEOUT_S), **(env or {})})
        self.card: dict[str, object] = {}
        self._stderr: list[bytes] = []

    def ready(self) -> StoreProc:
        """Read the address card (the process is serving once it printed it)."""
        assert self.proc.stdout is not None
        text = ""
        deadline = time.monotonic() + CARD_DEADLINE_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                pytest.fail(f"kvctl store {' '.join(self.args)} exited: {err[-3000:]}")
            text += line
            with contextlib.suppress(ValueError):
                self.card = json.loads(text)
                # Drain stderr so a chatty process never blocks on a full pipe.
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        pytest.fail(f"kvctl store {' '.join(self.args)}: no address card within "
                    f"{CARD_DEADLINE_S} s")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    @property
    def log(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        _cleanup_shm(self.pid)

    def suspend(self) -> None:
        """SIGSTOP: the process stalls with its sockets open (a hung peer). Returns once
        the kernel shows it stopped (the signal is delivered asynchronously: on a busy
        machine the process could otherwise answer a few more requests)."""
        self.proc.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = stat.read_text().rpartition(")")[2].split()[0]
            if state in ("T", "t"):
                return
            time.sleep(0.005)
        raise AssertionError(f"process {self.proc.pid} did not stop after SIGSTOP")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        _cleanup_shm(self.pid)


class StoreCluster:
    """A master process and storage-node processes (all stopped by the fixture)."""

    def __init__(self, procs: list[StoreProc], env: dict[str, str]) -> None:
        self._procs = procs
        self.env = env
        self.master: StoreProc | None = None
        self.nodes: dict[str, StoreProc] = {}
        self.port = 0
        self.state = "none"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, *args: str) -> StoreProc:
        proc = StoreProc(*args, env=self.env)
        self._procs.append(proc)
        return proc

    def start_master(self, *, state: str = "none", port: int = 0,
                     extra: tuple[str, ...] = ()) -> StoreProc:
        """Start (or restart, with the same port and state) the master."""
        self.state = state
        self.master = self._spawn("master", "--listen", f"127.0.0.1:{port}", "--state", state,
                                  *extra).ready()
        self.port = int(str(self.master.card["master"]).rpartition(":")[2])
        return self.master

    def restart_master(self) -> StoreProc:
        """SIGKILL the master and start a new one on the same port with the same state."""
        assert self.master is not None
        self.master.kill()
        return self.start_master(state=self.state, port=self.port)

    def start_nodes(self, *node_ids: str, capacity: str = "64MiB",
                    extra: tuple[str, ...] = ()) -> list[StoreProc]:
        """Start nodes concurrently (each pays the interpreter start once, in parallel)."""
        procs = [self._spawn("node", "--master", self.address, "--node-id", nid,
                             "--capacity", capacity, *extra) for nid in node_ids]
        for nid, proc in zip(node_ids, procs, strict=True):
            self.nodes[nid] = proc.ready()
        return procs

    def processes(self) -> dict[str, StoreProc]:
        """Every live process by role (``master``, node ids)."""
        out = {nid: p for nid, p in self.nodes.items() if p.proc.poll() is None}
        if self.master is not None and self.master.proc.poll() is None:
            out["master"] = self.master
        return out


@pytest.fixture
def store_cluster() -> Iterator[Callable[..., StoreCluster]]:
    """``store_cluster(env={...})`` → a :class:`StoreCluster` (start master/nodes on it)."""
    procs: list[StoreProc] = []

    def make(env: dict[str, str] | None = None) -> StoreCluster:
        return StoreCluster(procs, dict(env or {}))

    yield make
    for proc in reversed(procs):
        proc.stop()


# ---------------------------------------------------------------- a truncating proxy


class TruncatingProxy:
    """Forwards loopback TCP to ``upstream`` but cuts *every* connection once it has carried
    ``cut_after`` client bytes (a link that drops mid-transfer, again and again).

    Attributes:
        cuts: connections cut so far.
    """

    def __init__(self, upstream: tuple[str, int], *, cut_after: int) -> None:
        self.upstream = upstream
        self.cut_after = cut_after
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream and seen + len(data) > self.cut_after:
                    dst.sendall(data[: max(0, self.cut_after - seen)])  # a truncated frame
                    with self._lock:
                        self.cuts += 1
                    break
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
