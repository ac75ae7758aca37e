"""Successive views of one store: each over the time since the previous reading."""

from __future__ import annotations

import threading

from kvctl.errors import KvctlError
from kvctl.top.sources import Reading, Source
from kvctl.top.view import TopView


class TopSession:
    """Read ``source`` again and again; each view's rates cover the time since the last.

    A failed read after the first one keeps the last view and says why (a master
    restarting must not end the watch); the first failure is raised.
    """

    def __init__(self, source: Source) -> None:
        self.source = source
        self._prev: Reading | None = None
        self._view: TopView | None = None

    def next(self) -> tuple[TopView, str | None]:
        """The next view, and why it is stale when the read failed (else ``None``).

        Raises:
            KvctlError: the very first read failed (wrong address, wrong backend, ...).
        """
        try:
            cur = self.source.read()
        except KvctlError as exc:
            if self._view is None:
                raise
            return self._view, f"cannot read {self.source.master}: {exc.cause} (retrying)"
        self._view = self.source.view(self._prev or cur, cur)
        self._prev = cur
        return self._view, None


def read_once(source: Source, interval_s: float, *, stop: threading.Event | None = None
              ) -> TopView:
    """One view with rates over ``interval_s`` seconds (two readings that far apart).

    Raises:
        KvctlError: either reading failed.
    """
    first = source.read()
    (stop or threading.Event()).wait(interval_s)
    return source.view(first, source.read())
