"""Which optional parts are present and usable here, each with a hint to install or fix.

Every check is a small function returning a :class:`ComponentStatus`; none raises for a
missing part. The probes reuse topo's NVML and verbs gateways, the metadata clients and the
packages' own import paths, so "usable" means what the rest of kvctl will find.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.metadata
import logging
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvctl.errors import KvctlError, UsageError
from kvctl.metadata import key_prefix, open_metadata
from kvctl.probe.nvml import NvmlBackend, PynvmlBackend
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import PyverbsBackend, VerbsBackend

_log = logging.getLogger("kvctl.doctor")


class Status(enum.StrEnum):
    """Outcome of one component check."""

    OK = "ok"
    UNAVAILABLE = "unavailable"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class ComponentStatus:
    """One optional part of the environment.

    Attributes:
        name: short identifier (``nvml``, ``rdma``, ``cuda``, ``mooncake``, ...).
        status: ok, unavailable (not installed / not present) or error (present but broken).
        detail: what was found (versions, device counts) or why not.
        hint: how to install or fix it; ``None`` when nothing is needed.
    """

    name: str
    status: Status
    detail: str
    hint: str | None = None


def check_nvml(backend: NvmlBackend | None = None) -> ComponentStatus:
    """NVIDIA driver and NVML (``nvidia-smi -q`` answers the same questions)."""
    backend = backend if backend is not None else PynvmlBackend()
    try:
        answer = backend.query()
    finally:
        backend.close()
    if isinstance(answer, Unavailable):
        return ComponentStatus("nvml", Status.UNAVAILABLE, answer.reason, answer.hint)
    driver = answer.driver_version or "unknown driver"
    return ComponentStatus("nvml", Status.OK, f"driver {driver}, {len(answer.gpus)} GPU(s)")


def check_rdma(backend: VerbsBackend | None = None) -> ComponentStatus:
    """pyverbs and RDMA devices (``ibv_devinfo`` answers the same questions)."""
    backend = backend if backend is not None else PyverbsBackend()
    answer = backend.query()
    if isinstance(answer, Unavailable):
        return ComponentStatus("rdma", Status.UNAVAILABLE, answer.reason, answer.hint)
    names = ", ".join(d.name for d in answer.devices) or "none"
    if not answer.devices:
        return ComponentStatus("rdma", Status.UNAVAILABLE, "pyverbs works but no RDMA devices",
                               "load the NIC's RDMA driver (mlx5_ib, irdma, ...)")
    return ComponentStatus("rdma", Status.OK, f"{len(answer.devices)} device(s): {names}")


def check_cuda(importer: Callable[[str], object] = importlib.import_module) -> ComponentStatus:
    """CUDA for GPU-memory segments: torch with a CUDA device (what ``kind="gpu"`` segments
    and GPU initiators use). cupy alone is reported, but is not enough."""
    reasons: list[str] = []
    cupy_count = 0
    for module in ("torch", "cupy"):
        try:
            mod = importer(module)
        except ImportError as exc:
            reasons.append(f"{module} not installed ({exc.name or module})")
            continue
        try:
            count = _cuda_device_count(module, mod)
        except Exception as exc:  # noqa: BLE001 - any driver/runtime failure is "not usable"
            reasons.append(f"{module}: {type(exc).__name__}: {exc}")
            continue
        if count > 0 and module == "torch":
            version = getattr(getattr(mod, "version", None), "cuda", None)
            built = f", built for CUDA {version}" if version else ""
            return ComponentStatus("cuda", Status.OK,
                                   f"torch: {count} CUDA device(s){built}")
        if count > 0:
            cupy_count = count
            reasons.append(f"cupy sees {count} CUDA device(s), but GPU segments need torch")
        else:
            reasons.append(f"{module} sees no CUDA device")
    hint = ("install a CUDA build of torch (pip install torch) in this environment"
            if cupy_count else
            "install a CUDA build of torch (pip install torch) on a host with a GPU")
    return ComponentStatus("cuda", Status.UNAVAILABLE, "; ".join(reasons), hint)


def _cuda_device_count(module: str, mod: object) -> int:
    if module == "torch":
        cuda = getattr(mod, "cuda")  # noqa: B009 - dynamic module
        return int(cuda.device_count()) if cuda.is_available() else 0
    runtime = getattr(getattr(mod, "cuda"), "runtime")  # noqa: B009
    return int(runtime.getDeviceCount())


#: NIXL's import names: the meta package ``nixl`` (pure Python, picks cu12/cu13) and the
#: CUDA-specific wheels it loads.
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
NIXL_META_HINT = ("pip install --no-deps nixl (the pure-Python meta package that provides "
                  "'import nixl' and picks nixl-cu12/cu13 from the CUDA of torch or cupy)")


def check_nixl(importer: Callable[[str], object] = importlib.import_module) -> ComponentStatus:
    """NIXL as kvctl's driver loads it: ``nixl._api``, else ``nixl_cu12._api`` /
    ``nixl_cu13._api`` (the CUDA wheels work without the ``nixl`` meta package)."""
    versions = []
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    failures: list[str] = []
    for module in NIXL_MODULES:
        try:
            importer(module)
        except ImportError as exc:
            failures.append(f"{module}: {exc}")
            continue
        found = ", ".join(versions) or module.partition(".")[0]
        if module == "nixl._api":
            return ComponentStatus("nixl", Status.OK, f"{found}: nixl._api importable")
        return ComponentStatus(
            "nixl", Status.OK,
            f"{found}: {module} importable (kvctl's driver uses it); 'import nixl' fails: "
            "the nixl meta package is not installed", NIXL_META_HINT)
    detail = "cannot import NIXL (" + "; ".join(failures) + ")"
    if not versions:
        return ComponentStatus("nixl", Status.UNAVAILABLE, detail,
                               "pip install --no-deps nixl-cu12 nixl (PyPI builds are CUDA "
                               "wheels; UCX on host memory runs without a GPU)")
    last = failures[-1] if failures else ""
    hint = _import_hint(ImportError(last))
    return ComponentStatus("nixl", Status.ERROR, f"{', '.join(versions)} installed but {detail}",
                           hint)


def check_package(
    name: str,
    distributions: Sequence[str],
    module: str,
    install_hint: str,
    *,
    binaries: Sequence[str] = (),
    importer: Callable[[str], object] = importlib.import_module,
) -> ComponentStatus:
    """A Python package that kvctl drives (Mooncake, NIXL): importable, with its version."""
    version = None
    for dist in distributions:
        try:
            version = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        importer(module)
    except ImportError as exc:
        detail = f"cannot import {module}: {exc}"
        if version is None:
            return ComponentStatus(name, Status.UNAVAILABLE, detail, install_hint)
        return ComponentStatus(name, Status.ERROR, f"{version} installed but {detail}",
                               _import_hint(exc))
    found = [b for b in binaries if _find_binary(b)]
    extra = f"; binaries: {', '.join(found)}" if found else ""
    return ComponentStatus(name, Status.OK, f"{version or module} importable{extra}")


def _import_hint(exc: ImportError) -> str:
    text = str(exc)
    if "libibverbs" in text or "librdmacm" in text:
        return "install the verbs runtime: apt-get install libibverbs1 librdmacm1"
    if "libcuda" in text or "libcudart" in text:
        return "this build needs CUDA; install the package's non-CUDA variant"
    return "reinstall the package in this environment"


def _find_binary(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def check_metadata_url(url: str, name: str = "metadata") -> ComponentStatus:
    """A metadata service (etcd, Redis, kvctl's own server, file) answers a prefix listing."""
    try:
        with open_metadata(url) as client:
            entries = client.list(key_prefix())
    except UsageError:  # a malformed URL is the operator's input, not a component's state
        raise
    except KvctlError as exc:
        return ComponentStatus(name, Status.ERROR, f"{url}: {exc.cause}", exc.hint)
    return ComponentStatus(name, Status.OK, f"{url}: reachable, {len(entries)} kvctl key(s)")


def default_checks(metadata_urls: Sequence[str] = (), shared_tiers: Sequence[Path] = ()
                   ) -> list[Callable[[], ComponentStatus | list[ComponentStatus]]]:
    """The checks ``kvctl doctor env`` runs, in display order (``shared_tiers``: store
    shared-tier directories, see :mod:`kvctl.store.sharedtier.doctor`)."""
    checks: list[Callable[[], ComponentStatus | list[ComponentStatus]]] = [
        check_nvml,
        check_rdma,
        check_cuda,
        lambda: check_package(
            "mooncake", ["mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"],
            "mooncake.engine",
            "pip install 'kvctl[engines]' (mooncake-transfer-engine-non-cuda; needs "
            "apt-get install libibverbs1)",
            binaries=["mooncake_master", "transfer_engine_bench"],
        ),
        check_nixl,
    ]
    for url in metadata_urls:
        label = url.split("://", 1)[0] if "://" in url else "metadata"
        checks.append(functools.partial(check_metadata_url, url, label))
    for root in shared_tiers:
        checks.append(functools.partial(_shared_tier_checks, root))
    return checks


def _shared_tier_checks(root: Path) -> list[ComponentStatus]:
    from kvctl.store.sharedtier.doctor import checks

    return checks(root)


def run_checks(checks: Sequence[Callable[[], ComponentStatus | list[ComponentStatus]]]
               ) -> list[ComponentStatus]:
    """Run every check (one may report several components); a check that raises a kvctl
    error is reported, not propagated (except a :class:`UsageError`: bad input such as a
    malformed URL, exit 2)."""
    results: list[ComponentStatus] = []
    for check in checks:
        try:
            found = check()
            results.extend(found if isinstance(found, list) else [found])
        except UsageError:
            raise
        except KvctlError as exc:
            results.append(ComponentStatus(getattr(check, "__name__", "check"), Status.ERROR,
                                           exc.cause, exc.hint))
    return results
