"""Foreign engines' descriptors, rendezvous, transport rules and isolated runs."""

from __future__ import annotations

import json
import secrets

import pytest

from kvctl.bench.engines import driver_class
from kvctl.bench.engines.base import DriverPlan
from kvctl.bench.engines.foreign import (
    ForeignTarget,
    decode_descriptor,
    descriptor_key,
    encode_descriptor,
    fetch_targets,
)
from kvctl.bench.engines.mooncake import MooncakeDriver, MooncakeError, installed_transport
from kvctl.bench.engines.nixl import NixlDriver
from kvctl.bench.isolated import IsolatedJob, _rebuild, run_isolated
from kvctl.bench.runner import plan_for
from kvctl.bench.spec import BenchSettings, build_sweep
from kvctl.bench.target.kvctl import TargetSpec
from kvctl.bench.target.serve import TargetSet
from kvctl.bench.verify import IntegrityError
from kvctl.errors import AuthError, ExitCode, KvctlError, UnavailableError, UsageError
from kvctl.metadata import MetadataError, MetadataServer, open_metadata

TARGET = ForeignTarget(engine="nixl", transport="tcp", used="ucx-tcp", host="198.18.0.1",
                       address=0x7F00_0000_1000, region_bytes=1 << 20,
                       agent="kvctl-bench-nixl-target-h1-42-tcp",
                       agent_metadata=bytes(range(256)))


def _memory_plan(region_bytes: int = 1 << 20) -> tuple[DriverPlan, str]:
    url = f"memory://foreign-{secrets.token_hex(4)}"
    return DriverPlan(region_bytes=region_bytes, thread_stride_bytes=region_bytes,
                      peer="bench-a", metadata=url), url


def test_a_target_survives_json() -> None:
    doc = json.loads(json.dumps(TARGET.to_json()))
    assert ForeignTarget.from_json(doc) == TARGET
    with pytest.raises(ValueError, match="bad target descriptor"):
        ForeignTarget.from_json({"engine": "nixl"})


@pytest.mark.parametrize("token", [None, "s3cret"])
def test_descriptors_decode_with_the_token_they_were_signed_with(token: str | None) -> None:
    raw = encode_descriptor("nixl", [TARGET], token)
    assert decode_descriptor(raw, token, where="here") == {"tcp": TARGET}


def test_a_token_here_rejects_an_unsigned_or_foreign_descriptor() -> None:
    with pytest.raises(AuthError, match="not signed") as raised:
        decode_descriptor(encode_descriptor("nixl", [TARGET], None), "s3cret", where="x")
    assert "KVCTL_TOKEN" in (raised.value.hint or "")
    with pytest.raises(AuthError, match="another token"):
        decode_descriptor(encode_descriptor("nixl", [TARGET], "other"), "s3cret", where="x")
    tampered = json.loads(encode_descriptor("nixl", [TARGET], "s3cret"))
    tampered["targets"][0]["address"] += 4096
    with pytest.raises(AuthError, match="another token"):
        decode_descriptor(json.dumps(tampered).encode(), "s3cret", where="x")


def test_junk_is_not_a_descriptor() -> None:
    with pytest.raises(UsageError, match="unreadable"):
        decode_descriptor(b'{"kind": "something else"}', None, where="x")


def test_targets_are_found_under_the_segment_and_engine() -> None:
    plan, url = _memory_plan()
    with pytest.raises(UnavailableError, match="serves no nixl engine") as raised:
        fetch_targets(plan, "nixl")
    assert "--engine nixl" in (raised.value.hint or "")
    with open_metadata(url) as client:
        client.put(descriptor_key("bench-a", "nixl"), encode_descriptor("nixl", [TARGET], None))
    assert fetch_targets(plan, "nixl") == {"tcp": TARGET}


