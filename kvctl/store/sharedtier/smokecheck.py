"""``kvctl store smoke``'s shared-tier check: the object outlives the node that wrote it.

With a writer it may kill (the embedded smoke runs one storage node as a child process):
put objects until one lands on that node, wait for its shared-tier copy, ``SIGKILL`` the
node, and read the object with a new client (which must read the file: its only DRAM copy
died). Against a master it did not start: find an object of the smoke's in the shared tier
and read its file directly from this host (what a get does once the writer is gone),
leaving nodes alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvctl.errors import KvctlError
from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.sharedtier.config import map_path
from kvctl.store.sharedtier.reader import SharedReader
from kvctl.store.smoke import _wait_for

MiB = 1 << 20


class SharedCheckSkipError(Exception):
    """The check does not apply here (message says why)."""


class SharedCheckFailError(Exception):
    """The check failed (message says why)."""


@dataclass
class WriterNode:
    """A storage node in a child process, to be killed: ``node_id`` and its process."""

    node_id: str
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, master: str, node_id: str, *, capacity: str = "16MiB",
              env: dict[str, str] | None = None) -> WriterNode:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "-q", "store", "node", "--master", master,
             "--capacity", capacity, "--node-id", node_id],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env)
        return cls(node_id, proc)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


class Writers:
    """Writer nodes started for the check (the embedded smoke's), killed at the end."""

    def __init__(self) -> None:
        self.started: list[WriterNode] = []

    def start(self, master: str) -> WriterNode:
        # the embedded master asks for no token: neither may its node
        env = {k: v for k, v in os.environ.items() if k != "KVCTL_TOKEN"}
        writer = WriterNode.start(master, "smoke-writer", env=env)
        self.started.append(writer)
        return writer

    def kill_all(self) -> None:
        for writer in self.started:
            writer.kill()
        self.started.clear()


def run_check(client: StoreClient, key: Callable[[str], str],
              new_client: Callable[[], StoreClient],
              start_writer: Callable[[], WriterNode] | None, evicted: Sequence[str] = ()
              ) -> str:
    """The check's verdict (raises :class:`SharedCheckSkipError` or
    :class:`SharedCheckFailError`); ``key(name)`` names a smoke key, ``start_writer``
    starts a node the check may kill (``None``: not the smoke's store), ``evicted`` lists
    keys the smoke wrote before (some may be in the tier by now)."""
    shared = client.status().shared
    if shared is None:
        raise SharedCheckSkipError("the master has no shared tier (--shared-tier)")
    if start_writer is None:
        return _read_from_here(client, evicted)
    writer = start_writer()
    if not _wait_for(lambda: any(n.node_id == writer.node_id and n.alive
                             for n in client.status().nodes), 20.0):
        raise SharedCheckFailError(f"writer node {writer.node_id} did not register in 20 s")
    for i in range(32):
        name, value = key(f"shared-{i}"), os.urandom(MiB)
        client.put(name, value)
        if writer.node_id in client.stat(name).replicas:
            break
    else:
        raise SharedCheckSkipError(f"no object landed on {writer.node_id} in 32 puts")
    if not _wait_for(lambda: "shared" in client.stat(name).tier, 15.0):
        raise SharedCheckFailError(f"{name}: no shared-tier copy within 15 s "
                                   f"({shared.policy}; tier {client.stat(name).tier})")
    writer.kill()
    # Drop it rather than wait for the master to notice (a loaded machine stretches that
    # past any fixed wait): until then a new client on this host could still map the dead
    # node's shared memory, which outlives its process, and read its DRAM copy.
    client.drop_node(writer.node_id)
    if any(n.node_id == writer.node_id and n.alive for n in client.status().nodes):
        raise SharedCheckFailError(f"the master still calls {writer.node_id} alive after "
                                   "it was killed and dropped")
    with new_client() as reader:
        got = reader.get(name)
        from_file = reader.shared.reads
    if got != value:
        raise SharedCheckFailError(f"{name}: bytes read after its writer was killed differ")
    if not from_file:
        raise SharedCheckFailError(f"{name}: read back after its writer was killed, but not "
                                   "from the shared tier")
    return (f"{name} written by {writer.node_id}, which was SIGKILLed; a new client read "
            "its shared-tier file, byte for byte")


def _read_from_here(client: StoreClient, keys: Sequence[str]) -> str:
    for name in keys:
        info = client.stat(name)
        if "shared" not in info.tier:
            continue
        # the file (or pack record) the master names for it, read here as a get would
        reply = client._call(p.Get(keys=[client.namespace + name], lease=False))
        slot = reply.slots[0] if isinstance(reply, p.GetReply) else None
        if not isinstance(slot, p.GetSlot) or not slot.shared:
            continue
        path = map_path(slot.shared, client.shared.path_map)
        data = SharedReader(client.shared.path_map, threads=1).read(name, slot, None)
        if isinstance(data, KvctlError):
            raise SharedCheckFailError(f"{name}: its shared-tier file {path} does not read "
                                       f"back from this host: {data.cause}")
        if data != client.get(name):
            raise SharedCheckFailError(f"{name}: the file and the store disagree")
        return (f"{name}'s file {path} read from this host and verified (its writer was "
                "not killed: the store is not the smoke's own)")
    raise SharedCheckSkipError("none of the smoke's objects reached the shared tier "
                               "(write-back: only DRAM evictions go there)")
