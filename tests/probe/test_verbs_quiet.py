"""Importing pyverbs through kvctl leaves the root logger as the application set it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_pyverbs_import_does_not_configure_the_root_logger() -> None:
    pytest.importorskip("pyverbs", reason="pyverbs (python3-pyverbs) is not installed")
    code = ("import logging\n"
            "from kvctl.probe.verbs import import_pyverbs_device\n"
            "import_pyverbs_device()\n"
            "from kvctl.transfer.transports.rdma import rdma_unavailable_reason\n"
            "rdma_unavailable_reason()\n"
            "root = logging.getLogger()\n"
            "print(len(root.handlers), root.level)\n"
            "import pyverbs.cq\n")  # later pyverbs imports: module cached, no side effect
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", str(30)]  # no handler added, WARNING kept
