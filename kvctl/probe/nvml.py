"""GPU facts from NVML, through one lazily initialised gateway.

:class:`NvmlBackend` is the interface topo uses; :class:`PynvmlBackend` implements it on
``pynvml`` (package ``nvidia-ml-py``), :class:`RecordedNvml` replays an answer stored in a
snapshot. As in nvitop, every NVML call goes through one place (:meth:`PynvmlBackend._call`)
that initialises NVML on first use and turns "library missing", "driver not loaded" and
"not supported" into values instead of exceptions:

- no library / no driver / no permission → :class:`~kvctl.probe.types.Unavailable`;
- a field NVML does not support on this GPU → ``None`` in that field, with the reason in
  :attr:`NvmlGpu.missing`.

NVML numbers GPUs over the whole host; CUDA (torch, Mooncake, kvctl's GPU buffers) numbers
the GPUs its process sees. :func:`cuda_ordinals` maps one to the other under
``CUDA_VISIBLE_DEVICES``, so ``cuda:N`` can name the right PCI device (and NICs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

from kvctl.probe.types import Unavailable, normalize_bdf

_log = logging.getLogger("kvctl.probe.nvml")

_INSTALL_HINT = "install the NVIDIA driver (it ships libnvidia-ml.so) and pip install nvidia-ml-py"


@dataclasses.dataclass(frozen=True)
class NvLink:
    """One active NVLink of a GPU.

    Attributes:
        link: link index on the GPU.
        remote_pci: PCI address of the far end (a GPU or an NVSwitch).
        remote_is_switch: whether the far end is an NVSwitch.
    """

    link: int
    remote_pci: str
    remote_is_switch: bool


@dataclasses.dataclass(frozen=True)
class NvmlGpu:
    """What NVML says about one GPU (``nvidia-smi -q``).

    Attributes:
        index: NVML index (PCI bus order, as ``nvidia-smi`` numbers GPUs).
        pci: bus id in sysfs spelling (``0000:18:00.0``).
        name: product name (``NVIDIA H100 80GB HBM3``), ``None`` if not supported.
        uuid: ``GPU-...``, ``None`` if not supported.
        memory_total_bytes: framebuffer size in bytes (``--query-gpu=memory.total``).
        pcie_gen_current, pcie_gen_max: PCIe generation (``pcie.link.gen.current/max``).
        pcie_width_current, pcie_width_max: lanes (``pcie.link.width.current/max``).
        nvlinks: active NVLinks.
        missing: field name → why NVML gave no value (``"not supported"``).
    """

    index: int
    pci: str
    name: str | None = None
    uuid: str | None = None
    memory_total_bytes: int | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    nvlinks: tuple[NvLink, ...] = ()
    missing: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class NvmlReport:
    """NVML's answer: the driver version and every GPU it sees."""

    driver_version: str | None
    gpus: tuple[NvmlGpu, ...]


class NvmlBackend(Protocol):
    """Source of GPU facts. Implementations never raise for "NVML is not here"."""

    def query(self) -> NvmlReport | Unavailable:
        """Every GPU NVML sees, or why NVML cannot answer."""
        ...

    def close(self) -> None:
        """Release NVML. Safe to call twice."""
        ...


class _FieldUnavailableError(Exception):
    """Internal: one NVML call answered "not supported" (or similar) for one field."""


