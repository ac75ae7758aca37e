"""Peak dense 16-bit tensor TFLOP/s of data-center GPUs, matched to NVML's product names.

``kvctl plan readback`` needs a prefill rate. Without ``--prefill-tps`` or ``--gpu-tflops``
it takes the GPU's peak from this table: given by ``--gpu NAME``, or the name NVML reports
for GPU 0 (``nvidia-smi --query-gpu=name --format=csv``). Each value is the vendor's
published peak for BF16 (FP16 where the GPU has no BF16) on tensor cores **without**
structured sparsity (NVIDIA's datasheets print the sparse figure, marked ``*``, at twice
the dense one), at the boost clock: a ceiling real prefill reaches a fraction of
(``--efficiency``).
"""

from __future__ import annotations

import dataclasses
import re

from kvctl.errors import UsageError
from kvctl.probe.nvml import NvmlReport
from kvctl.probe.types import Unavailable


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    """One GPU model's peak.

    Attributes:
        name: the model as the table names it (``H100 SXM``).
        tflops: peak dense BF16/FP16 tensor TFLOP/s (10^12 FLOP/s).
        source: where the figure is published.
        match: words that must all appear in the NVML product name (lower case).
        exclude: words that must not appear (tells ``H100`` from ``H100 PCIe``).
    """

    name: str
    tflops: float
    source: str
    match: tuple[str, ...]
    exclude: tuple[str, ...] = ()


_HOPPER = ("NVIDIA H100 Tensor Core GPU datasheet (BF16 Tensor Core, sparse figure halved): "
           "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (BF16 Tensor Core, sparse figure halved): "
         "https://www.nvidia.com/en-us/data-center/h200/")
_BLACKWELL = ("NVIDIA HGX B200 / GB200 NVL72 specifications (FP16/BF16 Tensor Core per GPU, "
              "sparse figure halved): https://www.nvidia.com/en-us/data-center/hgx/, "
              "https://www.nvidia.com/en-us/data-center/gb200-nvl72/")

#: Most specific entries first: the first whose words all match (and no excluded word) wins.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("GB200", 2500.0, _BLACKWELL, ("gb200",)),
    GpuPeak("B200", 2250.0, _BLACKWELL, ("b200",), ("gb200",)),
    GpuPeak("H200 NVL", 835.5, _H200, ("h200", "nvl")),
    GpuPeak("H200 SXM", 989.4, _H200, ("h200",), ("nvl",)),
    GpuPeak("H100 NVL", 835.5, _HOPPER, ("h100", "nvl")),
    GpuPeak("H100 PCIe", 756.5, _HOPPER, ("h100", "pcie")),
    GpuPeak("H100 SXM", 989.4, _HOPPER, ("h100",), ("nvl", "pcie")),
    GpuPeak("A100", 312.0,
            "NVIDIA A100 Tensor Core GPU datasheet (BF16 Tensor Core 312 TFLOPS, 624 sparse; "
            "SXM and PCIe): https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
            "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf", ("a100",)),
    GpuPeak("A30", 165.0,
            "NVIDIA A30 Tensor Core GPU datasheet (BF16 Tensor Core 165 TFLOPS, 330 sparse): "
            "https://www.nvidia.com/en-us/data-center/products/a30-gpu/", ("a30",)),
    GpuPeak("A10", 125.0,
            "NVIDIA A10 Tensor Core GPU datasheet (BF16 Tensor Core 125 TFLOPS, 250 sparse): "
            "https://www.nvidia.com/en-us/data-center/products/a10-gpu/", ("a10",),
            ("a100", "a10g")),
    GpuPeak("L40S", 362.05,
            "NVIDIA L40S GPU datasheet (BF16 Tensor Core 362.05 TFLOPS, 733 sparse): "
            "https://www.nvidia.com/en-us/data-center/l40s/", ("l40s",)),
    GpuPeak("L40", 181.05,
            "NVIDIA L40 GPU datasheet (BF16 Tensor Core 181.05 TFLOPS, 362.1 sparse): "
            "https://www.nvidia.com/en-us/data-center/l40/", ("l40",), ("l40s",)),
    GpuPeak("L4", 121.0,
            "NVIDIA L4 Tensor Core GPU datasheet (BF16 Tensor Core 242 TFLOPS sparse, halved): "
            "https://www.nvidia.com/en-us/data-center/l4/", ("l4",)),
    GpuPeak("V100 SXM2", 125.0,
            "NVIDIA V100 Tensor Core GPU datasheet (Tensor Performance 125 TFLOPS, FP16; no "
            "BF16): https://www.nvidia.com/en-us/data-center/v100/", ("v100", "sxm2")),
    GpuPeak("V100 PCIe", 112.0,
            "NVIDIA V100 Tensor Core GPU datasheet (Tensor Performance 112 TFLOPS, FP16; no "
            "BF16): https://www.nvidia.com/en-us/data-center/v100/", ("v100",), ("sxm2",)),
    GpuPeak("GeForce RTX 4090", 165.2,
            "NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4090: peak BF16 Tensor "
            "TFLOPS with FP32 accumulate 165.2 (330.4 sparse): https://images.nvidia.com/"
            "aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf", ("4090",)),
)


def _words(name: str) -> set[str]:
    text = name.lower().replace("-", " ").replace("_", " ")
    return set(re.findall(r"[a-z0-9]+", text))


def lookup_gpu(name: str) -> GpuPeak | None:
    """The table entry for a GPU product name (NVML's or the table's own), or ``None``."""
    words = _words(name)
    for peak in GPU_PEAKS:
        if set(peak.match) <= words and not words & set(peak.exclude):
            return peak
    return None


def gpu_peak(name: str) -> GpuPeak:
    """The table entry for ``--gpu NAME``.

    Raises:
        UsageError: a GPU the table does not hold; the hint lists the ones it does.
    """
    peak = lookup_gpu(name)
    if peak is None:
        raise UsageError(f"no peak TFLOP/s is known for GPU {name!r}",
                         f"give --gpu-tflops (dense BF16), or one of: "
                         f"{', '.join(p.name for p in GPU_PEAKS)}")
    return peak


@dataclasses.dataclass(frozen=True)
class NvmlGpuPeak:
    """What NVML says this host's GPU is, and its peak if the table knows it.

    Attributes:
        reported: NVML's product name of GPU 0 (``None`` when NVML cannot answer).
        peak: the table entry, or ``None``.
        reason: why there is no peak (NVML unavailable, no GPU, unknown model), else ''.
    """

    reported: str | None
    peak: GpuPeak | None
    reason: str = ""


def peak_from_nvml(answer: NvmlReport | Unavailable) -> NvmlGpuPeak:
    """The peak of GPU 0 in NVML's answer (``NvmlBackend.query()``)."""
    if not isinstance(answer, NvmlReport):
        return NvmlGpuPeak(None, None, f"NVML unavailable: {answer.reason}")
    names = [g.name for g in answer.gpus if g.name]
    if not names:
        return NvmlGpuPeak(None, None, "NVML reports no GPU with a name")
    peak = lookup_gpu(names[0])
    if peak is None:
        return NvmlGpuPeak(names[0], None,
                           f"no peak TFLOP/s is known for {names[0]!r} (NVML GPU 0)")
    return NvmlGpuPeak(names[0], peak)
