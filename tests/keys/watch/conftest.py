"""Fixtures of the watch tests: a ZeroMQ context and publishers of recorded engine streams."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from tests.keys.watch.publisher import FixturePublisher


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short directory for ipc:// paths (they must stay under ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvw") as tmp:
        yield Path(tmp)


@pytest.fixture
def publishers(zctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: Path
               ) -> Iterator[Callable[[str], FixturePublisher]]:
    made: list[FixturePublisher] = []

    def make(name: str) -> FixturePublisher:
        pub = FixturePublisher(zctx, ipc_dir, name)
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()
