"""Fixtures: a metadata URL for every backend, each test under its own key prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.metadata import MetadataClient, MetadataServer, key_prefix, open_metadata

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("file", id="file"),
    pytest.param("http", id="http", marks=pytest.mark.integration),
    pytest.param("etcd", id="etcd", marks=pytest.mark.integration),
    pytest.param("redis", id="redis", marks=pytest.mark.integration),
]


def url_for(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "memory":
        return f"memory://{uuid.uuid4().hex}"
    if kind == "file":
        return f"file://{tmp_path}/metadata"
    if kind == "http":
        server = MetadataServer(port=0).start()
        request.addfinalizer(server.stop)
        return server.url
    return str(request.getfixturevalue(f"{kind}_url"))


@pytest.fixture(params=BACKENDS)
def metadata_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of each backend in turn (etcd and Redis are shared: use ``prefix``)."""
    return url_for(request.param, request, tmp_path)


@pytest.fixture
def client(metadata_url: str) -> Iterator[MetadataClient]:
    with open_metadata(metadata_url) as c:
        yield c


@pytest.fixture
def prefix() -> str:
    """A key prefix of a cluster id unique to this test."""
    return key_prefix(f"t-{uuid.uuid4().hex[:12]}")
