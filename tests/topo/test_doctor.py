"""Each doctor check firing on a broken host and staying quiet on a healthy one."""

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kvctl.probe.host import scan_sysfs
from kvctl.probe.nvml import NvmlReport
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import VerbsDevice, VerbsPort, VerbsReport
from kvctl.topo.build import build_topology
from kvctl.topo.doctor import Finding, Severity, has_errors, run_doctor
from kvctl.topo.model import Topology
from kvctl.topo.rank import rank_nics
from tests.fixtures.sysfs import (
    Bridge,
    Gpu,
    HostSpec,
    Link,
    Port,
    Rdma,
    Switch,
    a100_host,
    build_sysfs,
    h100_host,
    nvswitch_report,
    roce_port,
    vm_host,
    workstation_host,
)

Make = Callable[[HostSpec], Topology]


def _found(t: Topology, check: str) -> list[tuple[str, Severity]]:
    return [(f.subject, f.severity) for f in run_doctor(t) if f.check == check]


def _non_source(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.check != "source"]


def _h100_nvml(tmp_path: Path, **changes: object) -> NvmlReport:
    facts = scan_sysfs(SysfsReader(build_sysfs(tmp_path / "nvml-addresses", h100_host())))
    return nvswitch_report(list(facts.gpus), list(facts.nvswitches), **changes)  # type: ignore[arg-type]


def test_healthy_hosts_have_no_findings(topology_of: Make, tmp_path: Path) -> None:
    for spec in (a100_host(), workstation_host()):
        findings = run_doctor(topology_of(spec))
        assert _non_source(findings) == []
        assert not has_errors(findings)
    findings = run_doctor(topology_of(h100_host(), nvml=_h100_nvml(tmp_path)))
    assert _non_source(findings) == []


def test_nvswitch_host_without_nvml_says_nvlink_is_unknown(topology_of: Make,
                                                           tmp_path: Path) -> None:
    t = topology_of(h100_host())
    assert _found(t, "nvlink") == [("host", Severity.WARNING)]
    assert t.gpu_gpu["GPU0"]["GPU7"] == "SYS"  # the PCIe path: all sysfs knows
    down = _h100_nvml(tmp_path)
    gpus = list(down.gpus)
    gpus[3] = dataclasses.replace(gpus[3], nvlinks=())
    t = topology_of(h100_host(), nvml=dataclasses.replace(down, gpus=tuple(gpus)))
    assert _found(t, "nvlink") == [("GPU3", Severity.WARNING)]
    assert t.gpu_gpu["GPU3"]["GPU0"] == "NODE"
    assert t.gpu_gpu["GPU0"]["GPU7"] == "NV18"


def test_idle_gpu_link_speed_is_no_finding(topology_of: Make) -> None:
    """The false alarm of every healthy idle host: a GPU at 2.5 GT/s of 16 (P8)."""
    spec = HostSpec(numa={0: "0-3"}, modules=["nvidia_peermem"], bridges=[
        Bridge(numa=0, bus=0, ports=[Switch([
            Gpu(link=Link(2.5, 16, 16.0, 16)), Rdma("mlx5_0")])])])
    assert _found(topology_of(spec), "pcie-link") == []


def test_sources_are_info(topology_of: Make) -> None:
    assert _found(topology_of(h100_host()), "source") == [
        ("nvml", Severity.INFO), ("verbs", Severity.INFO)]


def test_rdma_port_down(topology_of: Make) -> None:
    spec = h100_host()
    switch = spec.bridges[2].ports[1]
    assert isinstance(switch, Switch)
    switch.children[1] = Rdma("mlx5_3", [Port(state="1: DOWN", phys="3: Disabled")])
    findings = run_doctor(topology_of(spec))
    assert [(f.subject, f.severity) for f in findings if f.check == "rdma-port-state"] == [
        ("mlx5_3", Severity.ERROR)]
    assert has_errors(findings)


def test_pcie_link_width_and_speed(topology_of: Make) -> None:
    spec = HostSpec(numa={0: "0-3"}, modules=["nvidia_peermem"], bridges=[
        Bridge(numa=0, bus=0, ports=[Switch([
            Gpu(link=Link(32.0, 8, 32.0, 16)), Rdma("mlx5_0")])]),
        Bridge(numa=0, bus=0x40, ports=[Switch([
            Gpu(link=Link(2.5, 16, 32.0, 16)), Rdma("mlx5_1", link=Link(16.0, 16, 32.0, 16))])]),
    ])
    assert sorted(_found(topology_of(spec), "pcie-link")) == [
        ("GPU0", Severity.ERROR), ("mlx5_1", Severity.ERROR)]


def test_pcie_link_limited_by_upstream_port_is_fine(topology_of: Make) -> None:
    spec = HostSpec(numa={0: "0-3"}, bridges=[Bridge(numa=0, bus=0, ports=[Switch(
        [Gpu(link=Link(16.0, 8, 32.0, 16)), Rdma("mlx5_0", link=Link(16.0, 8, 16.0, 8))],
        link=Link(16.0, 8, 16.0, 8))])])
    assert _found(topology_of(spec), "pcie-link") == []


