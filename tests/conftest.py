"""Shared fixtures: the in-process CLI runner and real servers (etcd, Redis) on loopback."""

import os

import pytest

pytest_plugins = ["tests.fixtures.cli", "tests.fixtures.hosts", "tests.fixtures.servers",
                  "tests.fixtures.sysfs"]


@pytest.fixture(autouse=True)
def _isolated_kvctl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never see the developer's own KVCTL_* settings."""
    for key in list(os.environ):
        if key.startswith("KVCTL_"):
            monkeypatch.delenv(key)
