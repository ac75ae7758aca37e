"""Read-only host discovery: sysfs under a root path, NVML and verbs.

Each source sits behind a small interface so tests hand in fakes and a recorded snapshot
replays through the same code as the live host:

- :class:`~kvctl.probe.sysfs.SysfsReader` reads a sysfs tree rooted at any directory
  (``/`` for the live host), resolving symlinks inside that root;
- :class:`~kvctl.probe.nvml.NvmlBackend` answers GPU questions (pynvml, lazily imported);
- :class:`~kvctl.probe.verbs.VerbsBackend` answers RDMA port questions (pyverbs, lazily).

A source that cannot answer returns :class:`~kvctl.probe.types.Unavailable` with the reason,
never raises for "not here".
"""
