"""The serving side of ``kvctl bench transfer``: the targets initiators READ from and WRITE to.

Two servers, because they sit on two sides of the drivers:

- :mod:`~kvctl.bench.target.kvctl`: kvctl's own engine serving one segment
  (:class:`~kvctl.bench.target.kvctl.BenchTarget` in this process,
  :class:`~kvctl.bench.target.kvctl.EmbeddedTarget` in a spawned one). It sits *under* the
  drivers: kvctl's driver (:mod:`kvctl.bench.engines.kvctl`) spawns one on loopback for a
  zero-setup run, as each foreign driver spawns its own engine's target.
- :mod:`~kvctl.bench.target.serve`: :class:`~kvctl.bench.target.serve.TargetSet`, what
  ``--role target`` (and a cluster agent's ``target`` job) serves for a whole sweep: a
  ``BenchTarget`` for kvctl's engine plus every foreign driver's targets, published in one
  metadata service. It sits *over* the drivers (it asks each for its targets), so it cannot
  be the server the kvctl driver spawns.

:mod:`~kvctl.bench.target.child` is what both, and the foreign drivers' targets, run in: a
spawned process with a pipe for "ready" and "stop". The package imports nothing itself, so
drivers may import its lower half without pulling in :mod:`~kvctl.bench.target.serve`.
"""
