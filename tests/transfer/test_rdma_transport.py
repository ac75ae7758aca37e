"""The rdma transport through the engine, on the fake verbs provider (one process).

Each test names the item of issue 16 it covers; all of them failed or hung on the first
transport (one device, port 1, GID 0, hop limit 1, completions counted, QP exchange through
the metadata service).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.transfer import OpCode, TransferEngine, TransferRequest, TransportUnavailableError
from kvctl.transfer.admin import segment_key
from kvctl.transfer.batch import TransferState
from kvctl.transfer.paths import RetryPolicy
from kvctl.transfer.transports.rdma import RdmaOptions, rdma_probe
from tests.fakes import pyverbs as fv
from tests.fakes.fabric import Fabric, fabric_fixture  # noqa: F401
from tests.fakes.pyverbs._hca import STATE
from tests.transfer._helpers import memory_url, pattern

MiB = 1 << 20


@contextlib.contextmanager
def engines(*, target: dict[str, Any] | None = None, initiator: dict[str, Any] | None = None,
            size: int = 8 * MiB, url: str | None = None) -> Iterator[tuple[TransferEngine,
                                                                          TransferEngine]]:
    url = url or memory_url()
    kw_t = {"transport": "rdma", **(target or {})}
    kw_i = {"transport": "rdma", **(initiator or {})}
    with TransferEngine("tgt", url, **kw_t) as tgt, TransferEngine("ini", url, **kw_i) as ini:
        tgt.register_segment("remote", size)
        ini.register_segment("local", size)
        yield tgt, ini


def two_nics(fabric: Fabric, **host: Any) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"),
                **{"retry_s": 0.01, **host})


def fill(engine: TransferEngine, name: str, run: int, size: int) -> bytes:
    data = pattern(run, 0, 0, size)
    engine.local_view(name)[:size] = data
    return data


def paths(engine: TransferEngine, batch: Any) -> set[str]:
    return {p for s in engine.status(batch) for p in s.path.split(",")}


def test_write_then_read_over_two_nics(fabric: Fabric) -> None:
    two_nics(fabric)
    with engines() as (tgt, ini):
        data = fill(ini, "local", 1, 8 * MiB)
        batch = ini.allocate_batch(1)
        result = ini.run(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                                 8 * MiB)], timeout_s=30)
        assert result.ok
        assert bytes(tgt.local_view("remote")) == data
        # a large request is sliced over both NICs; the row says which and how
        assert paths(ini, batch) == {"rdma:mlx5_0:1->mlx5_0:1[host->host]",
                                     "rdma:mlx5_1:1->mlx5_1:1[host->host]"}
        ini.free_batch(batch)
        tgt.local_view("remote")[:4096] = b"\x07" * 4096
        ini.transfer([TransferRequest(OpCode.READ, "local", 4096, "remote", 0, 4096)])
        assert bytes(ini.local_view("local")[4096:8192]) == b"\x07" * 4096


def test_item1_exchange_survives_a_pyverbs_error(fabric: Fabric) -> None:
    """Item 1: a PyverbsRDMAError while the target connects its QP is answered; later
    initiators still connect."""
    two_nics(fabric)
    with engines() as (tgt, ini):
        cm = tgt.lookup("remote").rdma[0]["cm"][0]
        host, _, port = cm.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.recv(33)
            sock.sendall(bytes(32))
            assert sock.recv(1) == b"\0"
            # a zero destination GID: the target's to_rtr fails with EINVAL
            bad = {"device": "mlx5_0", "port": 1, "lid": 0, "gid": "0" * 32, "qpn": 5,
                   "psn": 1, "mtu": 5}
            body = json.dumps({"v": 1, "initiator": "x", "target_nic": "mlx5_0:1",
                               "qp": bad}).encode()
            sock.sendall(struct.pack(">I", len(body)) + body)
            size = struct.unpack(">I", sock.recv(4))[0]
            reply = json.loads(sock.recv(size))
        assert "Failed to modify QP state to RTR" in reply["error"]
        fill(ini, "local", 2, MiB)
        assert ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, MiB)]).ok


def test_item2_requests_are_sliced_to_max_msg_sz(fabric: Fabric) -> None:
    """Item 2: no WR is longer than the port's max_msg_sz (a 4 GiB SGE overflowed)."""
    fabric.host(fabric.device("mlx5_0", "10.0.0.1", max_msg_sz=256 << 10), retry_s=0.01)
    with engines(initiator={"rdma": RdmaOptions(slice_bytes=8 * MiB)}) as (tgt, ini):
        assert ini._rdma is not None
        assert ini._rdma.slice_bytes == 256 << 10
        data = fill(ini, "local", 3, 8 * MiB)
        result = ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                               8 * MiB)])
        assert result.ok
        assert bytes(tgt.local_view("remote")) == data
        assert ini._rdma.stats()["posted"] == 32


