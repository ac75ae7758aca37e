"""The verbs provider: pyverbs' classes and constants, imported lazily from one package.

The package is rdma-core's ``pyverbs`` unless ``KVCTL_PYVERBS`` names another one with the
same layout (``device``, ``pd``, ``mr``, ``cq``, ``qp``, ``addr``, ``wr``, ``enums``,
``pyverbs_error``); the tests run the transport over ``tests.fakes.pyverbs`` that way, in
this process and in the child processes they start. The provider in use is logged.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from types import ModuleType
from typing import Any

from kvctl.probe.verbs import import_pyverbs_device

_log = logging.getLogger("kvctl.transfer.rdma")

#: Environment variable naming a pyverbs-compatible package (default ``pyverbs``).
PROVIDER_ENV = "KVCTL_PYVERBS"
INSTALL_HINT = "install python3-pyverbs (apt) or 'pip install kvctl[rdma]'"

#: ``enum ibv_wc_status`` → name (``ibv_wc_status_str`` spells the same meanings).
WC_STATUS = {
    0: "IBV_WC_SUCCESS", 1: "IBV_WC_LOC_LEN_ERR", 2: "IBV_WC_LOC_QP_OP_ERR",
    3: "IBV_WC_LOC_EEC_OP_ERR", 4: "IBV_WC_LOC_PROT_ERR", 5: "IBV_WC_WR_FLUSH_ERR",
    6: "IBV_WC_MW_BIND_ERR", 7: "IBV_WC_BAD_RESP_ERR", 8: "IBV_WC_LOC_ACCESS_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR", 10: "IBV_WC_REM_ACCESS_ERR", 11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR", 13: "IBV_WC_RNR_RETRY_EXC_ERR", 14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR", 16: "IBV_WC_REM_ABORT_ERR", 17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR", 19: "IBV_WC_FATAL_ERR", 20: "IBV_WC_RESP_TIMEOUT_ERR",
    21: "IBV_WC_GENERAL_ERR",
}
#: What an operator should suspect for the statuses seen in the field.
WC_MEANING = {
    1: "message longer than the port's max_msg_sz or the local buffer",
    4: "local buffer not covered by its memory region (lkey or bounds)",
    5: "flushed: the queue pair had already failed",
    9: "the target rejected the request (too long, or an invalid opcode)",
    10: "the target refused access: rkey, bounds or permissions (deregistered segment?)",
    12: "no answer from the target NIC after retries: link, routing (GID index, hop limit, "
        "PFC) or MTU",
    13: "receiver not ready",
    20: "response timeout",
}
WC_SUCCESS = 0
WC_FLUSH = 5


def wc_status_text(status: int) -> str:
    """``IBV_WC_REM_ACCESS_ERR (the target refused access: ...)`` for a completion status."""
    name = WC_STATUS.get(status, f"status {status}")
    meaning = WC_MEANING.get(status)
    return f"{name} ({meaning})" if meaning else name


@dataclasses.dataclass(frozen=True)
class Verbs:
    """The pyverbs API the transport calls, taken from one package.

    Attributes:
        package: the package's import name (``pyverbs`` or a stand-in).
        device: its ``device`` module (``get_device_list``, ``Context``).
        enums: its ``enums`` module.
        Error: ``PyverbsError``, the root of everything it raises.
        RDMAError: ``PyverbsRDMAError`` (carries ``error_code``, an errno).
    """

    package: str
    device: ModuleType
    enums: ModuleType
    PD: Any
    MR: Any
    DmaBufMR: Any
    CQ: Any
    QP: Any
    QPInitAttr: Any
    QPCap: Any
    QPAttr: Any
    GID: Any
    GlobalRoute: Any
    AHAttr: Any
    SGE: Any
    SendWR: Any
    Error: type[Exception]
    RDMAError: type[Exception]


def provider_name() -> str:
    """The package the transport takes pyverbs from."""
    return os.environ.get(PROVIDER_ENV) or "pyverbs"


def load_verbs(package: str | None = None) -> Verbs:
    """Import the provider's modules.

    Raises:
        ImportError: the package (or one of its modules) cannot be imported.
    """
    name = package or provider_name()
    if name == "pyverbs":
        device = import_pyverbs_device()  # keeps the root logger as it was
    else:
        device = importlib.import_module(f"{name}.device")
        _log.info("verbs provider: %s (from %s)", name, PROVIDER_ENV)

    def mod(part: str) -> ModuleType:
        return importlib.import_module(f"{name}.{part}")

    mr, qp, addr, wr, errors = mod("mr"), mod("qp"), mod("addr"), mod("wr"), mod("pyverbs_error")
    return Verbs(
        package=name, device=device, enums=mod("enums"), PD=mod("pd").PD, MR=mr.MR,
        DmaBufMR=getattr(mr, "DmaBufMR", None), CQ=mod("cq").CQ, QP=qp.QP,
        QPInitAttr=qp.QPInitAttr, QPCap=qp.QPCap, QPAttr=qp.QPAttr, GID=addr.GID,
        GlobalRoute=addr.GlobalRoute, AHAttr=addr.AHAttr, SGE=wr.SGE, SendWR=wr.SendWR,
        Error=errors.PyverbsError, RDMAError=errors.PyverbsRDMAError)


def error_code(exc: BaseException) -> int | None:
    """The errno a pyverbs error carries, if any."""
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, int) and code > 0 else None
