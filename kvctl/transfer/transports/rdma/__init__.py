"""``rdma``: one-sided RDMA READ/WRITE over RC queue pairs, through pyverbs (imported lazily).

The package is split by concern, each module with one job:

- :mod:`.provider`: the pyverbs classes and constants (``KVCTL_PYVERBS`` names a stand-in
  with the same layout, as the tests do) and completion status names;
- :mod:`.devices`: which ports are usable (ACTIVE, RC-capable, with a LID or a RoCE v2
  GID), a context per port, and the NICs for each buffer from ``kvctl topo``'s ranking;
- :mod:`.memory`: memory regions per buffer and port (host, GPU by dma-buf or peermem),
  staging for buffers without one;
- :mod:`.exchange`: QP lifecycle (INIT → RTR → RTS, ERR, destroy) and the direct QP
  exchange with the target's service;
- :mod:`.datapath`: posting within each QP's and CQ's capacity, completions matched by
  ``wr_id``, failed QPs drained and destroyed, failed slices retried on another NIC;
- :mod:`.transport`: the :class:`RdmaTransport` the engine uses.

Without pyverbs, devices or a usable port, :func:`rdma_probe` says why and how to fix it;
the engine then reports "RDMA unavailable: <why>" and ``auto`` uses tcp (logged).
"""

from kvctl.transfer.transports.rdma.devices import NicPort, Probe, RdmaOptions
from kvctl.transfer.transports.rdma.exchange import QpInfo
from kvctl.transfer.transports.rdma.provider import PROVIDER_ENV, wc_status_text
from kvctl.transfer.transports.rdma.transport import (
    RdmaTransport,
    rdma_probe,
    rdma_unavailable_reason,
)

__all__ = ["PROVIDER_ENV", "NicPort", "Probe", "QpInfo", "RdmaOptions", "RdmaTransport",
           "rdma_probe", "rdma_unavailable_reason", "wc_status_text"]