def test_item2_a_5_gib_request_never_builds_an_oversized_sge(fabric: Fabric) -> None:
    """Item 2: the slices of a ≥ 4 GiB request all fit a 32-bit SGE length (the posters
    are replaced by a recorder: nothing moves, memory is never touched)."""
    import mmap

    two_nics(fabric)
    seen: list[int] = []
    big = 5 << 30
    url = memory_url()
    target_mem, local_mem = mmap.mmap(-1, big), mmap.mmap(-1, big)  # sparse: never touched
    with TransferEngine("t", url, transport="rdma") as tgt, TransferEngine(
            "i", url, transport="rdma") as ini:
        tgt.register_memory("remote", [target_mem])
        ini.register_memory("local", [local_mem])
        assert ini._rdma is not None
        for poster in ini._rdma._posters.values():
            poster.submit = seen.extend  # type: ignore[method-assign]
        batch = ini.allocate_batch(1)
        ini.submit(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, big)])
        lengths = [s.length for s in seen]  # type: ignore[attr-defined]
        assert sum(lengths) == big
        assert max(lengths) <= ini._rdma.slice_bytes < 1 << 32
        batch.settle([0] * len(lengths), path="test")  # settle what the recorder kept
    target_mem.close()
    local_mem.close()


def test_item3_more_requests_than_the_send_queue_holds(fabric: Fabric) -> None:
    """Item 3: a batch far above max_send_wr is posted as the QP drains; nothing leaks
    into the next batch."""
    two_nics(fabric)
    options = RdmaOptions(max_send_wr=8, cq_entries=16)
    with engines(initiator={"rdma": options}) as (tgt, ini):
        data = fill(ini, "local", 4, 8 * MiB)
        reqs = [TransferRequest(OpCode.WRITE, "local", k * 4096, "remote", k * 4096, 4096)
                for k in range(1500)]
        batch = ini.allocate_batch(len(reqs))
        result = ini.run(batch, reqs, timeout_s=60)
        assert result.ok, result.first_cause
        assert bytes(tgt.local_view("remote")[: 1500 * 4096]) == data[: 1500 * 4096]
        ini.free_batch(batch)
        stats = ini._rdma.stats() if ini._rdma else {}
        assert stats["posted"] == stats["completed"] == 1500
        assert stats["stale"] == 0


