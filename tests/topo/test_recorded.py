"""``--from`` formats: detection by content, hwloc and NCCL files into the sysfs model."""

from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.topo.model import LinkClass, NicKind
from kvctl.topo.rank import best_nics
from kvctl.topo.recorded import RecordedFormat, detect_format, load_recorded
from tests.fixtures import realhosts as rh

# The shape of an NCCL_TOPO_DUMP_FILE of a DGX A100 (NCCL 2.2x): two switch levels above
# each GPU, the NIC on the first-level switch, 12 NVLinks per GPU to six NVSwitches, a
# dual-port card directly on a root port of another socket, a socket NIC under a <cpu>.
_SWITCHES = ["0000:c4:00.0", "0000:c5:00.0", "0000:c6:00.0", "0000:c7:00.0",
             "0000:c8:00.0", "0000:c9:00.0"]
_NVLINKS = "".join(f'<nvlink target="{s}" count="2" tclass="0x068000"/>' for s in _SWITCHES)
_BRIDGE = 'class="0x060400" vendor="0x1000" device="0xc010" link_speed="16.0 GT/s PCIe" ' \
          'link_width="16"'
DGX_LIKE = f"""<system version="1">
  <cpu numaid="3" affinity="00000000,0000ffff" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:01:00.0" {_BRIDGE}>
      <pci busid="0000:03:00.0" {_BRIDGE}>
        <pci busid="0000:05:00.0" {_BRIDGE}>
          <pci busid="0000:07:00.0" class="0x030200" vendor="0x10de" device="0x20b0"
               link_speed="16.0 GT/s PCIe" link_width="16">
            <gpu dev="0" sm="80" rank="0" gdr="1">{_NVLINKS}</gpu>
          </pci>
        </pci>
      </pci>
      <pci busid="0000:0a:00.0" {_BRIDGE}>
        <pci busid="0000:0c:00.0" class="0x020700" vendor="0x15b3" device="0x101b"
             link_speed="16.0 GT/s PCIe" link_width="16">
          <nic><net name="mlx5_0" dev="0" speed="200000" port="1" guid="0xa262550003a1420c"
                    maxconn="131072" gdr="1"/></nic>
        </pci>
        <pci busid="0000:0d:00.0" {_BRIDGE}>
          <pci busid="0000:0f:00.0" class="0x030200" vendor="0x10de" device="0x20b0"
               link_speed="16.0 GT/s PCIe" link_width="16">
            <gpu dev="1" sm="80" rank="1" gdr="1">{_NVLINKS}</gpu>
          </pci>
        </pci>
      </pci>
    </pci>
  </cpu>
  <cpu numaid="0" affinity="ffff0000,00000000" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:61:00.0" class="0x020700" vendor="0x15b3" device="0x101b"
         link_speed="16.0 GT/s PCIe" link_width="16">
      <nic>
        <net name="mlx5_4" dev="4" speed="200000" port="1" guid="0x64774a0003a1420c"/>
        <net name="mlx5_5" dev="5" speed="100000" port="2" guid="0x64774a0003a1420c"/>
      </nic>
    </pci>
    <nic><net name="eth0" dev="6" speed="10000" port="0" guid="0x0" gdr="0"/></nic>
  </cpu>
</system>
"""


def test_formats_are_told_by_content(tmp_path: Path) -> None:
    nccl = tmp_path / "a.tar.gz"  # names lie; content does not
    nccl.write_text('<?xml version="1.0"?>\n<!-- dump -->\n' + DGX_LIKE)
    assert detect_format(nccl) is RecordedFormat.NCCL
    assert detect_format(rh.AWS_P5EN) is RecordedFormat.HWLOC
    snap = tmp_path / "x.xml"
    snap.write_bytes(b"\x1f\x8b\x08rest")
    assert detect_format(snap) is RecordedFormat.SNAPSHOT
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00\x01 not a topology")
    with pytest.raises(UsageError, match="neither gzip nor XML"):
        detect_format(junk)
    with pytest.raises(UsageError, match="does not exist"):
        detect_format(tmp_path / "missing")


def test_nccl_dump_keeps_switch_levels_and_nvlinks(tmp_path: Path) -> None:
    path = tmp_path / "topo.xml"
    path.write_text(DGX_LIKE)
    t = load_recorded(path)
    assert [g.pci for g in t.gpus] == ["0000:07:00.0", "0000:0f:00.0"]
    cells = {g: {n: c.value for n, c in row.items()} for g, row in t.gpu_nic.items()}
    assert cells["GPU0"] == {"mlx5_0": "PXB", "mlx5_4": "SYS", "mlx5_5": "SYS",
                             "eth0": "SYS"}
    assert cells["GPU1"]["mlx5_0"] == "PXB"
    assert t.gpu_gpu["GPU0"]["GPU1"] == "NV12"  # NVLink wins over the PCIe path
    assert best_nics(t, "cuda:0") == ["mlx5_0"]
    assert {n.name: n.kind for n in t.nics}["eth0"] is NicKind.ETHERNET
    assert t.nic("mlx5_5") is not None
    assert t.nic("mlx5_5").ports[0].port == 2  # type: ignore[union-attr]
    assert t.nic("mlx5_0").rate_gbps == 200.0  # type: ignore[union-attr]
    assert [s.pci for s in t.pcie_switches] == ["0000:01:00.0", "0000:03:00.0",
                                                "0000:05:00.0", "0000:0a:00.0",
                                                "0000:0d:00.0"]
    assert t.gpus[0].place.link.max_speed_gts == 16.0
    assert not t.modules_known
    assert [s.name for s in t.sources if s.available] == ["sysfs", "nvml"]


def test_nccl_devices_meeting_at_the_cpu_are_node_not_phb(tmp_path: Path) -> None:
    """NCCL drops host bridges: two trees under one <cpu> may share one or not. topo
    reports the farther class and never claims a shared host bridge."""
    path = tmp_path / "topo.xml"
    path.write_text("""<system version="1"><cpu numaid="0" affinity="0000000f">
      <pci busid="0000:17:00.0" class="0x030200" vendor="0x10de" device="0x2330"/>
      <pci busid="0000:3a:00.0" class="0x020700" vendor="0x15b3" device="0x1021">
        <nic><net name="mlx5_0" speed="400000" port="1" guid="0x1"/></nic></pci>
    </cpu></system>""")
    t = load_recorded(path)
    assert t.gpu_nic["GPU0"]["mlx5_0"] is LinkClass.NODE


def test_hwloc_numa_cpus_and_port_states() -> None:
    t = load_recorded(rh.AWS_P4D)
    assert [(n.node, n.distances) for n in t.numa_nodes] == [(0, (10, 21)), (1, (21, 10))]
    assert t.numa_nodes[0].cpulist == "0-23,48-71"
    assert {n.name: n.state.value for n in t.nics if n.kind is NicKind.RDMA} == {
        "rdmap16s27": "ACTIVE", "rdmap32s27": "ACTIVE", "rdmap144s27": "ACTIVE",
        "rdmap160s27": "ACTIVE"}
    assert len(t.nvswitches) == 6
    assert t.gpus[0].model == "NVIDIA A100-SXM4-40GB"  # from the device ID in pci_type
    assert t.gpus[0].numa_node == 0
    assert t.gpus[0].cpu_affinity == "0-23,48-71"
