"""A publisher that sends recorded engine messages over real ZeroMQ sockets, as vLLM's
``ZmqEventPublisher`` does: an XPUB (PUB on the wire; it also tells when a subscriber has
joined, so tests wait on that instead of sleeping) and a ROUTER replay endpoint serving
``["", seq]`` requests from a buffer, answered ``("", topic, seq, payload)`` and ended by
seq -1."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import zmq

from kvctl.keys.watch.record import RecordedMessage, read_record

EVENTS = Path(__file__).resolve().parents[1] / "events"
END = (-1).to_bytes(8, "big", signed=True)


def fixture_messages(name: str) -> list[RecordedMessage]:
    """The messages of ``tests/keys/events/<name>.jsonl``."""
    return list(read_record(EVENTS / f"{name}.jsonl"))


class FixturePublisher:
    """PUB + ROUTER on ``ipc://`` under ``directory``; ``close()`` safe twice."""

    def __init__(self, ctx: Any, directory: Path, name: str, *, url: str | None = None,
                 replay_url: str | None = None) -> None:
        self.url = url or f"ipc://{directory}/{name}.pub"
        self.replay_url = replay_url or f"ipc://{directory}/{name}.replay"
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.url)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.replay_url)
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def wait_subscriber(self, timeout_s: float = 10.0) -> None:
        """Block until a subscriber's subscription arrives."""
        if not self.pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber joined")
        self.pub.recv()

    def send(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Keep ``(seq, payload)`` for replay and, if ``live``, publish it."""
        with self.lock:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def send_raw(self, frames: list[bytes]) -> None:
        """Publish arbitrary frames (garbage tests)."""
        self.pub.send_multipart(frames)

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self.lock:
                buffered = [m for m in self.buffer if m[0] >= first]
            for seq, payload in buffered:
                self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close(0)
        self.router.close(0)


def main(argv: list[str] | None = None) -> int:
    """Stand in for an engine on a (namespaced) host: bind PUB and replay like vLLM's
    ``tcp://*:P`` endpoints, print ``ready``, publish a recorded stream once a subscriber
    has joined, then serve replays until ``--serve-s`` have passed."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("fixture", help="a stream of tests/keys/events/, without .jsonl")
    parser.add_argument("--pub", default="tcp://*:5557")
    parser.add_argument("--replay", default="tcp://*:5558")
    parser.add_argument("--serve-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    ctx = zmq.Context()
    pub = FixturePublisher(ctx, Path(), args.fixture, url=args.pub, replay_url=args.replay)
    try:
        print("ready", flush=True)
        pub.wait_subscriber(args.serve_s)
        for m in fixture_messages(args.fixture):
            assert m.seq is not None
            pub.send(m.seq, m.payload)
        print("published", flush=True)
        pub.stop.wait(args.serve_s)
    except TimeoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        pub.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
