"""SysfsReader: links resolved inside the root (relative and absolute), recording, errors."""

from pathlib import Path, PurePosixPath

import pytest

from kvctl.probe.host import parse_link_speed, parse_rate, scan_sysfs
from kvctl.probe.sysfs import SysfsError, SysfsReader, SysfsRecorder
from tests.fixtures.sysfs import build_sysfs, h100_host


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "sys/devices/pci0000:00/0000:00:01.0").mkdir(parents=True)
    (root / "sys/devices/pci0000:00/0000:00:01.0/vendor").write_text("0x10de\n")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    return root


def test_relative_link_resolves_inside_root(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "sys/bus/pci/devices/0000:00:01.0").symlink_to(
        "../../../devices/pci0000:00/0000:00:01.0")
    reader = SysfsReader(root)
    assert reader.read("/sys/bus/pci/devices/0000:00:01.0/vendor") == "0x10de"
    assert reader.resolve("/sys/bus/pci/devices/0000:00:01.0") == PurePosixPath(
        "/sys/devices/pci0000:00/0000:00:01.0")


def test_absolute_link_is_reinterpreted_under_root(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "sys/bus/pci/devices/0000:00:01.0").symlink_to(
        "/sys/devices/pci0000:00/0000:00:01.0")
    assert SysfsReader(root).read("/sys/bus/pci/devices/0000:00:01.0/vendor") == "0x10de"


def test_links_never_escape_the_root(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (tmp_path / "secret").write_text("outside\n")
    (root / "sys/escape").symlink_to("../../../../../../secret")
    (root / "sys/escape_abs").symlink_to(str(tmp_path / "secret"))
    reader = SysfsReader(root)
    assert reader.resolve("/sys/escape") == PurePosixPath("/secret")
    assert reader.read("/sys/escape") is None
    assert reader.read("/sys/escape_abs") is None


def test_link_loop_is_a_typed_error(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "sys/a").symlink_to("b")
    (root / "sys/b").symlink_to("a")
    with pytest.raises(SysfsError, match="loop"):
        SysfsReader(root).read("/sys/a")


def test_absent_file_and_dir_are_none(tmp_path: Path) -> None:
    reader = SysfsReader(_tree(tmp_path))
    assert reader.read("/sys/nope") is None
    assert reader.listdir("/sys/class/infiniband") is None
    assert reader.read_int("/sys/nope") is None


def test_recorder_keeps_what_was_read(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "sys/bus/pci/devices/0000:00:01.0").symlink_to(
        "../../../devices/pci0000:00/0000:00:01.0")
    rec = SysfsRecorder()
    SysfsReader(root, recorder=rec).read("/sys/bus/pci/devices/0000:00:01.0/vendor")
    assert rec.files == {"/sys/devices/pci0000:00/0000:00:01.0/vendor": b"0x10de\n"}
    assert rec.links == {
        "/sys/bus/pci/devices/0000:00:01.0": "../../../devices/pci0000:00/0000:00:01.0"}


def test_relative_and_absolute_trees_scan_the_same(tmp_path: Path) -> None:
    rel = scan_sysfs(SysfsReader(build_sysfs(tmp_path / "rel", h100_host())))
    abs_ = scan_sysfs(SysfsReader(build_sysfs(tmp_path / "abs", h100_host(absolute_links=True))))
    assert rel == abs_
    assert len(rel.gpus) == 8
    assert len(rel.ib_devices) == 8
    assert [n.name for n in rel.netdevs] == ["eno1"]


def test_parsers() -> None:
    assert parse_link_speed("16.0 GT/s PCIe") == 16.0
    assert parse_link_speed("Unknown") is None
    assert parse_rate("200 Gb/sec (4X HDR)") == 200.0
    assert parse_rate("invalid") is None


def test_live_host_scans_without_error() -> None:
    facts = scan_sysfs(SysfsReader("/"))
    if facts.unavailable is not None:
        pytest.skip(f"no PCI sysfs here: {facts.unavailable.reason}")
    assert all(f.path[-1] == a for a, f in facts.functions.items())


def test_hyperv_vmbus_devices_are_placed(tmp_path: Path) -> None:
    """Azure ND-style guest: each GPU and each mlx5 VF on its own VMBus PCI bus (layout of
    the Azure NC6 record, tests/fixtures/records/azure), with the RDMA device and netdev."""
    from tests.fixtures.realhosts import Function, Host, Port, write_tree

    vmbus = "/sys/devices/LNXSYSTM:00/LNXSYBUS:00/PNP0A03:00/device:07/VMBUS:01"
    gpu = Function("0001:00:00.0", ("pci0001:00", "0001:00:00.0"), 0x10DE, 0x030200,
                   numa=0, device=0x20B2, prefix=f"{vmbus}/00000001-0001-0000-3130-444531303244")
    nic = Function("0101:00:00.0", ("pci0101:00", "0101:00:00.0"), 0x15B3, 0x020700,
                   numa=0, rdma="mlx5_ib0", ports=[Port("4: ACTIVE", "InfiniBand")],
                   netdevs=["ib0"], prefix=f"{vmbus}/00000101-0001-0000-3130-444531303244")
    root = write_tree(tmp_path / "nd", Host([gpu, nic], {0: [0, 1], 1: [2, 3]}))
    facts = scan_sysfs(SysfsReader(root))
    assert facts.gpus == ("0001:00:00.0",)
    assert facts.functions["0001:00:00.0"].path == ("pci0001:00", "0001:00:00.0")
    assert facts.functions["0001:00:00.0"].numa_node == 0
    assert [(d.name, d.pci) for d in facts.ib_devices] == [("mlx5_ib0", "0101:00:00.0")]
    assert [n.name for n in facts.netdevs] == ["ib0"]
    assert facts.unplaced_gpus == ()
