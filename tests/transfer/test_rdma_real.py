"""Everything up to the device against the real pyverbs of this host (rdma-core 44, no RDMA
device): listing fails cleanly and every layer says "unavailable: why" with a fix."""

from __future__ import annotations

import logging

import pytest

from kvctl.transfer import TransferEngine, TransportUnavailableError
from kvctl.transfer.transports.rdma import RdmaTransport, rdma_probe
from kvctl.transfer.transports.rdma.provider import load_verbs
from tests.transfer._helpers import memory_url


def _has_devices() -> bool:
    verbs = load_verbs("pyverbs")
    try:
        return bool(verbs.device.get_device_list())
    except verbs.Error:
        return False


pytestmark = pytest.mark.skipif(_has_devices(), reason="this host has RDMA devices")


def test_probe_says_why_with_a_fix() -> None:
    probe = rdma_probe()
    assert probe.ports == ()
    assert probe.reason == "cannot list RDMA devices (libibverbs: Failed to get devices list)"
    assert probe.hint is not None
    assert "driver" in probe.hint


def test_transport_refuses_with_the_reason() -> None:
    with pytest.raises(TransportUnavailableError, match="cannot list RDMA devices") as info:
        RdmaTransport(engine_name="x")
    assert "ibv_devices" in (info.value.hint or "")


def test_explicit_rdma_engine_fails_with_unavailable_why() -> None:
    with pytest.raises(TransportUnavailableError) as info:
        TransferEngine("r", memory_url(), transport="rdma")
    assert str(info.value.cause).startswith("RDMA unavailable: cannot list RDMA devices")
    assert "auto" in (info.value.hint or "")


def test_auto_engine_uses_tcp_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "kvctl.transfer"), TransferEngine(
            "a", memory_url(), transport="auto") as engine:
        engine.register_segment("s", 4096)
        assert engine.lookup("s").transports == ("shm", "tcp")
        assert engine.rdma_unavailable_reason == rdma_probe().reason
    assert "RDMA unavailable: cannot list RDMA devices" in caplog.text
    assert "auto transport will use shm or tcp" in caplog.text
