"""A faithful fake of the subset of rdma-core's pyverbs (v44) that kvctl uses.

Import it where ``pyverbs`` would be imported (kvctl's rdma transport takes the package
name from ``KVCTL_PYVERBS``): same module layout (``device``, ``pd``, ``mr``, ``cq``,
``qp``, ``addr``, ``wr``, ``enums``, ``pyverbs_error``), same class and keyword names, same
errors. The semantics are enforced, not stubbed; :mod:`tests.fakes.pyverbs._hca` lists them.

Tests describe the host with :class:`HostSpec` (devices, ports, GID tables, subnets) and
either :func:`configure` it in-process or write it to a JSON file named by
``FAKE_PYVERBS_CONFIG`` for child processes; hosts sharing a ``fabric`` directory reach
each other.
"""

from tests.fakes.pyverbs._hca import (
    CONFIG_ENV,
    DeviceSpec,
    GidSpec,
    HostSpec,
    PortSpec,
    configure,
    efa_device,
    ib_port,
    native_allocations,
    open_qps,
    roce_port,
    set_link,
)

__all__ = ["CONFIG_ENV", "DeviceSpec", "GidSpec", "HostSpec", "PortSpec", "configure",
           "efa_device", "ib_port", "native_allocations", "open_qps", "roce_port", "set_link"]
