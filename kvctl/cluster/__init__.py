"""The KV fabric of a whole cluster: per-host agents, pairwise schedules, one diagnosis.

- :mod:`~kvctl.cluster.diagnosis`: a pure function over a host x host results matrix that
  flags slow pairs with robust statistics and names the host (or host+NIC) they share.
- :mod:`~kvctl.cluster.scheduler`: which pairs run when (all pairs, rounds of disjoint pairs
  from a round-robin tournament, or a sample), and what a plan costs at 1,000 or 10,000
  hosts (rounds, wall time, metadata-service load).
- :mod:`~kvctl.cluster.protocol`: the keys and signed documents agents and clients exchange
  through the metadata service (etcd in production).
- :mod:`~kvctl.cluster.agent`: ``kvctl agent``, the per-host daemon: registration under a
  lease, jobs (targets, benches, runbooks, store roles, key manifests), metrics.
- :mod:`~kvctl.cluster.registry` and :mod:`~kvctl.cluster.coordinator`: the client side:
  registered hosts, jobs posted and awaited, hosts that vanish.
- :mod:`~kvctl.cluster.bench` and :mod:`~kvctl.cluster.runbook`: ``kvctl cluster bench`` and
  ``kvctl cluster runbook``; :mod:`~kvctl.cluster.report` renders their results as data
  (matrices, JSON, CSV, a heatmap).

Coordination is the metadata service's alone (leases, polling, per-key writes): no ssh, no
MPI, no shared file system.
"""
