"""Fuzz the store master's listener (``kvctl/store/server.py``: handshake, framing, msgspec
decoding of ``kvctl/store/protocol.py`` requests and dispatch into ``MasterCore``).

Each input is one connection served in-process by the real ``MasterServer`` connection
handler over loopback TCP. The master has one (fake) registered node, so puts allocate and
gets find locations. The first byte picks the mode:

- 0: the rest of the input as raw bytes after the server's Hello (no token);
- 1: the rest cut into length-prefixed chunks, each sent as a correctly framed message of the
  current protocol version (reaches msgspec decoding and the master's logic);
- 2: raw bytes to a master that requires a token.

Properties: no exception escapes the handler other than those it handles; the master's
catch-all never logs a crash (``master failed on ...``); every connection ends within a
deadline; mode 2 never gets ``Ok`` after its Hello and changes no state. Every
``CHECK_EVERY`` inputs a well-formed client puts and gets an object through the real
listener (the master keeps serving).

Run: ``python -m fuzz.fuzz_store -runs=100000 fuzz/corpus/store``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fuzz._util import ErrorTrap, FuzzFinding, Pump, TcpPair, split_chunks

TOKEN = "fuzz-store-" + os.urandom(8).hex()
NODE_BYTES = 1 << 20
CHECK_EVERY = 64


class StoreHarness:
    """An open and a token-protected master, each with one fake registered node."""

    def __init__(self) -> None:
        from kvctl.store import protocol as p
        from kvctl.store.master import MasterConfig, MasterCore
        from kvctl.store.server import MasterServer

        self.p = p
        self.codec = p.Codec()
        config = MasterConfig(node_timeout_s=1e9)  # the fake nodes never heartbeat
        self.open_core = MasterCore(config)
        self.auth_core = MasterCore(config)
        for core in (self.open_core, self.auth_core):
            core.register_node(p.RegisterNode(
                node_id="fuzz-node", epoch="e1", segment="fuzz-node.seg",
                endpoint="127.0.0.1:9", host_id="fuzz-host", capacity_bytes=NODE_BYTES))
        self.trap = ErrorTrap(["kvctl.store.server", "kvctl.store.master"])
        self.open_server = MasterServer(self.open_core)
        self.auth_server = MasterServer(self.auth_core, token=TOKEN)
        self.pair = TcpPair()
        self.inputs = 0

    def close(self) -> None:
        self.open_server.close()
        self.auth_server.close()
        self.pair.close()
        for name in ("kvctl.store.server", "kvctl.store.master"):
            __import__("logging").getLogger(name).removeHandler(self.trap)

    def _skip_hello(self, sock: Any) -> bytes:
        sock.settimeout(5.0)
        header = _recv_exact(sock, self.codec.frames.header_bytes)
        length = int.from_bytes(header[8:12], "little")
        hello = self.codec.decode_reply(_recv_exact(sock, length))
        if not isinstance(hello, self.p.Hello):
            raise FuzzFinding(f"master greeted with {type(hello).__name__}, not Hello")
        return b""

    def one_input(self, data: bytes) -> None:
        """Serve ``data`` as one connection and check every property."""
        if not data:
            return
        mode, body = data[0] % 3, data[1:]
        if mode == 1:
            body = b"".join(self.codec.frames.encode_header(self.p.PROTOCOL_VERSION, len(c)) + c
                            for c in split_chunks(body))
        server = self.auth_server if mode == 2 else self.open_server
        before = self._auth_state() if mode == 2 else None
        client, conn = self.pair()
        with server._lock:
            server._conns.add(conn)
        pump = Pump(client, body, self._skip_hello)
        try:
            server._serve(conn)  # the real per-connection handler
        finally:
            try:
                reply = pump.join()
            finally:
                client.close()
        self.trap.check()
        if mode == 2:
            self._check_refused(reply, before)
        self.inputs += 1
        if self.inputs % CHECK_EVERY == 0:
            self.roundtrip()

    def _auth_state(self) -> tuple[int, int]:
        status = self.auth_core.status()
        return status.objects, len(status.nodes)

    def _check_refused(self, reply: bytes, before: tuple[int, int] | None) -> None:
        header_bytes = self.codec.frames.header_bytes
        if len(reply) >= header_bytes:
            length = int.from_bytes(reply[8:12], "little")
            payload = reply[header_bytes:header_bytes + length]
            if len(payload) == length:
                first = self.codec.decode_reply(payload)
                if not isinstance(first, self.p.Fail):
                    raise FuzzFinding(f"token-protected master answered {type(first).__name__} "
                                      "to a client without the token")
        if self._auth_state() != before:
            raise FuzzFinding("an unauthenticated connection changed the master's state")

    def roundtrip(self) -> None:
        """A well-formed client registers nothing, puts one object and gets its location."""
        from kvctl.store.rpc import MasterConnection

        p = self.p
        key = f"fuzz-check-{os.urandom(4).hex()}"
        conn = MasterConnection(self.open_server.address, timeout_s=10)
        try:
            reply = conn.call(p.Put(items=[p.PutItem(key=key, size=64, checksum=1)]))
            if not isinstance(reply, p.PutReply) or not isinstance(reply.slots[0], p.PutSlot):
                raise FuzzFinding(f"well-formed put answered {reply!r}")
            slot = reply.slots[0]
            conn.send(p.Commit(keys=[key], versions=[slot.version]))
            got = conn.call(p.Get(keys=[key], lease=False))
            if not isinstance(got, p.GetReply) or not isinstance(got.slots[0], p.GetSlot):
                raise FuzzFinding(f"well-formed get answered {got!r}")
            conn.call(p.Remove(keys=[key]))
        finally:
            conn.close()


def _recv_exact(sock: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise FuzzFinding(f"master closed before sending {n} greeting bytes")
        buf += chunk
    return bytes(buf)


_HARNESS: StoreHarness | None = None


def harness() -> StoreHarness:
    """The process-wide harness (created on first use)."""
    global _HARNESS  # noqa: PLW0603 - one harness per fuzzing process
    if _HARNESS is None:
        _HARNESS = StoreHarness()
    return _HARNESS


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the name atheris expects
    harness().one_input(data)


def seeds() -> dict[str, bytes]:
    """Named seed inputs (written to fuzz/corpus/store by fuzz/make_seeds.py)."""
    import msgspec

    from kvctl.store import protocol as p

    enc = msgspec.msgpack.Encoder()
    codec = p.Codec()

    def chunks(*messages: Any) -> bytes:
        out = b""
        for m in messages:
            raw = m if isinstance(m, bytes) else enc.encode(m)
            out += len(raw).to_bytes(2, "little") + raw
        return out

    put = p.Put(items=[p.PutItem(key="k", size=100, checksum=7)])
    return {
        "put_commit_get": bytes([1]) + chunks(put, p.Commit(keys=["k"], versions=[1]),
                                              p.Get(keys=["k"]), p.Exists(keys=["k", "x"])),
        "list_stat_pin_remove": bytes([1]) + chunks(
            p.ListKeys(prefix="", limit=-5), p.Stat(key="k"), p.Pin(key="k"),
            p.Remove(keys=["k"]), p.Status(), p.Nodes()),
        "negative_sizes": bytes([1]) + chunks(
            p.Put(items=[p.PutItem(key="n", size=-1, checksum=0)], replicas=-3),
            p.Put(items=[p.PutItem(key="z", size=2**63 - 1, checksum=0)], replicas=2**31)),
        "register_heartbeat": bytes([1]) + chunks(
            p.RegisterNode(node_id="n2", epoch="e", segment="s", endpoint="h:1", host_id="x",
                           capacity_bytes=-1),
            p.Heartbeat(node_id="fuzz-node", epoch="wrong", wait_s=0.0)),
        "release_mismatch": bytes([1]) + chunks(
            p.Release(keys=["a", "b"], versions=[1]),
            p.Get(keys=["a"], release_keys=["a"], release_versions=[])),
        "login_unasked": bytes([1]) + chunks(p.Login(answer=b"x" * 32)),
        "garbage_msgpack": bytes([1]) + chunks(b"\xc1", b"\x92\xa3put\x90",
                                               b"\xdd\xff\xff\xff\xff"),
        "frame_2_32": bytes([0]) + codec.frames._HEADER.pack(p.MAGIC, 1, 2**32 - 1),
        "bad_magic": bytes([0]) + b"HTTP/1.1 200 OK\r\n\r\n",
        "bad_version": bytes([0]) + codec.frames._HEADER.pack(p.MAGIC, 9, 1) + b"\xc0",
        "auth_login_zero": bytes([2]) + codec.encode(p.Login(answer=bytes(32))),
        # Found by this harness: a garbled login frame escaped the handler as FrameError.
        "auth_login_bad_magic": bytes([2]) + b"VSVS]\x01\x00\x00\x00\xff\xff\xff\xff",
        "auth_login_2_32": bytes([2]) + codec.frames._HEADER.pack(p.MAGIC, 1, 2**32 - 1),
    }


def main() -> None:
    """atheris entry point: ``python -m fuzz.fuzz_store [libFuzzer flags] [corpus dirs]``."""
    import logging

    import atheris

    logging.getLogger("kvctl").setLevel(logging.ERROR)
    with atheris.instrument_imports(include=["kvctl"]):
        import kvctl.net.framing
        import kvctl.store.master
        import kvctl.store.protocol
        import kvctl.store.server  # noqa: F401
    from fuzz._util import run_atheris

    run_atheris(TestOneInput, sys.argv)


if __name__ == "__main__":
    main()