class PynvmlBackend:
    """:class:`NvmlBackend` on the ``pynvml`` module.

    Args:
        module: the pynvml module to use; ``None`` imports ``pynvml`` on first use. Tests
            pass a stand-in that raises pynvml's own error classes.
    """

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._module = module
        self._initialised = False
        self._failure: Unavailable | None = None

    def __repr__(self) -> str:
        return f"PynvmlBackend(initialised={self._initialised})"

    def _nvml(self) -> Any:
        """The initialised pynvml module, or raise :class:`_Unavailable` once and for all."""
        if self._failure is not None:
            raise _UnavailableError(self._failure)
        if self._initialised:
            return self._module
        if self._module is None:
            try:
                import pynvml
            except ImportError:
                self._failure = Unavailable(
                    "nvml", "pynvml is not installed", "pip install nvidia-ml-py"
                )
                raise _UnavailableError(self._failure) from None
            self._module = pynvml
        nvml = self._module
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            self._failure = Unavailable("nvml", _init_reason(nvml, err), _INSTALL_HINT)
            raise _UnavailableError(self._failure) from None
        self._initialised = True
        return nvml

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call; "not supported"-like answers become :class:`_FieldUnavailableError`."""
        nvml: Any = self._module
        try:
            return fn(*args)
        except nvml.NVMLError as err:
            raise _FieldUnavailableError(_field_reason(nvml, err)) from None

    def query(self) -> NvmlReport | Unavailable:
        """See :meth:`NvmlBackend.query`."""
        try:
            nvml = self._nvml()
        except _UnavailableError as err:
            return err.unavailable
        try:
            count = int(self._call(nvml.nvmlDeviceGetCount))
        except _FieldUnavailableError as err:
            return Unavailable("nvml", f"nvmlDeviceGetCount failed: {err}", _INSTALL_HINT)
        try:
            driver: str | None = _text(self._call(nvml.nvmlSystemGetDriverVersion))
        except _FieldUnavailableError:
            driver = None
        gpus: list[NvmlGpu] = []
        for index in range(count):
            try:
                handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index)
                pci_info = self._call(nvml.nvmlDeviceGetPciInfo, handle)
            except _FieldUnavailableError as err:
                _log.warning("NVML GPU %d skipped: %s", index, err)
                continue
            gpus.append(self._gpu(nvml, index, handle, pci_info))
        return NvmlReport(driver_version=driver, gpus=tuple(gpus))

    def _gpu(self, nvml: Any, index: int, handle: Any, pci_info: Any) -> NvmlGpu:
        missing: dict[str, str] = {}

        def field(name: str, fn: Callable[..., Any]) -> Any:
            try:
                return self._call(fn, handle)
            except _FieldUnavailableError as err:
                missing[name] = str(err)
                return None

        memory = field("memory_total_bytes", nvml.nvmlDeviceGetMemoryInfo)
        name = field("name", nvml.nvmlDeviceGetName)
        uuid = field("uuid", nvml.nvmlDeviceGetUUID)
        return NvmlGpu(
            index=index,
            pci=normalize_bdf(_text(pci_info.busId)),
            name=_text(name) if name is not None else None,
            uuid=_text(uuid) if uuid is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            pcie_gen_current=field("pcie_gen_current", nvml.nvmlDeviceGetCurrPcieLinkGeneration),
            pcie_gen_max=field("pcie_gen_max", nvml.nvmlDeviceGetMaxPcieLinkGeneration),
            pcie_width_current=field("pcie_width_current", nvml.nvmlDeviceGetCurrPcieLinkWidth),
            pcie_width_max=field("pcie_width_max", nvml.nvmlDeviceGetMaxPcieLinkWidth),
            nvlinks=self._nvlinks(nvml, handle),
            missing=missing,
        )

    def _nvlinks(self, nvml: Any, handle: Any) -> tuple[NvLink, ...]:
        links: list[NvLink] = []
        switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if not self._call(nvml.nvmlDeviceGetNvLinkState, handle, link):
                    continue
                remote = self._call(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            except _FieldUnavailableError:
                continue  # no such link, or NVLink not supported on this GPU
            try:
                kind = self._call(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            except _FieldUnavailableError:
                kind = None
            links.append(NvLink(link, normalize_bdf(_text(remote.busId)), kind == switch_type))
        return tuple(links)

    def close(self) -> None:
        """Shut NVML down if this backend initialised it. Safe to call twice."""
        if self._initialised:
            self._initialised = False
            nvml: Any = self._module
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as err:
                _log.debug("nvmlShutdown: %s", err)


class _UnavailableError(Exception):
    def __init__(self, unavailable: Unavailable) -> None:
        super().__init__(unavailable.reason)
        self.unavailable = unavailable


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _init_reason(nvml: Any, err: Any) -> str:
    value = getattr(err, "value", None)
    reasons = {
        getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1): (
            "NVML library (libnvidia-ml.so) not found: no NVIDIA driver installed"
        ),
        getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", -1): "NVIDIA driver not loaded",
        getattr(nvml, "NVML_ERROR_NO_PERMISSION", -1): "no permission to open the NVIDIA driver",
        getattr(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", -1): (
            "NVIDIA driver and NVML library versions differ (reboot or reload the driver)"
        ),
    }
    return reasons.get(value, f"nvmlInit failed: {err}")


def _field_reason(nvml: Any, err: Any) -> str:
    value = getattr(err, "value", None)
    if value == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", -1):
        return "not supported"
    if value == getattr(nvml, "NVML_ERROR_NO_PERMISSION", -1):
        return "no permission"
    return str(err)


class RecordedNvml:
    """:class:`NvmlBackend` that replays an answer (from a snapshot or a test)."""

    def __init__(self, answer: NvmlReport | Unavailable) -> None:
        self._answer = answer

    def query(self) -> NvmlReport | Unavailable:
        """The recorded answer."""
        return self._answer

    def close(self) -> None:
        """Nothing to release."""


def nvml_to_dict(answer: NvmlReport | Unavailable) -> dict[str, Any]:
    """A JSON-ready form of an NVML answer (snapshots store this)."""
    if isinstance(answer, Unavailable):
        return {"unavailable": dataclasses.asdict(answer)}
    return {"report": dataclasses.asdict(answer)}


def nvml_from_dict(data: Any) -> NvmlReport | Unavailable:
    """Inverse of :func:`nvml_to_dict`.

    Raises:
        ValueError, TypeError, KeyError: ``data`` is not what :func:`nvml_to_dict` writes.
    """
    if "unavailable" in data:
        return Unavailable(**data["unavailable"])
    report = data["report"]
    gpus = []
    for raw in report["gpus"]:
        fields = dict(raw)
        fields["nvlinks"] = tuple(NvLink(**link) for link in fields.get("nvlinks", ()))
        fields["missing"] = dict(fields.get("missing", {}))
        gpus.append(NvmlGpu(**fields))
    return NvmlReport(driver_version=report.get("driver_version"), gpus=tuple(gpus))


@dataclasses.dataclass(frozen=True)
class CudaOrdinals:
    """Which GPU each CUDA ordinal (``cuda:N`` in torch, Mooncake and kvctl's GPU buffers)
    is in this process, under ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.

    Attributes:
        visible: the visible GPUs, ordinal order: ``visible[N]`` is ``cuda:N``.
        hidden: GPUs NVML sees that this process's CUDA does not.
        notes: what could not be mapped exactly (an invalid entry that ends the list, a MIG
            instance, ``FASTEST_FIRST`` over mixed models), for display.
    """

    visible: tuple[NvmlGpu, ...]
    hidden: tuple[NvmlGpu, ...] = ()
    notes: tuple[str, ...] = ()

    def pci_of(self, ordinal: int) -> str | None:
        """PCI address of ``cuda:ordinal``, ``None`` when there is no such ordinal."""
        return self.visible[ordinal].pci if 0 <= ordinal < len(self.visible) else None

    def ordinal_of(self, pci: str) -> int | None:
        """The CUDA ordinal of the GPU at ``pci``, ``None`` when it is not visible."""
        target = normalize_bdf(pci)
        return next((n for n, g in enumerate(self.visible) if g.pci == target), None)


def cuda_ordinals(gpus: Sequence[NvmlGpu], environ: Mapping[str, str] | None = None
                  ) -> CudaOrdinals:
    """Map CUDA ordinals to NVML's GPUs as the CUDA runtime does.

    Without ``CUDA_VISIBLE_DEVICES`` every GPU is visible. The enumeration order is PCI bus
    order with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; CUDA's default ``FASTEST_FIRST`` puts
    faster GPUs first and is PCI order among equal ones, so it is PCI order when every GPU
    is the same model (otherwise a note says the order is a guess).
    ``CUDA_VISIBLE_DEVICES`` lists indexes into that order or ``GPU-<uuid>`` (a unique
    prefix is enough); the first entry that matches nothing, or repeats one, ends the list
    as in CUDA; ``MIG-...`` instances are noted and left out (NVML here lists whole GPUs).
    """
    env = os.environ if environ is None else environ
    order = sorted(gpus, key=lambda g: g.pci)
    notes: list[str] = []
    if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
        models = {g.name for g in order}
        if len(models) > 1:
            notes.append("CUDA_DEVICE_ORDER is FASTEST_FIRST over mixed GPU models: the "
                         "ordinals assume PCI order (set CUDA_DEVICE_ORDER=PCI_BUS_ID)")
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return CudaOrdinals(tuple(order), (), tuple(notes))
    if not raw.strip():
        return CudaOrdinals((), tuple(order), tuple(notes))  # "": no GPU for this process
    visible: list[NvmlGpu] = []
    for entry in (e.strip() for e in raw.split(",")):
        found = _visible_entry(entry, order)
        if isinstance(found, str):
            notes.append(found)
            break
        if found in visible:
            notes.append(f"CUDA_VISIBLE_DEVICES repeats {entry!r}: CUDA stops there")
            break
        visible.append(found)
    hidden = tuple(g for g in order if g not in visible)
    return CudaOrdinals(tuple(visible), hidden, tuple(notes))


def _visible_entry(entry: str, order: Sequence[NvmlGpu]) -> NvmlGpu | str:
    """The GPU one ``CUDA_VISIBLE_DEVICES`` entry names, or why it ends the list."""
    if not entry:
        return "CUDA_VISIBLE_DEVICES has an empty entry: CUDA stops there"
    if entry.isascii() and entry.isdigit():  # not "²" (int() refuses it)
        index = int(entry)
        if index < len(order):
            return order[index]
        return f"CUDA_VISIBLE_DEVICES names GPU {index}, but only {len(order)} exist"
    if entry.upper().startswith("MIG-"):
        return f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}): not mapped to a GPU"
    wanted = entry if entry.upper().startswith("GPU-") else f"GPU-{entry}"
    matches = [g for g in order if g.uuid and g.uuid.lower().startswith(wanted.lower())]
    if len(matches) == 1:
        return matches[0]
    why = "matches no GPU" if not matches else "is ambiguous"
    return f"CUDA_VISIBLE_DEVICES entry {entry!r} {why}: CUDA stops there"
