"""The rdma transport up to the device: lazy import, unavailability, fallback, QP info."""

from __future__ import annotations

import logging

import pytest

from kvctl.errors import UsageError
from kvctl.transfer import TransferEngine, TransportUnavailableError
from kvctl.transfer.transports.rdma import QpInfo, rdma_probe, rdma_unavailable_reason
from tests.transfer._helpers import memory_url

REASON = rdma_unavailable_reason()


def test_reason_comes_from_the_real_pyverbs() -> None:
    import pyverbs.device
    from pyverbs.pyverbs_error import PyverbsError

    try:
        devices = pyverbs.device.get_device_list()
    except PyverbsError:
        devices = []
    if devices:
        pytest.skip("this host has RDMA devices")
    assert REASON is not None
    assert ("devices" in REASON)


def test_missing_pyverbs_is_reported_with_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs → ImportError
    reason = rdma_unavailable_reason()
    assert reason is not None
    assert "pyverbs is not importable" in reason
    assert "python3-pyverbs" in (rdma_probe().hint or "")


@pytest.mark.skipif(REASON is None, reason="RDMA is available here")
def test_explicit_rdma_refuses_with_the_reason() -> None:
    with pytest.raises(TransportUnavailableError, match="RDMA unavailable: ") as info:
        TransferEngine("r", memory_url(), transport="rdma")
    assert info.value.hint
    assert "auto" in info.value.hint


@pytest.mark.skipif(REASON is None, reason="RDMA is available here")
def test_auto_falls_back_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "kvctl.transfer"):
        engine = TransferEngine("a", memory_url(), transport="auto")
    with engine:
        assert engine.rdma_unavailable_reason == REASON
        engine.register_segment("s", 4096)
        assert "rdma" not in engine.lookup("s").transports
    assert f"RDMA unavailable: {REASON}; auto transport will use shm or tcp" in caplog.text


def test_tcp_only_engine_does_not_probe_rdma() -> None:
    with TransferEngine("t", memory_url(), transport="tcp") as engine:
        assert engine.rdma_unavailable_reason == "not requested"


def test_qp_info_round_trip() -> None:
    info = QpInfo("mlx5_0", 1, 0, "fe80000000000000020c29fffe123456", 0x1234, 0xABCDE, 5)
    assert QpInfo.from_json(info.to_json(), source="k") == info


@pytest.mark.parametrize("patch", [
    {"qpn": 0}, {"qpn": 1 << 24}, {"psn": -1}, {"mtu": 6}, {"port": 0}, {"lid": 70000},
    {"gid": "xyz"}, {"gid": "12"},
])
def test_qp_info_rejects_out_of_range_values(patch: dict[str, object]) -> None:
    import json

    body = {"device": "d", "port": 1, "lid": 1, "gid": "", "qpn": 5, "psn": 7, "mtu": 3,
            **patch}
    with pytest.raises(UsageError, match="out-of-range"):
        QpInfo.from_json(json.dumps(body).encode(), source="peer")


def test_qp_info_rejects_malformed_json() -> None:
    with pytest.raises(UsageError, match="malformed"):
        QpInfo.from_json(b'{"device": "d"}', source="peer")
    with pytest.raises(UsageError, match="malformed"):
        QpInfo.from_json(b"not json", source="peer")


@pytest.mark.rdma
@pytest.mark.skipif(REASON is not None, reason=f"RDMA unavailable: {REASON}")
def test_rdma_round_trip() -> None:  # pragma: no cover - needs an RDMA device
    from kvctl.transfer import OpCode, TransferRequest

    url = memory_url()
    with TransferEngine("rt", url, transport="rdma") as tgt, TransferEngine(
            "ri", url, transport="rdma") as ini:
        tgt.register_segment("remote", 1 << 20)
        ini.register_segment("local", 1 << 20)
        ini.local_view("local")[:4] = b"rdma"
        ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, 4)], timeout_s=30)
        assert bytes(tgt.local_view("remote")[:4]) == b"rdma"
