#!/usr/bin/env python3
"""Record KV-event streams by running the engines' OWN publishers, event classes and hashers.

Not run by CI. Run once by hand (see README.md next to this file); it writes
``tests/keys/events/*.jsonl``, each in kvctl's ``--record`` format (a header line, then one
line per message with the instance, receive time, sequence number and the base64 payload).
This script never imports kvctl: the streams must come from the engines, so that kvctl's
decoder and checker are tested against them and not against themselves.

vLLM 0.33.0 (wheel unzipped under ``--engines DIR/vllm``): ``vllm/distributed/kv_events.py``
(``ZmqEventPublisher``, ``KVEventBatch``, ``BlockStored``/``BlockRemoved``/
``AllBlocksCleared``), ``vllm/v1/core/block_pool.py`` (``BlockPool``: ``get_new_blocks``,
``cache_full_blocks``, ``free_blocks``, ``reset_prefix_cache``, ``take_events`` — the code
that fills the events), ``vllm/v1/core/kv_cache_utils.py`` (``init_none_hash``,
``get_request_block_hasher``, ``maybe_convert_block_hash``, ``to_event_extra_keys``) and
``vllm/utils/hashing.py``. Everything else those files import is an inert stub.

SGLang 0.5.23 (``DIR/sglang``): ``sglang/srt/disaggregation/kv_events.py``
(``ZmqEventPublisher``, its event classes), ``sglang/srt/mem_cache/events.py``
(``KVCacheEventRecorder.record_store``/``record_remove``/``record_all_cleared``),
``sglang/srt/mem_cache/utils.py`` (``compute_node_hash_values``, ``hash_str_to_int64``) and
its native page hash ``cpp_utils/hash_binding.cpp`` compiled as its loader does.

Messages are read back through each publisher's own replay endpoint (its ROUTER socket,
asked from a DEALER for everything from seq 0): the very ``(topic, seq, payload)`` bytes it
published on its PUB socket.
"""

from __future__ import annotations

import argparse
import base64
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "keys" / "events"
#: Fixed receive times (the recorder's clock is not the point): 1 ms apart from here.
T0 = 1_767_225_600.0

# ---------------------------------------------------------------------------- stubs


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub()

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


class _StubModule(types.ModuleType):
    real: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in self.real:
            return importlib.import_module(f"{self.__name__}.{name}")
        value = _StubMeta(name, (_Stub,), {})
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, prefixes: tuple[str, ...], real: dict[str, Path]) -> None:
        self.prefixes = prefixes
        self.real = real
        _StubModule.real.update(real)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in self.real:
            return importlib.util.spec_from_file_location(fullname, self.real[fullname])
        if any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


STUBBED = ("vllm", "sglang", "torch", "transformers", "numpy", "triton", "pydantic",
           "prometheus_client", "regex", "psutil", "requests", "aiohttp")


def _install(engines: Path) -> None:
    v, s = engines / "vllm" / "vllm", engines / "sglang" / "sglang"
    real = {
        "vllm.distributed.kv_events": v / "distributed/kv_events.py",
        "vllm.v1.core.block_pool": v / "v1/core/block_pool.py",
        "vllm.v1.core.kv_cache_utils": v / "v1/core/kv_cache_utils.py",
        "vllm.utils.hashing": v / "utils/hashing.py",
        "sglang.srt.disaggregation.kv_events": s / "srt/disaggregation/kv_events.py",
        "sglang.srt.mem_cache.events": s / "srt/mem_cache/events.py",
        "sglang.srt.mem_cache.utils": s / "srt/mem_cache/utils.py",
        "sglang.srt.mem_cache.cpp_utils.native_hash": s / "srt/mem_cache/cpp_utils/native_hash.py",
    }
    sys.meta_path.insert(0, _Finder(STUBBED, real))


def _version(engines: Path, name: str) -> str:
    for meta in (engines / name).glob(f"{name}-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version: "):
                return line.split(": ", 1)[1]
    return "unknown"


# ---------------------------------------------------------------------------- traffic


def _lcg(n: int, seed: int, vocab: int = 151_936) -> list[int]:
    out, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % vocab)
    return out


SYSTEM = _lcg(64, 1)  # a shared system prompt: 4 blocks of 16


def _requests(variant: int) -> list[dict[str, Any]]:
    """Chat-like traffic: a shared system prompt, multi-turn sessions (each turn extends the
    last), a LoRA request, a salted request, and a prompt long enough to be prefilled in
    two chunks."""
    reqs: list[dict[str, Any]] = []
    for session in range(3):
        history = SYSTEM + _lcg(40, 100 * variant + session)
        for turn in range(2):
            history = history + _lcg(24, 1000 * variant + 10 * session + turn)
            reqs.append({"tokens": list(history)})
    reqs.append({"tokens": SYSTEM + _lcg(40, 7), "lora": ("sql-lora", "/adapters/sql-lora")})
    reqs.append({"tokens": SYSTEM + _lcg(40, 8), "cache_salt": "tenant-a"})
    reqs.append({"tokens": SYSTEM + _lcg(200, 9 + variant), "chunk": 96})
    return reqs


