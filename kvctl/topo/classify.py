"""Classify the PCIe path between two devices with the ``nvidia-smi topo -m`` legend.

A device's sysfs path is ``pciDDDD:BB / root port / [switch upstream port / downstream
port]* / device``. Below a root port, switch ports alternate upstream, downstream; a switch
is named by its upstream port. Two devices:

- under different host bridges meet across the CPU: NODE when both sit on the same known
  NUMA node, else SYS (an unknown NUMA node counts as SYS; callers pass the host's only
  node for an unknown one on a one-node host, as ``nvidia-smi`` prints NODE there);
- under the same host bridge but different root ports meet at the host bridge: PHB;
- under the same root port cross the switch they meet in plus every switch below that on
  either side: one switch (or none) is PIX, more is PXB.
"""

from __future__ import annotations

from kvctl.topo.model import LinkClass


def switches_on_path(a: tuple[str, ...], b: tuple[str, ...]) -> int | None:
    """How many PCIe switches the path between ``a`` and ``b`` crosses, or ``None`` when the
    path goes through the host bridge (different root ports or host bridges).

    ``a`` and ``b`` are sysfs paths as in :attr:`kvctl.probe.host.PciFunction.path`.
    """
    if a[0] != b[0]:
        return None
    ca, cb = a[1:], b[1:]  # root port first, device last
    common = 0
    for x, y in zip(ca, cb, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return None
    deepest = common - 1
    meet = 0
    if deepest >= 1:
        meet = 1  # the meeting point is a switch port (index 1, 3, .. upstream)
    below = {ca[i] for i in range(common, len(ca) - 1) if i % 2 == 1}
    below |= {cb[i] for i in range(common, len(cb) - 1) if i % 2 == 1}
    return meet + len(below)


def classify(
    a: tuple[str, ...] | None,
    b: tuple[str, ...] | None,
    numa_a: int | None,
    numa_b: int | None,
) -> LinkClass:
    """The class of the path between two devices given their sysfs paths and NUMA nodes.

    A device without a known PCI path is SYS to everything (nothing proves it is closer).
    """
    if a is None or b is None:
        return LinkClass.SYS
    if a == b:
        return LinkClass.X
    if a[0] != b[0]:
        if numa_a is not None and numa_a == numa_b:
            return LinkClass.NODE
        return LinkClass.SYS
    count = switches_on_path(a, b)
    if count is None:
        return LinkClass.PHB
    return LinkClass.PIX if count <= 1 else LinkClass.PXB
