"""``kvctl bench``: fabric benchmarks with integrity checks and line-rate verdicts.

Layers, bottom up:

- :mod:`kvctl.bench.spec`: the sweep (ops x transports x block sizes x batch sizes) and the
  ``bench`` settings section;
- :mod:`kvctl.bench.stats`: percentiles and standard deviation of latency samples;
- :mod:`kvctl.bench.verify`: per-block patterns (run id, block index, offset) and their check;
- :mod:`kvctl.bench.linerate`: the expected ceiling of each path (memcpy, raw loopback TCP,
  NIC port rate);
- :mod:`kvctl.bench.engines`: drivers for kvctl's own engine, Mooncake and NIXL;
- :mod:`kvctl.bench.runner`: runs a sweep through a driver and yields result rows
  (:mod:`kvctl.bench.result`).
"""
