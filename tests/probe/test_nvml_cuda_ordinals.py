"""CUDA ordinals under CUDA_VISIBLE_DEVICES: ``cuda:N`` names the GPU the process sees as N
(issue 16 item 13: topo and exports used the N-th GPU of the host)."""

from __future__ import annotations

from kvctl.probe.nvml import NvmlGpu, cuda_ordinals

GPUS = [NvmlGpu(index=i, pci=f"0000:{bus:02x}:00.0", name="NVIDIA H100 80GB HBM3",
                uuid=f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}")
        for i, bus in enumerate((0x18, 0x2A, 0x3A, 0x5D))]


def pcis(env: dict[str, str]) -> list[str]:
    return [g.pci for g in cuda_ordinals(GPUS, env).visible]


def test_all_gpus_in_pci_order_without_the_variable() -> None:
    shuffled = [GPUS[2], GPUS[0], GPUS[3], GPUS[1]]
    ordinals = cuda_ordinals(shuffled, {})
    assert [g.pci for g in ordinals.visible] == [g.pci for g in GPUS]
    assert ordinals.notes == ()


def test_a_container_that_sees_two_gpus() -> None:
    ordinals = cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert ordinals.pci_of(0) == "0000:3a:00.0"  # cuda:0 is the host's third GPU
    assert ordinals.pci_of(1) == "0000:5d:00.0"
    assert ordinals.pci_of(2) is None
    assert ordinals.ordinal_of("0000:5D:00.0") == 1
    assert ordinals.ordinal_of("0000:18:00.0") is None
    assert [g.pci for g in ordinals.hidden] == ["0000:18:00.0", "0000:2a:00.0"]


def test_order_of_the_list_is_the_ordinal_order() -> None:
    assert pcis({"CUDA_VISIBLE_DEVICES": "3,0"}) == ["0000:5d:00.0", "0000:18:00.0"]


def test_uuids_and_unique_prefixes() -> None:
    assert pcis({"CUDA_VISIBLE_DEVICES": "GPU-1aaaaaaa-0000-0000-0000-000000000001,GPU-3a"}
                ) == ["0000:2a:00.0", "0000:5d:00.0"]


def test_an_invalid_entry_ends_the_list_as_in_cuda() -> None:
    ordinals = cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": "1,7,2"})
    assert [g.pci for g in ordinals.visible] == ["0000:2a:00.0"]
    assert "only 4 exist" in ordinals.notes[0]
    repeated = cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": "1,1,2"})
    assert len(repeated.visible) == 1
    assert "repeats" in repeated.notes[0]


def test_empty_hides_everything_and_mig_is_noted() -> None:
    assert cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": ""}).visible == ()
    mig = cuda_ordinals(GPUS, {"CUDA_VISIBLE_DEVICES": "MIG-4f1c"})
    assert mig.visible == ()
    assert "MIG" in mig.notes[0]


def test_fastest_first_over_mixed_models_is_noted() -> None:
    mixed = [*GPUS[:2], NvmlGpu(index=2, pci="0000:3a:00.0", name="NVIDIA L4")]
    assert cuda_ordinals(mixed, {}).notes
    assert not cuda_ordinals(mixed, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).notes