def test_gpu_far_from_nic(topology_of: Make) -> None:
    node = HostSpec(numa={0: "0-3"}, modules=["nvidia_peermem"], bridges=[
        Bridge(numa=0, bus=0, ports=[Switch([Gpu()])]),
        Bridge(numa=0, bus=0x40, ports=[Switch([Rdma("mlx5_0")])]),
    ])
    assert _found(topology_of(node), "gpu-nic-distance") == [("GPU0", Severity.WARNING)]
    assert _found(topology_of(vm_host()), "gpu-nic-distance") == [("GPU0", Severity.ERROR)]


def test_one_socket_host_with_unknown_numa_is_node_not_sys(topology_of: Make) -> None:
    """A one-socket host whose kernel says numa_node -1 (as on the Puget WRX90): the cells
    are NODE, as nvidia-smi prints them, and no 'socket interconnect' error."""
    spec = HostSpec(numa={0: "0-23"}, modules=["nvidia_peermem"], bridges=[
        Bridge(numa=-1, bus=0xC0, ports=[Gpu(), Gpu()]),
        Bridge(numa=-1, bus=0x20, ports=[Rdma("mlx5_0")]),
    ])
    t = topology_of(spec)
    assert {g: dict(row) for g, row in t.gpu_nic.items()} == {
        "GPU0": {"mlx5_0": "NODE"}, "GPU1": {"mlx5_0": "NODE"}}
    assert t.gpu_gpu["GPU0"]["GPU1"] == "PHB"
    findings = run_doctor(t)
    assert not has_errors(findings)
    assert [f.severity for f in findings if f.check == "gpu-nic-distance"] == [
        Severity.WARNING, Severity.WARNING]
    assert not any("socket interconnect" in f.message for f in findings)
    numa = [f for f in findings if f.check == "numa"]
    assert {f.severity for f in numa} == {Severity.INFO}
    assert all("harmless" in f.message for f in numa)
    assert rank_nics(t, "cpu:0")[0].link_class.value == "NODE"


def test_roce_without_v2_gid(topology_of: Make) -> None:
    spec = a100_host()
    l1 = spec.bridges[0].ports[0]
    assert isinstance(l1, Switch)
    l1.children[1] = Rdma("mlx5_0", [roce_port("ens0np0", v2=False)])
    assert _found(topology_of(spec), "roce-gid") == [("mlx5_0", Severity.ERROR)]


def test_mtu_too_small(topology_of: Make, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = a100_host()
    l1 = spec.bridges[0].ports[0]
    assert isinstance(l1, Switch)
    l1.children[1] = Rdma("mlx5_0", [roce_port("ens0np0", mtu=1500)])
    assert _found(topology_of(spec), "mtu") == [("mlx5_0", Severity.WARNING)]
    # verbs says the path MTU is 4096 while the netdev carries 1500: an error
    facts = scan_sysfs(SysfsReader(build_sysfs(tmp_path / "mtu", spec)))
    verbs = VerbsReport((VerbsDevice("mlx5_0", (VerbsPort(1, "ACTIVE", 4096, 4096, 4, 200.0,
                                                         "Ethernet"),)),))
    t = build_topology(facts, Unavailable("nvml", "none"), verbs)
    assert [(f.subject, f.severity) for f in run_doctor(t) if f.check == "mtu"] == [
        ("mlx5_0", Severity.ERROR)]


def test_peermem_missing(topology_of: Make) -> None:
    spec = h100_host(modules=["nvidia", "ib_core"])
    assert _found(topology_of(spec), "peermem") == [("host", Severity.WARNING)]
    assert _found(topology_of(workstation_host()), "peermem") == []  # no RDMA NIC


def test_iommu_and_numa_in_a_vm(topology_of: Make) -> None:
    t = topology_of(vm_host())
    assert sorted(_found(t, "iommu")) == [("GPU0", Severity.WARNING), ("mlx5_0", Severity.WARNING)]
    assert sorted(_found(t, "numa")) == [("GPU0", Severity.WARNING), ("mlx5_0", Severity.WARNING)]
    single = topology_of(vm_host(numa={0: "0-7"}, iommu="identity"))
    assert _found(single, "iommu") == []
    assert sorted(_found(single, "numa")) == [("GPU0", Severity.INFO), ("mlx5_0", Severity.INFO)]


def test_nvidia_driver_loaded_without_a_gpu_is_said(topology_of: Make) -> None:
    spec = HostSpec(numa={0: "0-3"}, modules=["nvidia"], bridges=[
        Bridge(numa=0, bus=0, ports=[Rdma("mlx5_0")])])
    t = topology_of(spec)
    assert t.gpus == ()
    assert _found(t, "gpu-discovery") == [("host", Severity.WARNING)]
    assert _found(topology_of(dataclasses.replace(spec, modules=[])), "gpu-discovery") == []