def test_a_foreign_driver_refuses_a_small_or_missing_target_before_connecting() -> None:
    plan, url = _memory_plan(region_bytes=4 << 20)
    mooncake = ForeignTarget(engine="mooncake", transport="tcp", used="tcp", host="198.18.0.1",
                             address=4096, region_bytes=1 << 20, session="198.18.0.1:15000")
    with open_metadata(url) as client:
        client.put(descriptor_key("bench-a", "mooncake"),
                   encode_descriptor("mooncake", [mooncake], None))
    with MooncakeDriver() as driver:
        driver.start(plan)
        with pytest.raises(UsageError, match="the sweep needs 4 MiB"):
            driver.prepare("tcp")
        with pytest.raises(UnavailableError, match="over tcp, not rdma"):
            driver.prepare("rdma")
        with pytest.raises(UnavailableError, match="no 'shm' transport"):
            driver.prepare("shm")


def test_nixl_shared_memory_does_not_cross_hosts() -> None:
    NixlDriver.check_transport("shm", cross_host=False)
    with pytest.raises(UnavailableError, match="same-host peers only"):
        NixlDriver.check_transport("shm", cross_host=True)


def test_mooncake_transport_is_what_its_rule_installs() -> None:
    none = json.dumps({"cpu:0": [[], []]})
    some = json.dumps({"cpu:0": [["mlx5_0"], ["mlx5_1"]]})
    assert installed_transport(none, {}) == "tcp"
    assert installed_transport(some, {}) == "rdma"
    assert installed_transport(some, {"MC_FORCE_TCP": "1"}) == "tcp"
    assert installed_transport(none, {"MC_FORCE_HCA": "1"}) == "rdma"
    with pytest.raises(MooncakeError, match="unreadable"):
        installed_transport("not json", {})


def test_a_childs_error_comes_back_as_the_same_type() -> None:
    error = _rebuild(IntegrityError.__module__, "IntegrityError", "block 2 differs", "rerun",
                     int(ExitCode.CHECK_FAILED))
    assert type(error) is IntegrityError
    assert (error.cause, error.hint, error.exit_code) == ("block 2 differs", "rerun",
                                                         ExitCode.CHECK_FAILED)
    unknown = _rebuild("elsewhere", "Oops", "cause", None, int(ExitCode.UNAVAILABLE))
    assert type(unknown) is KvctlError
    assert unknown.exit_code is ExitCode.UNAVAILABLE


@pytest.mark.integration
def test_an_isolated_engine_reports_an_unreachable_target_as_a_metadata_error() -> None:
    if driver_class("mooncake").unavailable_reason() is not None:
        pytest.skip("mooncake unavailable")
    sweep = build_sweep(BenchSettings(op="write", transport="tcp", block_size="4KiB",
                                      batch_size="2", iterations=1, warmup=0))
    plan = plan_for(sweep, peer="127.0.0.1:1", timeout_s=2)
    with pytest.raises(MetadataError, match="cannot reach"):
        list(run_isolated(IsolatedJob(engine="mooncake", sweep=sweep, plan=plan,
                                      nic_rates={}, run_id=1)))


@pytest.mark.integration
def test_a_target_set_publishes_and_withdraws_its_descriptors() -> None:
    if driver_class("mooncake").unavailable_reason() is not None:
        pytest.skip("mooncake unavailable")
    key = descriptor_key("bench-a", "mooncake")
    with MetadataServer(token="s3cret") as server, \
            open_metadata(server.url, token="s3cret") as client:
        spec = TargetSpec(region_bytes=1 << 20, metadata=server.url, segment="bench-a",
                          token="s3cret")
        with TargetSet(spec, ("mooncake",), ("shm", "tcp")) as targets:
            info = targets.info
            assert info is not None
            assert info.address is None
            assert info.engines == ("mooncake",)
            assert info.peer == "bench-a"
            assert [(t.transport, t.used, t.host) for t in info.foreign] == [
                ("tcp", "tcp", "127.0.0.1")]
            assert [(s.engine, s.transport) for s in info.skipped] == [("mooncake", "shm")]
            plan = DriverPlan(region_bytes=1 << 20, thread_stride_bytes=1 << 20,
                              peer="bench-a", metadata=server.url, token="s3cret")
            assert fetch_targets(plan, "mooncake") == {"tcp": info.foreign[0]}
        assert client.get(key) is None
