"""``kvctl bench``: fabric benchmarks with integrity checks and line-rate verdicts.

Layers, bottom up:

- :mod:`kvctl.bench.spec`: the sweep (ops x transports x block sizes x batch sizes) and the
  ``bench`` settings section;
- :mod:`kvctl.bench.stats`: percentiles and standard deviation of latency samples;
- :mod:`kvctl.bench.verify`: per-block patterns (run id, block index, offset) and their check;
- :mod:`kvctl.bench.linerate`: the expected ceiling of each path (memcpy, raw loopback TCP,
  NIC port rate);
- :mod:`kvctl.bench.region`: the memory a foreign engine registers (host or GPU);
- :mod:`kvctl.bench.target`: the targets (kvctl's engine's, in this process or a spawned one;
  every engine's for ``--role target``) and the spawned processes they run in;
- :mod:`kvctl.bench.engines`: drivers only, for kvctl's own engine, Mooncake and NIXL;
- :mod:`kvctl.bench.runner`: runs a sweep through a driver and yields result rows
  (:mod:`kvctl.bench.result`);
- :mod:`kvctl.bench.session`: every engine's sweep of one run, foreign ones each in a process
  of its own (:mod:`kvctl.bench.isolated`).
"""
