"""``pyverbs.pd``: a protection domain; MRs and QPs of one PD see only each other."""

from __future__ import annotations

import weakref
from typing import Any


class PD:
    """``ibv_pd``; closing it closes its QPs and MRs first, as pyverbs does."""

    def __init__(self, context: Any) -> None:
        if getattr(context, "_closed", True):
            from tests.fakes.pyverbs._hca import rdma_error

            raise rdma_error("Failed to alloc PD", 9)
        self.context = context
        self.mrs: weakref.WeakSet[Any] = weakref.WeakSet()
        self.qps: weakref.WeakSet[Any] = weakref.WeakSet()
        self._by_lkey: dict[int, Any] = {}
        self._by_rkey: dict[int, Any] = {}
        self._closed = False
        context.pds.add(self)

    def add_mr(self, mr: Any) -> None:
        self.mrs.add(mr)
        self._by_lkey[mr.lkey] = mr
        self._by_rkey[mr.rkey] = mr

    def drop_mr(self, mr: Any) -> None:
        self._by_lkey.pop(mr.lkey, None)
        self._by_rkey.pop(mr.rkey, None)

    def by_lkey(self, key: int) -> Any:
        return self._by_lkey.get(key)

    def by_rkey(self, key: int) -> Any:
        return self._by_rkey.get(key)

    def close(self) -> None:
        if self._closed:
            return
        for qp in list(self.qps):
            qp.close()
        for mr in list(self.mrs):
            mr.close()
        self._closed = True
