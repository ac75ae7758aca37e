"""GPU-NIC PCIe affinity: model, classification, ranking, doctor, snapshots, exports.

The entry points are :func:`kvctl.topo.sources.load_topology` (build the topology from the
live host, a sysfs tree or a snapshot) and :func:`kvctl.topo.rank.preferred_nics` (NICs for
a buffer location, best first).
"""
