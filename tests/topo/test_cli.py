"""``kvctl topo`` end to end: this machine, fixture trees, snapshots and the examples."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import realhosts as rh
from tests.fixtures.sysfs import Bridge, HostSpec, Rdma, empty_host, h100_host, vm_host

Tree = Callable[[HostSpec], Path]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hosts"


def test_topo_on_this_machine_says_what_is_missing(kvctl: Any) -> None:
    r = kvctl("topo")
    assert r.exit_code == 0, r.stderr
    assert "Sources:" in r.stdout
    doc = kvctl("topo", "--json").json()
    assert doc["kind"] == "topo.matrix"
    assert doc["schema_version"] == 2
    for key in ("gpus", "nics", "matrix", "preferred", "sources"):
        assert key in doc
    for name in ("sysfs", "nvml", "verbs"):
        source = doc["sources"][name]
        if not source["available"]:
            assert f"{name}: unavailable: {source['detail']}" in " ".join(r.stdout.split())


def test_doctor_on_this_machine_never_crashes(kvctl: Any) -> None:
    r = kvctl("topo", "doctor")
    assert r.exit_code in (0, 1), r.stderr
    assert "error(s)" in r.stdout
    doc = kvctl("topo", "doctor", "--json").json()
    assert doc["kind"] == "topo.doctor"
    assert doc["ok"] is (r.exit_code == 0)


def test_other_formats_on_this_machine(kvctl: Any) -> None:
    mooncake = kvctl("topo", "--format", "mooncake")
    if mooncake.exit_code == 3:  # no usable RDMA device here: said, not an empty {}
        assert mooncake.stdout == ""
        assert mooncake.stderr.startswith("Error: ")
        assert "Hint: " in mooncake.stderr
    else:
        assert mooncake.exit_code == 0, mooncake.stderr
        assert json.loads(mooncake.stdout)
    env = kvctl("topo", "--format", "env")
    assert env.exit_code == 0
    assert env.stdout.startswith("# kvctl topo --format env")


def test_tree_via_flag_and_environment(kvctl: Any, sysfs_tree: Tree) -> None:
    root = sysfs_tree(h100_host())
    by_flag = kvctl("topo", "--sysfs-root", str(root), "--json").json()
    assert by_flag["matrix"]["GPU0"]["mlx5_0"] == "PIX"
    assert by_flag["preferred"]["GPU7"][0] == "mlx5_7"
    by_env = kvctl("topo", "--json", env={"KVCTL_TOPO_SYSFS_ROOT": str(root)}).json()
    assert by_env["matrix"] == by_flag["matrix"]
    table = kvctl("topo", "--sysfs-root", str(root))
    assert "PIX" in table.stdout
    assert "Legend:" in table.stdout
    assert "mlx5_7" in table.stdout


def test_snapshot_then_from(kvctl: Any, sysfs_tree: Tree, tmp_path: Path) -> None:
    root = sysfs_tree(vm_host())
    out = tmp_path / "vm.tar.gz"
    r = kvctl("topo", "snapshot", str(out), "--sysfs-root", str(root))
    assert r.exit_code == 0, r.stderr
    live = kvctl("topo", "--sysfs-root", str(root), "--json").json()
    snap = kvctl("topo", "--from", str(out), "--json").json()
    assert snap["matrix"] == live["matrix"] == {"GPU0": {"mlx5_0": "SYS"}}
    doctor = kvctl("topo", "doctor", "--from", str(out))
    assert doctor.exit_code == 1
    assert "gpu-nic-distance" in doctor.stdout


def test_usage_errors_exit_2(kvctl: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"\x1f\x8b garbage")
    r = kvctl("topo", "--from", str(bad))
    assert r.exit_code == 2
    assert r.stderr.startswith("Error: snapshot")
    assert "Hint:" in r.stderr
    assert kvctl("topo", "doctor", "--from", str(bad)).exit_code == 2
    assert kvctl("topo", "--sysfs-root", str(tmp_path / "none")).exit_code == 2
    assert kvctl("topo", "--json", "--format", "env").exit_code == 2
    assert kvctl("topo", "--sysfs-root", str(tmp_path), "--from", str(bad)).exit_code == 2


@pytest.mark.parametrize("name", ["h100-8gpu.tar.gz", "this-host.tar.gz"])
def test_recorded_examples_replay(kvctl: Any, name: str) -> None:
    path = EXAMPLES / name
    doc = kvctl("topo", "--from", str(path), "--json").json()
    assert doc["sources"]["sysfs"]["available"]
    doctor = kvctl("topo", "doctor", "--from", str(path))
    if name.startswith("h100"):  # NVLink from the recorded NVML answer wins over PCIe
        assert doc["sources"]["nvml"]["available"]
        assert {c for g, row in doc["gpu_matrix"].items() for o, c in row.items()
                if g != o} == {"NV18"}
        assert doc["matrix"]["GPU3"] == {
            "mlx5_0": "NODE", "mlx5_1": "NODE", "mlx5_2": "PHB", "mlx5_3": "PIX",
            "mlx5_4": "SYS", "mlx5_5": "SYS", "mlx5_6": "SYS", "mlx5_7": "SYS", "eno1": "NODE"}
        assert doctor.exit_code == 0, doctor.stdout
    else:
        assert doctor.exit_code in (0, 1)


def test_mooncake_without_rdma_or_gpu_says_why(kvctl: Any, sysfs_tree: Tree) -> None:
    """The dev VM case: no GPU, no RDMA. Not '{}' with exit 0 and no word."""
    r = kvctl("topo", "--format", "mooncake", "--sysfs-root", str(sysfs_tree(empty_host())))
    assert r.exit_code == 3
    assert r.stdout == ""
    assert "no RDMA device" in r.stderr
    assert "MC_CUSTOM_TOPO_JSON" in r.stderr


def test_mooncake_without_gpu_warns_on_stderr(kvctl: Any, sysfs_tree: Tree) -> None:
    spec = HostSpec(numa={0: "0-3"}, bridges=[Bridge(numa=0, bus=0, ports=[Rdma("mlx5_0")])])
    r = kvctl("topo", "--format", "mooncake", "--sysfs-root", str(sysfs_tree(spec)))
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == {"cpu:0": [["mlx5_0"], []]}
    assert "no NVIDIA GPU found" in r.stderr


def test_from_reads_hwloc_and_nccl_by_content(kvctl: Any, tmp_path: Path) -> None:
    hwloc_copy = tmp_path / "p4d.data"  # the name says nothing: the content decides
    hwloc_copy.write_bytes(rh.AWS_P4D.read_bytes())
    doc = kvctl("topo", "--from", str(hwloc_copy), "--json").json()
    assert doc["sources"]["sysfs"]["detail"].startswith(f"hwloc XML {hwloc_copy}")
    assert len(doc["gpus"]) == 8
    assert doc["preferred"]["GPU0"][0] == "rdmap16s27"
    nccl = kvctl("topo", "--from", str(rh.AWS_P4D_NCCL), "--json").json()
    assert nccl["sources"]["sysfs"]["detail"].startswith("NCCL topology")
    assert nccl["matrix"]["GPU0"]["0000:10:1b.0"] == "PIX"
    doctor = kvctl("topo", "doctor", "--from", str(hwloc_copy))
    assert doctor.exit_code in (0, 1)
    assert "nvlink" in doctor.stdout  # NVSwitches in the file, no NVML facts in it


def test_from_refuses_what_it_cannot_read(kvctl: Any, tmp_path: Path) -> None:
    other = tmp_path / "other.xml"
    other.write_text("<?xml version='1.0'?>\n<svg></svg>\n")
    r = kvctl("topo", "--from", str(other))
    assert r.exit_code == 2
    assert "<svg>" in r.stderr
    assert "Hint:" in r.stderr
    broken = tmp_path / "broken.xml"
    broken.write_text("<topology version='2.0'><object type='Machine'>")
    r = kvctl("topo", "--from", str(broken))
    assert r.exit_code == 2
    assert "not well-formed" in r.stderr
    bomb = tmp_path / "bomb.xml"
    bomb.write_text('<?xml version="1.0"?><!DOCTYPE system [<!ENTITY a "aaaa">]>'
                    "<system>&a;</system>")
    r = kvctl("topo", "--from", str(bomb))
    assert r.exit_code == 2
    assert "entities" in r.stderr
    graph = tmp_path / "graph.xml"
    graph.write_text('<graphs version="1"><graph id="0"/></graphs>')
    r = kvctl("topo", "--from", str(graph))
    assert r.exit_code == 2
    assert "NCCL_TOPO_DUMP_FILE" in r.stderr
