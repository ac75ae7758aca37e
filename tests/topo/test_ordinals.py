"""``cuda:N`` in topo, its exports and the rdma NIC ranking is the CUDA ordinal (issue 16
item 13): PCI bus-id order among the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, as
Mooncake's discovery (``cudaGetDeviceCount`` + ``cudaDeviceGetPCIBusId(i)``), torch and
kvctl's GPU buffers number them; never the order sysfs lists the devices in.

The fixture's sysfs tree order differs from PCI bus-id order: GPU A (bus 0xa3, next to
mlx5_0) hangs off host bridge pci0000:a0, GPU B (bus 0xa7, next to mlx5_1) off pci0000:20,
so a walk of /sys/devices meets B first, while CUDA (and NVML, and nvidia-smi) put A first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvctl.errors import NotFoundError
from kvctl.probe.nvml import NvmlGpu, NvmlReport, RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.build import discover, scan_sysfs
from kvctl.topo.doctor import check_gpu_nic_distance
from kvctl.topo.export import (
    env_lines,
    locations,
    mooncake_notes,
    mooncake_topology,
    topology_payload,
)
from kvctl.topo.model import Topology
from kvctl.topo.rank import best_nics
from kvctl.transfer.transports.rdma.devices import topo_ranking
from tests.fixtures.sysfs import Bridge, Gpu, HostSpec, Rdma, Switch

UUID_A, UUID_B = "GPU-2222aaaa-0000", "GPU-1111bbbb-0000"


def _spec() -> HostSpec:
    return HostSpec(numa={0: "0-7"}, bridges=[
        Bridge(numa=0, bus=0xA0, ports=[Switch([Gpu(), Rdma("mlx5_0")])]),
        Bridge(numa=0, bus=0x20, ports=[Switch([Gpu(), Rdma("mlx5_1")])]),
    ])


@pytest.fixture
def host(sysfs_tree: Callable[[HostSpec], Path]) -> Callable[..., Topology]:
    root = sysfs_tree(_spec())

    def make(env: dict[str, str] | None, models: dict[str, str] | None = None) -> Topology:
        models = models or {}
        facts = scan_sysfs(SysfsReader(root))
        nvml = NvmlReport("550.54.15", tuple(
            NvmlGpu(i, pci, models.get(pci, "NVIDIA H100 80GB HBM3"),
                    UUID_A if i == 0 else UUID_B)
            for i, pci in enumerate(sorted(facts.gpus))))
        return discover(SysfsReader(root), RecordedNvml(nvml),
                        RecordedVerbs(Unavailable("verbs", "test: no verbs")), cuda_env=env)

    return make


def test_the_fixture_tree_order_is_not_pci_order(sysfs_tree: Callable[[HostSpec], Path]
                                                 ) -> None:
    root = sysfs_tree(_spec())
    tree = sorted(root.glob("sys/devices/pci0000:*/**/class"))
    gpus = [c.parent.name for c in tree if c.read_text().startswith("0x0302")]
    assert gpus == ["0000:a7:00.0", "0000:a3:00.0"]  # else this file would prove nothing
    assert list(scan_sysfs(SysfsReader(root)).gpus) == ["0000:a3:00.0", "0000:a7:00.0"]


def test_every_gpu_visible_numbers_them_in_pci_order(host: Callable[..., Topology]) -> None:
    t = host({})
    a, b = sorted(t.gpus, key=lambda g: g.pci)
    assert (a.location, b.location) == ("cuda:0", "cuda:1")
    assert best_nics(t, "cuda:0") == ["mlx5_0"]
    assert best_nics(t, "cuda:1") == ["mlx5_1"]
    assert mooncake_topology(t)["cuda:0"] == [["mlx5_0"], ["mlx5_1"]]


def test_fastest_first_over_mixed_models_is_flagged(host: Callable[..., Topology],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """CUDA's default order puts the faster model first; kvctl cannot rank speeds, keeps
    PCI order and says so (CUDA_DEVICE_ORDER=PCI_BUS_ID makes it exact)."""
    t = host({}, {"0000:a7:00.0": "NVIDIA L4"})
    assert [g.location for g in sorted(t.gpus, key=lambda g: g.pci)] == ["cuda:0", "cuda:1"]
    assert "FASTEST_FIRST over mixed GPU models" in caplog.text
    caplog.clear()
    host({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, {"0000:a7:00.0": "NVIDIA L4"})
    assert "FASTEST_FIRST" not in caplog.text


@pytest.mark.parametrize("visible", ["1", UUID_B, UUID_B[:10]])
def test_visible_devices_renumber_and_hide(host: Callable[..., Topology], visible: str) -> None:
    """Only GPU B visible: it is cuda:0 and its NIC is mlx5_1; GPU A is in the host tables
    but in no export."""
    t = host({"CUDA_VISIBLE_DEVICES": visible})
    a, b = sorted(t.gpus, key=lambda g: g.pci)
    assert (a.location, b.location) == (None, "cuda:0")
    assert locations(t) == ["cuda:0", "cpu:0"]
    assert mooncake_topology(t) == {"cuda:0": [["mlx5_1"], ["mlx5_0"]],
                                    "cpu:0": [["mlx5_0", "mlx5_1"], []]}
    assert any("hidden by CUDA_VISIBLE_DEVICES" in n for n in mooncake_notes(t))
    block = "\n".join(env_lines(t))
    assert f"# {b.name} (cuda:0, {b.pci}): mlx5_1 PIX" in block
    assert a.name not in block
    payload = json.loads(json.dumps(topology_payload(t)))
    cuda = {g["pci"]: (g["location"], g["cuda_ordinal"]) for g in payload["gpus"]}
    assert cuda == {a.pci: (None, None), b.pci: ("cuda:0", 0)}
    assert payload["preferred"][a.name][0] == "mlx5_0"  # still ranked, by name
    with pytest.raises(NotFoundError) as err:
        best_nics(t, "cuda:1")
    assert "1 more hidden by CUDA_VISIBLE_DEVICES" in (err.value.hint or "")


def test_order_of_visible_devices_is_theirs(host: Callable[..., Topology]) -> None:
    t = host({"CUDA_VISIBLE_DEVICES": "1,0"})
    assert best_nics(t, "cuda:0") == ["mlx5_1"]
    assert best_nics(t, "cuda:1") == ["mlx5_0"]


def test_no_visible_gpu_leaves_only_cpu_entries(host: Callable[..., Topology]) -> None:
    t = host({"CUDA_VISIBLE_DEVICES": ""})
    assert locations(t) == ["cpu:0"]
    assert list(mooncake_topology(t)) == ["cpu:0"]
    assert len(t.gpus) == 2  # the host still has them, and doctor still checks them
    assert check_gpu_nic_distance(t) == []


def test_rdma_ranking_uses_cuda_ordinals(host: Callable[..., Topology]) -> None:
    rank = topo_ranking(host({"CUDA_VISIBLE_DEVICES": "1"}))
    assert rank is not None
    assert list(rank("cuda:0")) == ["mlx5_1:1"]
    assert list(rank("cuda:1")) == []  # no such device here: the transport uses every NIC


def test_live_topo_honours_the_environment(kvctl: Callable[..., Any],
                                           sysfs_tree: Callable[[HostSpec], Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvctl topo`` on a recorded tree numbers GPUs PCI order whatever the environment
    says (the tree is another host); the environment applies to the live host only."""
    root = sysfs_tree(_spec())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    r = kvctl("topo", "--sysfs-root", str(root), "--json")
    assert r.exit_code == 0, r.stderr
    gpus = sorted(r.json()["gpus"], key=lambda g: g["pci"])
    assert [g["location"] for g in gpus] == ["cuda:0", "cuda:1"]
