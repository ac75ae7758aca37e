"""Namespaced-host clusters for the cluster tests: etcd on host 1, an agent on every host."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest

from tests.cluster.nscluster import NsCluster
from tests.fixtures.nshosts import HostNet, HostsUnavailableError

MakeCluster = Callable[..., NsCluster]


@pytest.fixture
def ns_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeCluster]:
    """``ns_cluster(count, agents=None)``: hosts with etcd and agents, removed after the
    test."""
    made: list[tuple[HostNet, NsCluster]] = []

    def make(count: int, *, agents: list[int] | None = None) -> NsCluster:
        if shutil.which("etcd") is None:
            pytest.skip("etcd is not installed (apt-get install etcd-server)")
        try:
            net = HostNet(count, tmp_path_factory.mktemp("cluster-hosts"))
        except HostsUnavailableError as exc:
            pytest.skip(f"no namespaced hosts here: {exc}")
        try:
            cluster = NsCluster(net, agents=agents)
        except BaseException:
            net.close()
            raise
        made.append((net, cluster))
        return cluster

    yield make
    for net, cluster in made:
        try:
            cluster.close()
        finally:
            net.close()
