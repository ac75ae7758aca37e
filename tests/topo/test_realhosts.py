"""kvctl topo against records of real machines (tests/fixtures/records, SOURCES.md there).

Each record is turned into a sysfs tree by the mechanical converters of
:mod:`tests.fixtures.realhosts`; the expected cells are the record's own
``nvidia-smi topo -m`` matrix, or, where the record has none (the AWS hwloc captures),
what the record itself says is closest (the devices sharing a GPU's PCIe switch, AWS's own
NCCL topology for the p4d).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvctl.probe.nvml import NvmlGpu, NvmlReport, RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable, normalize_bdf
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.build import discover
from kvctl.topo.doctor import Severity, run_doctor
from kvctl.topo.model import LinkClass, Topology
from kvctl.topo.rank import best_nics, preferred_nics
from kvctl.topo.recorded import load_recorded
from tests.fixtures import realhosts as rh

ORDER = [c.value for c in LinkClass]


def _discover(root: Path, nvml: NvmlReport | None = None) -> Topology:
    return discover(SysfsReader(root),
                    RecordedNvml(nvml if nvml is not None else Unavailable("nvml", "record")),
                    RecordedVerbs(Unavailable("verbs", "record")))


def _cells(t: Topology) -> dict[str, dict[str, str]]:
    return {g: {n: c.value for n, c in row.items()} for g, row in t.gpu_nic.items()}


def _closest(row: dict[str, str]) -> set[str]:
    best = min(ORDER.index(c) for c in row.values())
    return {n for n, c in row.items() if ORDER.index(c) == best}


@pytest.mark.parametrize("record", [rh.STELLINE_ASUS, rh.STELLINE_PUGET],
                         ids=["asus-esc8000a-e12", "puget-wrx90"])
def test_stelline_records_match_their_nvidia_smi_matrix(record: Path, tmp_path: Path) -> None:
    t = _discover(rh.write_tree(tmp_path / "tree", rh.stelline_host(record)))
    smi = rh.stelline_matrix(record)
    assert _cells(t) == smi.gpu_nic
    assert t.gpu_gpu == smi.gpu_gpu
    for gpu in t.gpus:  # every port is down on both hosts: ranking still follows the path
        assert preferred_nics(t, gpu.location)[0] in _closest(smi.gpu_nic[gpu.name])


def test_one_socket_puget_has_no_socket_errors(tmp_path: Path) -> None:
    """numa_node is -1 everywhere on this one-socket host (lspci prints no NUMA line)."""
    t = _discover(rh.write_tree(tmp_path / "tree", rh.stelline_host(rh.STELLINE_PUGET)))
    assert all(g.numa_node is None for g in t.gpus)
    findings = run_doctor(t)
    assert not any("socket interconnect" in f.message for f in findings)
    assert {f.severity for f in findings if f.check == "numa"} == {Severity.INFO}


@pytest.mark.parametrize("record", [rh.STELLINE_ASUS, rh.STELLINE_PUGET],
                         ids=["asus-esc8000a-e12", "puget-wrx90"])
def test_idle_gpus_at_low_link_speed_raise_nothing(record: Path, tmp_path: Path) -> None:
    """Both records show every idle GPU at 2.5 GT/s of 16 (LnkSta 'downgraded'), x16."""
    t = _discover(rh.write_tree(tmp_path / "tree", rh.stelline_host(record)))
    assert {g.place.link.current_speed_gts for g in t.gpus} == {2.5}
    assert [f for f in run_doctor(t) if f.check == "pcie-link"] == []


def _p4d_static_pairs() -> dict[str, str]:
    """AWS's static NCCL topology for the p4d: GPU address → the EFA address in its switch."""
    root = ET.parse(rh.AWS_P4D_NCCL).getroot()
    pairs: dict[str, str] = {}
    for switch in root.iter("pci"):
        children = switch.findall("pci")
        nics = [c.get("busid", "") for c in children if c.get("class", "").startswith("0x02")]
        for c in children:
            if c.get("class", "").startswith("0x03") and nics:
                pairs[c.get("busid", "")] = nics[0]
    return pairs


def test_aws_p4d_hwloc_record_picks_the_efa_aws_pairs_with_each_gpu(tmp_path: Path) -> None:
    host = rh.hwloc_host(rh.AWS_P4D)
    t = _discover(rh.write_tree(tmp_path / "tree", host))
    efa_at = {f.address: f.rdma for f in host.functions if f.rdma}
    pairs = _p4d_static_pairs()
    assert len(t.gpus) == len(pairs) == 8
    for gpu in t.gpus:
        assert best_nics(t, gpu.location) == [efa_at[pairs[gpu.pci]]]
    # the same record through kvctl's own hwloc reader: the same model
    assert _cells(load_recorded(rh.AWS_P4D)) == _cells(t)


