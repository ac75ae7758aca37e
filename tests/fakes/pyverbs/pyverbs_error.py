"""pyverbs' exception classes, with the same messages and ``error_code`` as rdma-core v44."""

from __future__ import annotations

import os


class PyverbsError(Exception):
    """Base of pyverbs errors; the message carries ``Errno: N, <strerror>`` when known."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)


class PyverbsRDMAError(PyverbsError):
    """An rdma-core call failed; ``error_code`` is its errno."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(msg, error_code)
        self._error_code = error_code

    @property
    def error_code(self) -> int:
        return self._error_code


class PyverbsUserError(PyverbsError):
    """pyverbs refused the caller's input before calling rdma-core."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
