"""Re-record ``examples/hosts/h100-8gpu.tar.gz``: the fixture HGX H100-class host with the
NVML answer such a host gives (18 active NVLinks per GPU, to the NVSwitches).

A sysfs tree alone cannot show NVLink (the kernel exposes none; ``nvidia-smi topo -m``
asks NVML), so an example without NVML's answer printed PCIe classes where nvidia-smi
prints NV18. Run from the repository root:

    PYTHONPATH=. .venv/bin/python examples/hosts/record_h100.py examples/hosts/h100-8gpu.tar.gz
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kvctl.probe.host import scan_sysfs
from kvctl.probe.nvml import RecordedNvml
from kvctl.probe.sysfs import SysfsReader
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.snapshot import write_snapshot
from tests.fixtures.sysfs import build_sysfs, h100_host, nvswitch_report


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kvctl-h100-") as tmp:
        tree = build_sysfs(Path(tmp) / "tree", h100_host())
        facts = scan_sysfs(SysfsReader(tree))
        nvml = RecordedNvml(nvswitch_report(list(facts.gpus), list(facts.nvswitches)))
        verbs = RecordedVerbs(Unavailable(
            "verbs", "example built from a fixture tree: no verbs answer recorded",
            "record a real host with kvctl topo snapshot"))
        summary = write_snapshot(out, tree, nvml, verbs)
    print(f"wrote {summary.path}: {summary.files} files, {summary.links} links")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/hosts/h100-8gpu.tar.gz"))
