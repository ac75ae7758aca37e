"""``kvctl topo`` end to end: this machine, fixture trees, snapshots and the examples."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.sysfs import HostSpec, h100_host, vm_host

Tree = Callable[[HostSpec], Path]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hosts"


def test_topo_on_this_machine_says_what_is_missing(kvctl: Any) -> None:
    r = kvctl("topo")
    assert r.exit_code == 0, r.stderr
    assert "Sources:" in r.stdout
    doc = kvctl("topo", "--json").json()
    assert doc["kind"] == "topo"
    assert doc["schema_version"] == 1
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
    assert mooncake.exit_code == 0
    assert isinstance(json.loads(mooncake.stdout), dict)
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
    if name.startswith("h100"):
        assert doc["matrix"]["GPU3"] == {
            "mlx5_0": "NODE", "mlx5_1": "NODE", "mlx5_2": "PHB", "mlx5_3": "PIX",
            "mlx5_4": "SYS", "mlx5_5": "SYS", "mlx5_6": "SYS", "mlx5_7": "SYS", "eno1": "NODE"}
        assert doctor.exit_code == 0, doctor.stdout
    else:
        assert doctor.exit_code in (0, 1)