def test_item4_memlock_failure_degrades_auto_to_tcp(fabric: Fabric,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Item 4: a registration failure is "unavailable: why" with the ulimit fix; auto
    serves over tcp and says so; explicit rdma fails with the same reason."""
    two_nics(fabric, memlock_bytes=2 * MiB)
    url = memory_url()
    with caplog.at_level(logging.WARNING, "kvctl.transfer"), TransferEngine(
            "a", url, transport="auto") as engine:
        handle = engine.register_segment("big", 4 * MiB)
        info = engine.lookup("big")
        assert "rdma" not in info.transports
        assert info.rdma == ()
        assert handle.kind == "shm"
        reason = engine.rdma_unavailable_reason or ""
        assert "locked-memory limit" in reason
        assert "ulimit -l" in reason
        assert "ulimit -l unlimited" in (engine.rdma_unavailable_hint or "")
    assert "auto transport will use shm or tcp" in caplog.text
    with TransferEngine("b", url, transport="rdma") as engine, pytest.raises(
            TransportUnavailableError, match="locked-memory") as exc:
        engine.register_segment("big2", 4 * MiB)
    assert "ulimit -l" in (exc.value.hint or "")


def test_item4_auto_degrade_republishes_segments_without_rdma(fabric: Fabric) -> None:
    two_nics(fabric, memlock_bytes=3 * MiB)
    with TransferEngine("a", memory_url(), transport="auto") as engine:
        engine.register_segment("small", MiB)
        assert "rdma" in engine.lookup("small").transports
        engine.register_segment("big", 4 * MiB)  # over the limit: RDMA off for the engine
        assert "rdma" not in engine.lookup("small").transports
        assert STATE.pinned_bytes == 0


def test_item5_exchange_does_not_need_the_targets_metadata(fabric: Fabric) -> None:
    """Item 5: the initiator knows the target only from a descriptor copied into its own
    private metadata (as store clients do); the QP exchange goes to the target directly."""
    two_nics(fabric)
    with TransferEngine("node", memory_url(), transport="auto") as node, TransferEngine(
            "client", memory_url(), transport="rdma") as client:
        node.register_segment("node.seg", 2 * MiB)
        raw = node.metadata.get(segment_key("", "node.seg"))
        assert raw is not None
        client.metadata.put(segment_key("", "node.seg"), raw)
        client.register_segment("client.buf", 2 * MiB)
        handle = client.open_segment("node.seg")
        assert handle.transport == "rdma"
        data = fill(client, "client.buf", 5, 2 * MiB)
        assert client.transfer([TransferRequest(OpCode.WRITE, "client.buf", 0, "node.seg", 0,
                                                2 * MiB)], timeout_s=10).ok
        assert bytes(node.local_view("node.seg")) == data


def test_item6_efa_is_not_rdma_here(fabric: Fabric, caplog: pytest.LogCaptureFixture) -> None:
    """Item 6: EFA devices offer no RC: auto uses tcp with the reason, explicit rdma fails."""
    fabric.host(fv.efa_device("rdmap16s27"))
    with caplog.at_level(logging.INFO, "kvctl.transfer"), TransferEngine(
            "e", memory_url(), transport="auto") as engine:
        engine.register_segment("s", 4096)
        assert "rdma" not in engine.lookup("s").transports
        assert "EFA" in (engine.rdma_unavailable_reason or "")
    assert "auto transport will use shm or tcp" in caplog.text
    with pytest.raises(TransportUnavailableError, match="EFA") as info:
        TransferEngine("r", memory_url(), transport="rdma")
    assert "tcp" in (info.value.hint or "")


def test_item6_efa_beside_a_real_nic_is_left_out(fabric: Fabric) -> None:
    fabric.host(fv.efa_device("rdmap16s27"), fabric.device("mlx5_0", "10.0.0.1"))
    probe = rdma_probe()
    assert [p.name for p in probe.ports] == ["mlx5_0:1"]
    assert any("EFA" in line for line in probe.rejected)


def test_item7_late_completions_never_settle_a_later_batch(fabric: Fabric) -> None:
    """Item 7: completions are matched by wr_id; a QP that timed out is failed, drained and
    destroyed, and its late completion is ignored, not counted by the next batch."""
    spec = fabric.host(fabric.device("mlx5_0", "10.0.0.1"), retry_s=0.01)
    options = RdmaOptions(timeout_s=0.3, retry=RetryPolicy(max_retries=0))
    with engines(initiator={"rdma": options}) as (tgt, ini):
        fill(ini, "local", 6, MiB)
        spec.delay_s = 1.0  # the target NIC answers after the initiator gave up
        first = ini.allocate_batch(1)
        result = ini.run(first, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                                 4096)], timeout_s=10)
        (status,) = ini.status(first)
        assert status.state is TransferState.TIMEOUT
        assert "no completion within 0.3 s" in (status.cause or "")
        spec.delay_s = 0.0
        data = fill(ini, "local", 7, MiB)
        second = ini.allocate_batch(1)
        result = ini.run(second, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                                  MiB)], timeout_s=10)
        assert result.ok
        assert bytes(tgt.local_view("remote")[:MiB]) == data
        assert ini._rdma is not None
        stats = ini._rdma.stats()
        assert stats["connections"] == 1  # the failed QP was destroyed, a new one serves


def test_item7_flushed_requests_name_the_first_error(fabric: Fabric) -> None:
    """Item 7: after a remote access error the QP's other WRs complete flushed; every
    request says which error."""
    two_nics(fabric)
    options = RdmaOptions(retry=RetryPolicy(max_retries=0))
    with engines(initiator={"rdma": options}) as (_tgt, ini):
        ini.open_segment("remote")
        stale = ini._remote["remote"]
        info = stale.info
        bad = tuple({**b, "nics": {k: {**v, "rkey": v["rkey"] ^ 1} for k, v in
                                   b["nics"].items()}} for b in info.rdma)
        stale.info = dataclasses.replace(info, rdma=bad)
        batch = ini.allocate_batch(8)
        ini.run(batch, [TransferRequest(OpCode.WRITE, "local", k * 4096, "remote", k * 4096,
                                        4096) for k in range(8)], timeout_s=10)
        causes = [s.cause or "" for s in ini.status(batch)]
        assert all(s.state is TransferState.FAILED for s in ini.status(batch))
        assert any("IBV_WC_REM_ACCESS_ERR" in c for c in causes)
        assert all("IBV_WC_REM_ACCESS_ERR" in c for c in causes)  # flushed ones name it too


def test_item8_routed_roce_uses_the_v2_gid_and_hop_limit_255(fabric: Fabric) -> None:
    """Item 8: across a router only RoCE v2 with a hop limit above 1 arrives."""
    fabric.host(fabric.device("mlx5_0", "10.0.0.1", subnet="rack-a"),
                fabric.device("mlx5_1", "10.0.1.1", subnet="rack-b"), retry_s=0.01)
    probe = rdma_probe()
    assert {(p.name, p.gid_index, p.gid_type) for p in probe.ports} == {
        ("mlx5_0:1", 3, "RoCE v2"), ("mlx5_1:1", 3, "RoCE v2")}
    with engines(target={"rdma_devices": ["mlx5_1"]},
                 initiator={"rdma_devices": ["mlx5_0"]}) as (tgt, ini):
        data = fill(ini, "local", 8, MiB)
        assert ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, MiB)]).ok
        assert bytes(tgt.local_view("remote")[:MiB]) == data
    once = RdmaOptions(hop_limit=1, retry=RetryPolicy(max_retries=0))
    with engines(target={"rdma_devices": ["mlx5_1"]},
                 initiator={"rdma": dataclasses.replace(once, nics=("mlx5_0",))}) as (_, ini):
        result = ini.allocate_batch(1)
        ini.run(result, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, 4096)],
                timeout_s=10)
        (status,) = ini.status(result)
        assert "IBV_WC_RETRY_EXC_ERR" in (status.cause or "")


def test_item8_gid_index_override_is_checked(fabric: Fabric,
                                             caplog: pytest.LogCaptureFixture) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"))
    empty = rdma_probe(RdmaOptions(gid_index=7))
    assert empty.reason is not None
    assert "GID index 7 is empty" in empty.reason
    assert "--gid-index" in (empty.hint or "")
    with caplog.at_level(logging.WARNING, "kvctl.transfer.rdma"):
        v1 = rdma_probe(RdmaOptions(gid_index=2))
    assert [p.gid_index for p in v1.ports] == [2]
    assert "not RoCE v2" in caplog.text


def test_item8_no_roce_v2_gid_means_unavailable(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1", v2=False))
    probe = rdma_probe()
    assert probe.reason is not None
    assert "no RoCE v2 GID" in probe.reason
    assert probe.hint is not None
    assert "IPv4 address" in probe.hint


def test_item8_infiniband_by_lid_and_path_mtu_from_the_ports(fabric: Fabric) -> None:
    fabric.host(fv.DeviceSpec("mlx5_0", [fv.ib_port(7, active_mtu=3)]),
                fv.DeviceSpec("mlx5_1", [fv.ib_port(9)]), retry_s=0.01)
    with engines(target={"rdma_devices": ["mlx5_1"]},
                 initiator={"rdma_devices": ["mlx5_0"]}) as (tgt, ini):
        # the link carries 1024-byte frames: a 4096 path MTU would drop every message
        data = fill(ini, "local", 9, MiB)
        assert ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, MiB)]).ok
        assert bytes(tgt.local_view("remote")[:MiB]) == data


def test_item8_no_active_port(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1", state=fv.enums.IBV_PORT_DOWN))
    with pytest.raises(TransportUnavailableError, match="port state DOWN") as info:
        TransferEngine("r", memory_url(), transport="rdma")
    assert "PORT_ACTIVE" in (info.value.hint or "")


def test_item9_a_failed_nic_is_retried_on_another_and_counted(fabric: Fabric) -> None:
    """Item 9: one context per usable port; a slice that fails on one NIC is retried on
    another; the batch counts the retries."""
    two_nics(fabric)
    with engines() as (tgt, ini):
        fill(ini, "local", 10, 8 * MiB)
        assert ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                             8 * MiB)]).ok  # QPs on both NICs
        fv.set_link("mlx5_1", 1, up=False)
        data = fill(ini, "local", 11, 8 * MiB)
        batch = ini.allocate_batch(1)
        result = ini.run(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                                 8 * MiB)], timeout_s=30)
        assert result.ok, result.first_cause
        assert result.retries >= 1
        assert bytes(tgt.local_view("remote")) == data
        fv.set_link("mlx5_1", 1, up=True)


def test_item9_a_down_port_is_not_used_and_pins_are_kept(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"),
                fabric.device("mlx5_2", "10.0.0.3", state=fv.enums.IBV_PORT_DOWN))
    probe = rdma_probe()
    assert [p.name for p in probe.ports] == ["mlx5_0:1", "mlx5_1:1"]
    assert "mlx5_2:1: port state DOWN" in probe.rejected
    with engines(target={"rdma_devices": ["mlx5_1"]},
                 initiator={"rdma_devices": ["mlx5_1"]}) as (_, ini):
        fill(ini, "local", 12, 4 * MiB)
        batch = ini.allocate_batch(1)
        assert ini.run(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                               4 * MiB)]).ok
        assert paths(ini, batch) == {"rdma:mlx5_1:1->mlx5_1:1[host->host]"}


def test_item9_nics_per_buffer_from_the_ranking(fabric: Fabric) -> None:
    fabric.host(fabric.device("mlx5_0", "10.0.0.1"), fabric.device("mlx5_1", "10.0.0.2"))
    ranking = {"cpu:0": ["mlx5_1"], "cpu:1": ["mlx5_0"]}
    options = RdmaOptions(ranking=lambda loc: ranking.get(loc, ()))
    with TransferEngine("t", url := memory_url(), transport="rdma", rdma=options) as tgt, \
            TransferEngine("i", url, transport="rdma", rdma=options) as ini:
        tgt.register_segment("remote", 2 * MiB, location="cpu:1")
        assert list(tgt.lookup("remote").rdma[0]["nics"]) == ["mlx5_0:1"]
        ini.register_segment("local", 2 * MiB, location="cpu:0")
        batch = ini.allocate_batch(1)
        assert ini.run(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0,
                                               2 * MiB)]).ok
        assert paths(ini, batch) == {"rdma:mlx5_1:1->mlx5_0:1[host->host]"}


def test_item10_local_file_segment_against_an_rdma_target(fabric: Fabric,
                                                          tmp_path: Path) -> None:
    """Item 10: a local file (no MR) is staged through registered memory, no KeyError."""
    two_nics(fabric)
    url = memory_url()
    with TransferEngine("t", url, transport="rdma") as tgt, TransferEngine(
            "i", url, transport="rdma") as ini:
        tgt.register_segment("remote", 4 * MiB)
        data = pattern(13, 0, 0, 3 * MiB)
        (tmp_path / "f").write_bytes(data)
        ini.register_segment("disk", 3 * MiB, kind="file", path=tmp_path / "f")
        batch = ini.allocate_batch(1)
        assert ini.run(batch, [TransferRequest(OpCode.WRITE, "disk", 0, "remote", 0,
                                               3 * MiB)]).ok
        assert bytes(tgt.local_view("remote")[: 3 * MiB]) == data
        assert all("[staged->host]" in p for p in paths(ini, batch))
        tgt.local_view("remote")[:MiB] = b"\x42" * MiB
        assert ini.transfer([TransferRequest(OpCode.READ, "disk", 0, "remote", 0, MiB)]).ok
        assert (tmp_path / "f").read_bytes()[:MiB] == b"\x42" * MiB


def test_item11_unregister_deregisters_the_memory_regions(fabric: Fabric) -> None:
    """Item 11: unregistering releases the pinned pages and the old rkey stops working."""
    two_nics(fabric)
    options = RdmaOptions(retry=RetryPolicy(max_retries=0))
    with engines(initiator={"rdma": options}, size=MiB) as (tgt, ini):
        ini.open_segment("remote")
        pinned = STATE.pinned_bytes
        tgt.unregister_segment("remote")
        assert STATE.pinned_bytes == pinned - MiB * 2  # one MR on each of the two NICs
        batch = ini.allocate_batch(1)
        ini.run(batch, [TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, 4096)],
                timeout_s=10)
        (status,) = ini.status(batch)
        assert status.state is TransferState.FAILED
        assert "IBV_WC_REM_ACCESS_ERR" in (status.cause or "")


def test_token_guards_the_qp_exchange(fabric: Fabric) -> None:
    two_nics(fabric)
    url = memory_url()
    with TransferEngine("t", url, transport="rdma", token="s3cret") as tgt, TransferEngine(
            "i", url, transport="rdma", token="s3cret") as ini:
        tgt.register_segment("remote", MiB)
        ini.register_segment("local", MiB)
        data = fill(ini, "local", 14, MiB)
        assert ini.transfer([TransferRequest(OpCode.WRITE, "local", 0, "remote", 0, MiB)]).ok
        assert bytes(tgt.local_view("remote")) == data
        cm = tgt.lookup("remote").rdma[0]["cm"][0]
        host, _, port = cm.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            assert sock.recv(33)[0] & 1  # token required
            sock.sendall(bytes(32))
            assert sock.recv(1) == b"\1"


def test_item9_default_ranking_is_topos() -> None:
    """Item 9: with kvctl topo's ranking of an 8-NIC host, a GPU buffer uses its PIX NIC
    and host memory its NUMA node's NICs."""
    from kvctl.topo.recorded import load_recorded
    from kvctl.transfer.transports.rdma.devices import NicPort, order_for, topo_ranking

    topology = load_recorded(Path(__file__).resolve().parents[2] / "examples" / "hosts"
                             / "h100-8gpu.tar.gz")
    ranking = topo_ranking(topology)
    ports = [NicPort(f"mlx5_{k}", 1, "InfiniBand", k + 1, "", None, None, 5, 1 << 30)
             for k in range(8)]
    assert [p.name for p in order_for("cuda:5", ports, ranking)] == ["mlx5_5:1"]
    assert [p.name for p in order_for("cpu:1", ports, ranking)] == [
        "mlx5_4:1", "mlx5_5:1", "mlx5_6:1", "mlx5_7:1"]
