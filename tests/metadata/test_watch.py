"""The watch API on every backend: a snapshot first, then puts, deletions and expiries in
order; pushed backends deliver within milliseconds, polled ones within their poll."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Callable

import pytest

from kvctl.metadata import MetadataClient, MetadataError, open_metadata
from kvctl.metadata.watch import Change, Snapshot, Watch, WatchEvent, apply_changes
from tests.fixtures.servers import ServerProcess

POLL_S = 0.1


def drain(watch: Watch, until: Callable[[list[Change]], bool], timeout_s: float = 5.0
          ) -> list[Change]:
    """Changes until ``until(all so far)`` holds (bounded)."""
    got: list[Change] = []
    deadline = time.monotonic() + timeout_s
    while not until(got) and time.monotonic() < deadline:
        got += watch.wait(0.2)
    return got


def test_snapshot_then_events_in_order(client: MetadataClient, prefix: str) -> None:
    jobs, other = prefix + "jobs/", prefix + "other/"
    client.put(jobs + "a", b"1")
    client.put(other + "x", b"ignored")
    with client.watch([jobs], poll_s=POLL_S) as watch:
        first = drain(watch, bool)
        assert first == [Snapshot(jobs, {jobs + "a": b"1"})]
        client.put(jobs + "b", b"2")
        client.put(other + "y", b"ignored")
        client.put(jobs + "a", b"3")
        client.delete(jobs + "b")
        state: dict[str, bytes] = {}
        apply_changes(state, first)
        got = drain(watch, lambda got: _applied(state, got) == {jobs + "a": b"3"})
        apply_changes(state, got)
        assert state == {jobs + "a": b"3"}
        assert all(c.key.startswith(jobs) for c in got if isinstance(c, WatchEvent))
        if watch.pushed:  # every write is seen, in order
            assert got == [WatchEvent(jobs + "b", b"2"), WatchEvent(jobs + "a", b"3"),
                           WatchEvent(jobs + "b", None)]


def _wait_long(watch: Watch, state: dict[str, bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        apply_changes(state, watch.wait(0.5))


def _applied(state: dict[str, bytes], changes: list[Change]) -> dict[str, bytes]:
    copy = dict(state)
    apply_changes(copy, changes)
    return copy


def test_an_expired_lease_is_a_deletion(client: MetadataClient, prefix: str) -> None:
    alive = prefix + "alive/"
    lease = client.grant_lease(1.0)
    client.put(alive + "h1", b"agent", lease=lease)
    with client.watch(alive, poll_s=POLL_S) as watch:
        assert drain(watch, bool) == [Snapshot(alive, {alive + "h1": b"agent"})]
        started = time.monotonic()
        got = drain(watch, bool, timeout_s=10.0)
        assert got == [WatchEvent(alive + "h1", None)]
        # etcd rounds TTLs up to whole seconds, and may keep a lease up to ~1 s longer
        assert time.monotonic() - started < 1.0 + 2.0 + POLL_S + 1.0


def test_close_wakes_a_waiting_reader(client: MetadataClient, prefix: str) -> None:
    watch = client.watch(prefix + "w/", poll_s=POLL_S)
    drain(watch, bool)
    done = threading.Event()
    threading.Thread(target=lambda: (watch.wait(30.0), done.set()), daemon=True).start()
    time.sleep(0.1)
    watch.close()
    assert done.wait(5.0)
    assert watch.wait(0.1) == []


def test_prefixes_are_checked(client: MetadataClient, prefix: str) -> None:
    with pytest.raises(ValueError, match="overlap"):
        client.watch([prefix, prefix + "a/"])
    with pytest.raises(ValueError):
        client.watch([])


@pytest.mark.parametrize("kind", ["memory", pytest.param("etcd", marks=pytest.mark.integration),
                                  pytest.param("redis", marks=pytest.mark.integration)])
def test_pushing_backends_do_not_wait_for_a_poll(kind: str, request: pytest.FixtureRequest,
                                                 prefix: str) -> None:
    """etcd and memory push every change; Redis announces writes (pub/sub), and the watch
    re-lists at once."""
    url = "memory://watch-push" if kind == "memory" else request.getfixturevalue(f"{kind}_url")
    with open_metadata(url) as client, client.watch(prefix, poll_s=30.0) as watch:
        assert watch.pushed == (kind != "redis")
        drain(watch, bool)
        worst = 0.0
        for i in range(20):
            started = time.perf_counter()
            client.put(f"{prefix}k{i}", b"v")
            got = drain(watch, bool, timeout_s=2.0)
            worst = max(worst, time.perf_counter() - started)
            assert got == [WatchEvent(f"{prefix}k{i}", b"v")]
        assert worst < 2.0  # a poll would take 30 s


@pytest.mark.integration
def test_an_etcd_watch_survives_a_restart(spawn_etcd: Callable[[], ServerProcess],
                                          prefix: str) -> None:
    server = spawn_etcd()
    state: dict[str, bytes] = {}
    with open_metadata(server.url, timeout_s=1.0) as client, client.watch(prefix) as watch:
        client.put(prefix + "before", b"1")
        apply_changes(state, drain(watch, lambda g: prefix + "before" in _applied(state, g)))
        server.stop()
        with pytest.raises(MetadataError, match="etcd"):  # said, then retried on its own
            _wait_long(watch, state, 10.0)
        server.start()
        client.put(prefix + "after", b"2")
        deadline = time.monotonic() + 15
        while prefix + "after" not in state and time.monotonic() < deadline:
            with contextlib.suppress(MetadataError):
                apply_changes(state, watch.wait(0.5))
        assert state == {prefix + "before": b"1", prefix + "after": b"2"}


class _HostileEtcd(http.server.BaseHTTPRequestHandler):
    """Answers range reads like etcd, and every watch with an endless stream of junk."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v3/watch":
            body = b'{"header":{"revision":"5"},"kvs":[]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(256):  # 1 MiB of it
                self.wfile.write(b"1000\r\n" + b"x" * 0x1000 + b"\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_watch_stream_of_junk_is_an_error_not_a_hang() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileEtcd)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"etcd://127.0.0.1:{server.server_address[1]}"
        with open_metadata(url, timeout_s=1.0) as client, client.watch("kvctl/") as watch:
            assert drain(watch, bool) == [Snapshot("kvctl/", {})]
            with pytest.raises(MetadataError, match="not JSON"):
                _wait_long(watch, {}, 10.0)
    finally:
        server.shutdown()
        server.server_close()