def test_aws_p4d_static_nccl_topology_reads(tmp_path: Path) -> None:
    t = load_recorded(rh.AWS_P4D_NCCL)
    pairs = _p4d_static_pairs()
    assert [g.pci for g in t.gpus] == sorted(pairs)
    for gpu in t.gpus:  # a NIC without a <net> is named by its PCI address
        assert t.gpu_nic[gpu.name][pairs[gpu.pci]] is LinkClass.PIX
        assert preferred_nics(t, gpu.location)[0] == pairs[gpu.pci]  # state unknown


def test_aws_p5en_hwloc_record_prefers_the_efas_on_each_gpus_switch(tmp_path: Path) -> None:
    t = _discover(rh.write_tree(tmp_path / "tree", rh.hwloc_host(rh.AWS_P5EN)))
    shared = rh.hwloc_gpus_and_nics(rh.AWS_P5EN)
    assert len(t.gpus) == len(shared) == 8
    for gpu in t.gpus:
        assert sorted(best_nics(t, gpu.location)) == shared[gpu.pci][1]
        assert {t.gpu_nic[gpu.name][n] for n in shared[gpu.pci][1]} == {LinkClass.PIX}
    assert _cells(load_recorded(rh.AWS_P5EN)) == _cells(t)


def test_azure_hyperv_gpu_is_found(tmp_path: Path) -> None:
    root = rh.write_tree(tmp_path / "tree", rh.hyperv_host(rh.AZURE_NC6))
    t = _discover(root)
    assert [(g.pci, g.model, g.origin.value) for g in t.gpus] == [
        ("0001:00:00.0", "Tesla K80", "sysfs")]
    assert t.gpus[0].place.path == ("pci0001:00", "0001:00:00.0")
    assert [f.check for f in run_doctor(t) if f.check == "gpu-discovery"] == []


@pytest.mark.parametrize("nvml_pci", ["00000001:00:00.0", "47500001:00:00.0"])
def test_azure_nvml_with_another_domain_is_the_same_gpu(tmp_path: Path, nvml_pci: str) -> None:
    """NVML may report a 32-bit PCI domain in Hyper-V guests: the same GPU, not two."""
    root = rh.write_tree(tmp_path / "tree", rh.hyperv_host(rh.AZURE_NC6))
    report = NvmlReport("470.256.02", (NvmlGpu(0, normalize_bdf(nvml_pci), name="Tesla K80"),))
    t = _discover(root, report)
    assert [(g.pci, g.model) for g in t.gpus] == [("0001:00:00.0", "Tesla K80")]
    findings = [f for f in run_doctor(t) if f.check == "gpu-discovery"]
    if nvml_pci.startswith("0000"):
        assert findings == []
    else:
        assert [(f.severity, f.subject) for f in findings] == [(Severity.INFO, "GPU0")]


def test_gpu_under_an_unreadable_path_is_never_silent(tmp_path: Path) -> None:
    """A GPU sysfs lists, under a directory that is no host bridge topo knows."""
    gpu = rh.Function("0002:00:00.0", ("vmbus-odd", "0002:00:00.0"), 0x10DE, 0x030200,
                      device=0x20B5, prefix="/sys/devices/platform")
    t = _discover(rh.write_tree(tmp_path / "tree", rh.Host([gpu], {})))
    assert [(g.pci, g.origin.value) for g in t.gpus] == [("0002:00:00.0", "sysfs-unplaced")]
    assert [(f.check, f.severity) for f in run_doctor(t) if f.check == "gpu-discovery"] == [
        ("gpu-discovery", Severity.WARNING)]


def test_nvml_gpu_that_sysfs_lacks_is_named(tmp_path: Path) -> None:
    t = _discover(rh.write_tree(tmp_path / "tree", rh.Host([], {})),
                  NvmlReport("550", (NvmlGpu(0, "0000:3b:00.0", name="NVIDIA L4"),)))
    assert [(g.pci, g.origin.value) for g in t.gpus] == [("0000:3b:00.0", "nvml-only")]
    assert [f.subject for f in run_doctor(t) if f.check == "gpu-discovery"] == ["GPU0"]
