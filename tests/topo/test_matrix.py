"""Whole GPU x NIC and GPU x GPU matrices for the standard fixture hosts."""

from collections.abc import Callable

from kvctl.probe.host import scan_sysfs
from kvctl.probe.nvml import NvLink, NvmlGpu, NvmlReport
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.topo.build import build_topology
from kvctl.topo.classify import classify
from kvctl.topo.model import LinkClass, NicKind, Topology
from tests.fixtures.sysfs import (
    Bridge,
    HostSpec,
    Rdma,
    Switch,
    a100_host,
    build_sysfs,
    empty_host,
    h100_host,
    roce_port,
    vm_host,
    workstation_host,
)

Make = Callable[[HostSpec], Topology]


def _values(topology: Topology) -> dict[str, dict[str, str]]:
    return {g: {n: c.value for n, c in row.items()} for g, row in topology.gpu_nic.items()}


def test_h100_matrix(topology_of: Make) -> None:
    t = topology_of(h100_host())
    assert [g.name for g in t.gpus] == [f"GPU{i}" for i in range(8)]
    assert [g.pci for g in t.gpus] == sorted(g.pci for g in t.gpus)

    def expected(gpu: int, nic: int) -> str:
        if gpu == nic:
            return "PIX"
        if gpu // 2 == nic // 2:
            return "PHB"
        return "NODE" if gpu // 4 == nic // 4 else "SYS"

    want = {
        f"GPU{g}": {**{f"mlx5_{n}": expected(g, n) for n in range(8)},
                    "eno1": "NODE" if g < 4 else "SYS"}
        for g in range(8)
    }
    assert _values(t) == want
    gpu_want = {
        f"GPU{a}": {f"GPU{b}": "X" if a == b else expected(a, b) for b in range(8)}
        for a in range(8)
    }
    assert t.gpu_gpu == gpu_want
    assert len(t.pcie_switches) == 9  # one per GPU/NIC pair, one above the NVSwitches
    assert len(t.nvswitches) == 2
    assert {n.name: n.kind for n in t.nics}["eno1"] is NicKind.ETHERNET


def test_a100_two_level_switches(topology_of: Make) -> None:
    t = topology_of(a100_host())
    near = {"mlx5_0": "PXB", "mlx5_1": "PXB", "mlx5_2": "PXB"}
    far = {"mlx5_3": "SYS", "mlx5_4": "SYS", "mlx5_5": "SYS"}
    assert _values(t) == {
        "GPU0": near | far,
        "GPU1": near | far,
        "GPU2": dict.fromkeys(near, "SYS") | dict.fromkeys(far, "PXB"),
        "GPU3": dict.fromkeys(near, "SYS") | dict.fromkeys(far, "PXB"),
    }
    assert t.gpu_gpu["GPU0"] == {"GPU0": "X", "GPU1": "PIX", "GPU2": "SYS", "GPU3": "SYS"}
    levels = sorted(s.level for s in t.pcie_switches)
    assert levels == [1, 1, 2, 2]
    # the dual-port card: two functions, two RDMA devices, each with its own netdev
    dual = [n for n in t.nics if n.name in ("mlx5_1", "mlx5_2")]
    assert [n.pci[:-1] for n in dual] == [dual[0].pci[:-1]] * 2
    assert [n.ports[0].netdev for n in dual] == ["ens1f0np0", "ens1f1np1"]


def test_workstation_one_gpu_ethernet(topology_of: Make) -> None:
    t = topology_of(workstation_host())
    assert _values(t) == {"GPU0": {"enp5s0": "PHB"}}
    assert t.gpus[0].model == "NVIDIA GeForce RTX 4090"  # the audio function is no GPU
    assert t.nics[0].rate_gbps == 2.5


def test_vm_unknown_numa_counts_as_sys(topology_of: Make) -> None:
    t = topology_of(vm_host())
    assert _values(t) == {"GPU0": {"mlx5_0": "SYS"}}
    assert t.gpus[0].numa_node is None


def test_host_without_gpu_or_nic(topology_of: Make) -> None:
    t = topology_of(empty_host())
    assert (t.gpus, t.nics, t.gpu_nic) == ((), (), {})


def test_one_function_two_ports(topology_of: Make) -> None:
    spec = HostSpec(numa={0: "0-3"}, bridges=[Bridge(numa=0, bus=0, ports=[
        Rdma("mlx4_0", [roce_port("eth2"), roce_port("eth3", state="1: DOWN")])])])
    (nic,) = topology_of(spec).nics
    assert [(p.port, p.netdev, p.state.value) for p in nic.ports] == [
        (1, "eth2", "ACTIVE"), (2, "eth3", "DOWN")]
    assert nic.state.value == "ACTIVE"


def test_nvml_fills_names_and_nvlinks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    facts = scan_sysfs(SysfsReader(build_sysfs(tmp_path / "h", h100_host())))
    switch = facts.nvswitches[0]
    gpus = tuple(
        NvmlGpu(index=i, pci=pci, name="NVIDIA H100 80GB HBM3 (NVML)",
                nvlinks=tuple(NvLink(k, switch, True) for k in range(18)))
        for i, pci in enumerate(facts.gpus)
    )
    t = build_topology(facts, NvmlReport("550.54.15", gpus), Unavailable("verbs", "none"))
    assert t.gpus[3].model == "NVIDIA H100 80GB HBM3 (NVML)"
    assert t.gpu_gpu["GPU0"]["GPU7"] == "NV18"
    assert t.source("nvml") is not None
    assert t.source("nvml").available


def test_classify_unit_cases() -> None:
    rp = ("pci0000:00", "0000:00:01.0")
    assert classify((*rp, "0000:01:00.0"), (*rp, "0000:01:00.1"), 0, 0) is LinkClass.PIX
    assert classify(("pci0000:00", "0000:00:01.0", "0000:01:00.0"),
                    ("pci0000:00", "0000:00:02.0", "0000:02:00.0"), None, None) is LinkClass.PHB
    assert classify(("pci0000:00", "0000:00:01.0"), ("pci0000:80", "0000:80:01.0"), 0,
                    0) is LinkClass.NODE
    assert classify(("pci0000:00", "0000:00:01.0"), ("pci0000:80", "0000:80:01.0"), None,
                    None) is LinkClass.SYS
    assert classify(None, rp, 0, 0) is LinkClass.SYS


def test_switch_count_decides_pix_and_pxb(topology_of: Make) -> None:
    from tests.fixtures.sysfs import Gpu
    spec = HostSpec(numa={0: "0-3"}, bridges=[Bridge(numa=0, bus=0, ports=[
        Switch([Switch([Switch([Gpu()])]), Rdma("mlx5_0")])])])
    assert _values(topology_of(spec)) == {"GPU0": {"mlx5_0": "PXB"}}
