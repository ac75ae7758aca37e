"""The shared tier: objects as files on a distributed file system (3FS, NFS, CephFS) that
every node and client mounts, indexed by the master, read by clients directly.

Where each part lives:

- :mod:`.fileformat`: file names, header, atomic write (temporary name, fsync, rename),
  verified reads (a torn, missing or foreign file is a miss).
- :mod:`.config`: the tier's settings, and per-host path maps.
- :mod:`.mixin`: the master's rules (write-back, write-through, quota and LRU, gets that
  name the file, what happens when the writer dies).
- :mod:`.housekeeping`: the master's file-system work, off its lock: deletes and the
  bounded purge sweep of orphan files.
- :mod:`.packs`: small copies written several to a pack file (``--shared-tier-pack-below``),
  the master's table of packs.
- :mod:`.writer`: the node's ``shared`` task; :mod:`.reader`: the client's read.
- :mod:`.reports`: files clients report bad, checked by the master before they leave the
  index.
- :mod:`.doctor`: what ``kvctl doctor env --shared-tier DIR`` checks.
"""