# ---------------------------------------------------------------------------- vLLM


class _Lora:
    def __init__(self, name: str, path: str) -> None:
        self.lora_name = self.name = name
        self.lora_path = path
        self.adapter_id = self.lora_int_id = 1


class _Request:
    """The fields of vLLM's Request that the block hasher and BlockPool read."""

    def __init__(self, spec: dict[str, Any], hasher: Any) -> None:
        self.all_token_ids = list(spec["tokens"])
        self.num_tokens = len(self.all_token_ids)
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        lora = spec.get("lora")
        self.lora_request = _Lora(*lora) if lora else None
        self.cache_salt = spec.get("cache_salt")
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}
        self.session_id = None
        self.block_hashes = hasher(self)


def _vllm_stream(engines: Path, algo: str, workdir: Path) -> list[tuple[int, bytes, bytes]]:
    _install(engines)
    import vllm

    envs = types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=os.environ.get(
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "1")
    vllm.envs = envs  # type: ignore[attr-defined]
    from vllm.distributed import kv_events
    from vllm.utils import hashing
    from vllm.v1.core import block_pool, kv_cache_utils

    kv_cache_utils.envs = envs
    hash_fn = hashing.get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(16, hash_fn)
    pool = block_pool.BlockPool(num_gpu_blocks=24, enable_caching=True, hash_block_size=16,
                                enable_kv_cache_events=True)
    pub = kv_events.ZmqEventPublisher(
        0, endpoint=f"ipc://{workdir}/pub", replay_endpoint=f"ipc://{workdir}/replay")
    variant = int(os.environ.get("KV_VARIANT", "0"))
    ts = T0
    requests = _requests(variant)

    def publish() -> None:
        nonlocal ts
        events = pool.take_events()
        if events:
            ts += 0.25
            pub.publish(kv_events.KVEventBatch(ts=ts, events=events))

    for number, spec in enumerate(requests):
        req = _Request(spec, hasher)
        full = len(req.all_token_ids) // 16
        hits = 0
        for h in req.block_hashes:
            if pool.get_cached_block(h, [0]) is None:
                break
            hits += 1
        cached = [pool.get_cached_block(h, [0])[0] for h in req.block_hashes[:hits]]
        pool.touch(cached)
        new = pool.get_new_blocks(full - hits + 1)  # + a block for decode
        blocks = cached + new
        publish()  # evictions made room: BlockRemoved first
        chunk = spec.get("chunk")
        done = hits
        steps = [full] if not chunk else list(range(hits + chunk // 16, full, chunk // 16)) + [full]
        for upto in steps:
            pool.cache_full_blocks(req, blocks, done, upto, 16, 0)
            done = upto
            publish()
        pool.free_blocks(reversed(blocks))
        if number == 5:  # the operator resets the prefix cache (e.g. after a weight update)
            pool.reset_prefix_cache()
            publish()
    return _drain(pub, kv_events.ZmqEventPublisher.END_SEQ, workdir)


def _drain(pub: Any, end: bytes, workdir: Path) -> list[tuple[int, bytes, bytes]]:
    import zmq

    pub._event_queue.join()  # noqa: SLF001 - every batch published (task_done per batch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"ipc://{workdir}/replay")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out: list[tuple[int, bytes, bytes]] = []
    while sock.poll(10_000):
        _, topic, seq, payload = sock.recv_multipart()
        if seq == end:
            break
        out.append((int.from_bytes(seq, "big"), topic, payload))
    sock.close(0)
    pub.shutdown()
    return out


# ---------------------------------------------------------------------------- SGLang


def _build_sglang_ext(engines: Path, build: Path) -> Path:
    import pybind11

    src = engines / "sglang/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp"
    build.mkdir(parents=True, exist_ok=True)
    out = build / f"hicache_hash_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not out.exists():
        subprocess.run(["g++", "-O3", "-std=c++17", "-DNDEBUG", "-shared", "-fPIC", "-w",
                        "-DTORCH_EXTENSION_NAME=hicache_hash_cpp",
                        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                        str(src), "-o", str(out), "-lcrypto"], check=True)
    return out


class _Key:
    """SGLang's RadixKey as the event recorder reads it."""

    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = tokens
        self.extra_key = None
        self.cache_salt = None
        self.is_bigram = False

    def __len__(self) -> int:
        return len(self.token_ids)


class _Node:
    def __init__(self, tokens: list[int], parent: _Node | None) -> None:
        self.key = _Key(tokens)
        self.parent = parent
        self.hash_value: list[str] | None = [] if parent is None else None
        self.event_hash_value: list[str] | None = None


def _sglang_stream(engines: Path, workdir: Path) -> list[tuple[int, bytes, bytes]]:
    _install(engines)
    ext_path = _build_sglang_ext(engines, workdir.parent / "sglang-ext")
    spec = importlib.util.spec_from_file_location("hicache_hash_cpp", ext_path)
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    import sglang.srt.utils.cpp_extension_loader as loader  # a stub module

    loader.load_extension_with_recovery = lambda **_kw: ext
    from sglang.srt.disaggregation import kv_events
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    page = 16
    recorder = KVCacheEventRecorder(enabled=True, page_size=page)
    pub = kv_events.ZmqEventPublisher(
        0, endpoint=f"ipc://{workdir}/pub", replay_endpoint=f"ipc://{workdir}/replay")
    root = _Node([], None)
    ts = T0
    nodes: list[_Node] = []
    # A radix tree as SGLang builds it: the system prompt, each session's first turn below
    # it, each later turn below the turn before (full pages only, as the cache keeps them).
    system = _Node(SYSTEM, root)
    recorder.record_store(system)
    nodes.append(system)
    last: dict[int, tuple[_Node, int]] = {}
    for i, spec_ in enumerate(_requests(0)[:6]):
        session = i // 2
        parent, start = last.get(session, (system, len(SYSTEM)))
        tokens = spec_["tokens"]
        end = start + (len(tokens) - start) // page * page
        node = _Node(tokens[start:end], parent)
        recorder.record_store(node)
        nodes.append(node)
        last[session] = (node, end)
        ts += 0.25
        pub.publish(kv_events.KVEventBatch(ts=ts, events=recorder.take()))
        if i == 3:  # evict a finished session's last turn
            recorder.record_remove(nodes[2])
    recorder.record_all_cleared()
    ts += 0.25
    pub.publish(kv_events.KVEventBatch(ts=ts, events=recorder.take()))
    return _drain(pub, kv_events.ZmqEventPublisher.END_SEQ, workdir)


# ---------------------------------------------------------------------------- output

#: name -> (engine, algo or "", environment)
STREAMS: dict[str, tuple[str, str, dict[str, str]]] = {
    "vllm_sha256_cbor": ("vllm", "sha256_cbor", {}),
    "vllm_sha256_cbor_variant": ("vllm", "sha256_cbor", {"KV_VARIANT": "1"}),
    "vllm_sha256_cbor_seed1": ("vllm", "sha256_cbor", {"PYTHONHASHSEED": "1"}),
    "vllm_sha256": ("vllm", "sha256", {}),
    "vllm_sha256_cbor_bytes": ("vllm", "sha256_cbor",
                               {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}),
    "sglang": ("sglang", "", {}),
}


def _worker(engines: Path, name: str) -> None:
    engine, algo, _ = STREAMS[name]
    with tempfile.TemporaryDirectory(prefix="kvrec-") as tmp:
        work = Path(tmp)
        stream = (_vllm_stream(engines, algo, work) if engine == "vllm"
                  else _sglang_stream(engines, work))
    json.dump([[seq, base64.b64encode(topic).decode(), base64.b64encode(payload).decode()]
               for seq, topic, payload in stream], sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True,
                        help="DIR with vllm/ and sglang/ unzipped wheels")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.engines, args.worker)
        return
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, (engine, algo, env) in STREAMS.items():
        run_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | env
        done = subprocess.run([sys.executable, __file__, "--engines", str(args.engines),
                               "--worker", name], env=run_env, check=True,
                              capture_output=True, text=True)
        messages = json.loads(done.stdout)
        version = _version(args.engines, engine)
        header = {"format": "kvctl.kv-events", "version": 1,
                  "profile": "sglang" if engine == "sglang" else f"vllm:{algo}",
                  "block_size": 16,
                  "source": f"{engine} {version} ZmqEventPublisher (scripts/record_kv_events)",
                  "environment": env}
        lines = [json.dumps(header)]
        for i, (seq, topic, payload) in enumerate(messages):
            lines.append(json.dumps({"instance": name, "recv_ts": T0 + 0.001 * i, "seq": seq,
                                     "replayed": False, "topic": topic, "payload": payload}))
        (OUT_DIR / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{name}: {len(messages)} messages from {engine} {version}", file=sys.stderr)
    _ = time


if __name__ == "__main__":
    main()
