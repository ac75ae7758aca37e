#!/usr/bin/env python3
"""Record block-key test vectors by running each engine's OWN hashing code.

Not run by CI. Run once by hand (see README.md next to this file); it writes
``tests/keys/vectors/{vllm,lmcache,sglang}.json``. This script never imports kvctl: the
vectors must come from the engines, so that kvctl's profiles are checked against them and
not against themselves.

The engines' wheels are downloaded with ``pip download --no-deps`` and unzipped under
``--engines DIR`` (``DIR/vllm/vllm/...``, ``DIR/lmcache/lmcache/...``,
``DIR/sglang/sglang/...``). Only the files that hold the hashing code are executed; every
other import (torch, transformers, the rest of the engine) is replaced by inert stubs
(:class:`_StubFinder`), so the functions that run are the engines' real ones:

- vLLM: ``vllm/utils/hashing.py`` (sha256, sha256_cbor, xxhash) and
  ``vllm/v1/core/kv_cache_utils.py`` (``init_none_hash``, ``hash_block_tokens``,
  ``get_request_block_hasher`` with a minimal request object carrying LoRA and cache_salt),
  and ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/data.py``
  (``KeyMetadata``/``PoolKey``: the key strings vLLM's Mooncake store connector writes).
- LMCache: ``lmcache/utils.py`` (``CacheEngineKey.to_string``) and
  ``lmcache/v1/token_database.py`` (``ChunkedTokenDatabase.process_tokens``), with the vLLM
  modules above importable (as in a vLLM deployment, where LMCache takes NONE_HASH from vLLM).
- SGLang: ``sglang/srt/mem_cache/cpp_utils/hash_binding.cpp`` compiled with g++ and pybind11
  exactly as SGLang's loader would (-O3 -std=c++17 -lcrypto), called through SGLang's own
  ``native_hash.py`` and ``mem_cache/utils.py`` (``get_hash_str``,
  ``get_storage_hash_str``), and ``mem_cache/storage/mooncake_store/mooncake_store.py``
  (``MooncakeStore._tag_keys`` and ``_get_mha_buffer_meta`` for the Mooncake key strings).

PYTHONHASHSEED is read by the engines at run time (and, for LMCache's default builtin hash,
by the interpreter at start-up), so each seed value runs in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import array
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "keys" / "vectors"

# ---------------------------------------------------------------------------- prompts


def _lcg_tokens(n: int, seed: int, vocab: int = 151_936) -> list[int]:
    out, x = [], seed
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % vocab)
    return out


def _lcg_bytes(n: int, seed: int) -> bytes:
    return bytes(t & 0xFF for t in _lcg_tokens(n, seed, vocab=1 << 30))


EMBED_HIDDEN = 8  # bfloat16 rows of 8 values: 16 bytes per token

PROMPTS: list[dict[str, Any]] = [
    {"id": "short", "tokens": list(range(1, 41))},
    {"id": "long", "tokens": _lcg_tokens(600, 7)},
    {"id": "lora", "tokens": _lcg_tokens(70, 11),
     "lora": {"name": "sql-lora", "path": "/adapters/sql-lora", "id": "sql-lora"}},
    {"id": "salted", "tokens": _lcg_tokens(70, 11), "cache_salt": "tenant-a"},
    {"id": "partial", "tokens": _lcg_tokens(15, 3)},
    {"id": "big-ids", "tokens": [0, 1, 2**31, 2**32 - 1] * 8},
    # --- added with the engine features (kvctl issue 18)
    # A LoRA by name and path only: SGLang derives its lora_id as for --lora-paths adapters.
    {"id": "lora-by-path", "tokens": _lcg_tokens(70, 11),
     "lora": {"name": "sql-lora", "path": "/adapters/sql-lora"}},
    # vLLM 0.10.2-0.11.0 key a LoRA by its lora_int_id (given as "id").
    {"id": "lora-int", "tokens": _lcg_tokens(70, 11),
     "lora": {"name": "sql-lora", "path": "/adapters/sql-lora", "id": "3"}},
    # An empty salt and an empty extra key are no namespace in SGLang, nothing in vLLM.
    {"id": "salt-empty", "tokens": _lcg_tokens(70, 11), "cache_salt": "", "extra_key": ""},
    # Ids past uint32 (SGLang hashes such pages wide; vLLM and LMCache hash Python ints).
    {"id": "wide-ids", "tokens": list(range(1, 17)) + [2**33 + i for i in range(16)]
     + [2**63 - 1] * 16 + list(range(16))},
    # Two images: the first spans blocks 0-1, the second blocks 1-3 (at block size 16).
    {"id": "mm", "tokens": _lcg_tokens(80, 5),
     "mm": [{"identifier": "img-a-hash", "offset": 5, "length": 20},
            {"identifier": "img-b-hash", "offset": 30, "length": 34}]},
    # Every extra key at once: their order in a block's extra_keys is LoRA, mm, salt.
    {"id": "mm-lora-salt", "tokens": _lcg_tokens(48, 9),
     "lora": {"name": "sql-lora", "path": "/adapters/sql-lora", "id": "3"},
     "cache_salt": "tenant-b", "mm": [{"identifier": "img-c-hash", "offset": 0, "length": 8}]},
    # Prompt embeddings (all-zero token ids, as vLLM holds for an embeddings-only prompt).
    {"id": "embeds", "tokens": [0] * 40,
     "prompt_embeds": {"dtype": "bfloat16", "hidden_size": EMBED_HIDDEN,
                       "hex": _lcg_bytes(40 * EMBED_HIDDEN * 2, 13).hex()}},
    # LMCache request tags, as sent in kv_transfer_params (other entries do not enter keys).
    {"id": "tagged", "tokens": _lcg_tokens(600, 7),
     "kv_transfer_params": {"lmcache.tag.user": "alice", "lmcache.skip_save": False,
                            "lmcache.tag.tier": 2, "do_remote_prefill": True}},
]

# ---------------------------------------------------------------------------- stubs


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _Stub(metaclass=_StubMeta):
    """Stands in for anything an engine module imports but the hashing path never uses."""

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

    def __bool__(self) -> bool:
        return False


# Names the real packages do not define: lookups of them must fail as they would there
# (LMCache probes ``vllm.utils`` for hash functions and falls back to ``hash``).
_MISSING = {"vllm.utils.get_hash_fn_by_name", "vllm.utils.builtin"}
#: Packages that must not import at all (``vllm`` when LMCache runs without vLLM).
_MISSING_PREFIXES: set[str] = set()
_REAL: set[str] = set()


class _AbsentFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if any(fullname == p or fullname.startswith(p + ".") for p in _MISSING_PREFIXES):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or f"{self.__name__}.{name}" in _MISSING or any(
                self.__name__ == p or self.__name__.startswith(p + ".")
                for p in _MISSING_PREFIXES):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in _REAL:  # ``from pkg import real_submodule``
            return importlib.import_module(f"{self.__name__}.{name}")
        value = _StubMeta(name, (_Stub,), {})
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so submodules resolve too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    """Real files for the names in ``real``; stubs for everything under ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...], real: dict[str, Path]) -> None:
        self.prefixes = prefixes
        self.real = real

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in _MISSING:
            return None
        if fullname in self.real:
            file = self.real[fullname]
            is_pkg = file.name == "__init__.py"
            return importlib.util.spec_from_file_location(
                fullname, file,
                submodule_search_locations=[str(file.parent)] if is_pkg else None,
            )
        if self.prefixes == ("*",) and fullname.partition(".")[0] in sys.stdlib_module_names:
            return None  # a platform probe (_winapi, ...) must fail as it does here
        if self.prefixes == ("*",) or any(
            fullname == p or fullname.startswith(p + ".") for p in self.prefixes
        ):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def _install(engines: Path, *, vllm_dir: Path | None = None, vllm: str = "present") -> None:
    """Make the engines' hashing files importable, everything else inert.

    ``vllm_dir``: another vLLM release's files (an older-era recording); ``vllm="absent"``:
    no vLLM module can be imported at all (LMCache outside vLLM).
    """
    v = vllm_dir or engines / "vllm"
    lm = engines / "lmcache"
    sg = engines / "sglang"
    mooncake = "distributed/kv_transfer/kv_connector/v1/mooncake/store"
    real = {
        "vllm.v1.core.kv_cache_utils": v / "vllm/v1/core/kv_cache_utils.py",
        f"vllm.{mooncake.replace('/', '.')}.data": v / f"vllm/{mooncake}/data.py",
        f"vllm.{mooncake.replace('/', '.')}.worker": v / f"vllm/{mooncake}/worker.py",
        "lmcache.utils": lm / "lmcache/utils.py",
        "lmcache.v1.token_database": lm / "lmcache/v1/token_database.py",
        "lmcache.integration.vllm.utils": lm / "lmcache/integration/vllm/utils.py",
        "sglang.srt.mem_cache.cpp_utils.native_hash":
            sg / "sglang/srt/mem_cache/cpp_utils/native_hash.py",
        "sglang.srt.mem_cache.utils": sg / "sglang/srt/mem_cache/utils.py",
        "sglang.srt.mem_cache.radix_cache": sg / "sglang/srt/mem_cache/radix_cache.py",
        "sglang.srt.managers.io_struct": sg / "sglang/srt/managers/io_struct.py",
        "sglang.srt.managers.schedule_batch": sg / "sglang/srt/managers/schedule_batch.py",
        "sglang.srt.lora.lora_registry": sg / "sglang/srt/lora/lora_registry.py",
        "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store":
            sg / "sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py",
    }
    if (v / "vllm/utils/hashing.py").exists():
        real["vllm.utils.hashing"] = v / "vllm/utils/hashing.py"
    else:  # 0.10.2-0.11.0: the hash functions are in vllm/utils/__init__.py
        real["vllm.utils"] = v / "vllm/utils/__init__.py"
    real = {name: path for name, path in real.items() if path.exists()}
    prefixes = ("vllm", "lmcache", "sglang", "torch", "transformers", "numpy", "triton",
                "regex", "mooncake", "nvtx", "prometheus_client", "zmq",
                "sgl_kernel", "psutil", "requests", "aiohttp", "pydantic", "safetensors")
    if vllm == "absent":
        real = {n: f for n, f in real.items() if not n.startswith("vllm")}
        _MISSING_PREFIXES.add("vllm")
    _REAL.update(real)
    # nvtx.annotate(...) decorates LMCache's process_tokens: it must hand the function back.
    nvtx = types.ModuleType("nvtx")
    nvtx.annotate = lambda *_a, **_kw: (lambda func: func)  # type: ignore[attr-defined]
    sys.modules["nvtx"] = nvtx
    sys.meta_path.insert(0, _StubFinder(prefixes, real))
    sys.meta_path.insert(0, _AbsentFinder())
    # Any other third-party import the engine files make (cachetools, ...) becomes a stub.
    sys.meta_path.append(_StubFinder(("*",), {}))


def _engine_versions(engines: Path) -> dict[str, str]:
    versions = {}
    for name in ("vllm", "lmcache", "sglang"):
        metas = sorted((engines / name).glob(f"{name}-*.dist-info/METADATA"))
        for line in metas[0].read_text().splitlines() if metas else []:
            if line.startswith("Version: "):
                versions[name] = line.split(": ", 1)[1]
    return versions


# ---------------------------------------------------------------------------- vLLM


class _Lora:
    def __init__(self, name: str, path: str, int_id: int) -> None:
        self.lora_name = name
        self.lora_path = path
        self.lora_int_id = int_id


class _Embeds:
    """A 2-D row-major tensor of raw bytes: what the hasher slices and reads back."""

    def __init__(self, data: bytes, row_bytes: int) -> None:
        self.data = data
        self.row_bytes = row_bytes

    def __getitem__(self, rows: slice) -> _Embeds:
        return _Embeds(self.data[rows.start * self.row_bytes : rows.stop * self.row_bytes],
                       self.row_bytes)


def _tensor_data(tensor: _Embeds) -> memoryview:
    """vllm.v1.utils.tensor_data: ``tensor.flatten().cpu().contiguous().view(torch.uint8)
    .numpy().data``, i.e. the tensor's bytes in row-major order."""
    return memoryview(tensor.data)


def _embeds(prompt: dict[str, Any]) -> _Embeds | None:
    spec = prompt.get("prompt_embeds")
    if spec is None:
        return None
    return _Embeds(bytes.fromhex(spec["hex"]), spec["hidden_size"] * 2)  # bfloat16


class _Request:
    """The fields of vllm.v1.request.Request that the block hasher reads (every release
    recorded: 0.10.2 reads mm_positions/mm_hashes, later ones mm_features)."""

    def __init__(self, prompt: dict[str, Any]) -> None:
        self.all_token_ids = list(prompt["tokens"])
        self.num_tokens = len(self.all_token_ids)
        self.block_hashes: list[bytes] = []
        items = prompt.get("mm", [])
        self.mm_features = [
            types.SimpleNamespace(
                identifier=m["identifier"], mm_hash=m["identifier"], modality="image",
                mm_position=types.SimpleNamespace(offset=m["offset"], length=m["length"]))
            for m in items]
        self.mm_positions = [f.mm_position for f in self.mm_features]
        self.mm_hashes = [m["identifier"] for m in items]
        lora = prompt.get("lora")
        self.lora_request = (_Lora(lora["name"], lora["path"],
                                   int(lora["id"]) if lora.get("id", "").isdigit() else 1)
                             if lora else None)
        self.cache_salt = prompt.get("cache_salt")
        self.prompt_embeds = _embeds(prompt)
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}


#: vLLM Mooncake store settings recorded, through the connector's own rank rules.
#: (tp_size, tp_rank, num_kv_heads, mla, pp_rank, cache_prefix)
MOONCAKE_RANKS = [(8, 5, 2, False, 0, ""), (4, 3, 8, False, 0, ""), (8, 5, 8, True, 0, ""),
                  (2, 1, 2, False, 1, "prod")]


def _vllm_mooncake_rank(worker: Any, tp_size: int, tp_rank: int, num_kv_heads: int,
                        mla: bool) -> int:
    """The TP rank MooncakeStoreWorker._build_token_databases writes into KeyMetadata."""
    from vllm.v1 import kv_cache_interface as kci

    spec = kci.MLAAttentionSpec() if mla else kci.FullAttentionSpec()
    spec.prefix_cacheable = True
    spec.block_size = 16
    fake = types.SimpleNamespace(
        dcp_size=1, tp_size=tp_size, tp_rank=tp_rank, num_kv_head=num_kv_heads,
        hash_block_size=16, store_tp_size=None,
        _kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)])
    cls = worker.MooncakeStoreWorker
    fake._spec_tp_replication_factor = lambda s: cls._spec_tp_replication_factor(fake, s)
    fake._group_tp_replication_factors = cls._compute_group_tp_replication_factors(fake)
    worker.ChunkedTokenDatabase = lambda metadata, *_a, **_kw: metadata
    base = worker.KeyMetadata(model_name="x", tp_rank=tp_rank, pcp_rank=0, dcp_rank=0,
                              pp_rank=0)
    (metadata,) = cls._build_token_databases(fake, base, None)
    return int(metadata.tp_rank)


def _vllm_worker() -> dict[str, Any]:
    import vllm.v1.utils as v1_utils  # a stub module: tensor_data is shimmed

    v1_utils.tensor_data = _tensor_data
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as mdata
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker
    from vllm.utils import hashing

    cases = []
    for hash_name in ("sha256", "sha256_cbor", "xxhash"):
        if hash_name == "xxhash" and os.getenv("PYTHONHASHSEED") is None:
            continue  # vLLM draws a random per-process NONE_HASH seed here: nothing to pin
        fn = hashing.get_hash_fn_by_name(hash_name)
        kcu.init_none_hash(fn)
        for block_size in (16, 32):
            hasher = kcu.get_request_block_hasher(block_size, fn)
            for prompt in PROMPTS:
                keys = hasher(_Request(prompt))
                pool = [
                    mdata.PoolKey(
                        mdata.KeyMetadata(model_name="Qwen3-8B", tp_rank=1, pcp_rank=0,
                                          dcp_rank=0, pp_rank=0),
                        k.hex(),
                    ).to_string()
                    for k in keys
                ]
                cases.append({
                    "profile": f"vllm:{hash_name}",
                    "block_size": block_size,
                    "prompt": prompt["id"],
                    "none_hash_seed": kcu.get_none_hash_seed(),
                    "keys": [k.hex() for k in keys],
                    "mooncake": {"model": "Qwen/Qwen3-8B", "tp_rank": 1, "keys": pool},
                })
    ranks = []
    if os.getenv("PYTHONHASHSEED") == "0":
        fn = hashing.get_hash_fn_by_name("sha256_cbor")
        kcu.init_none_hash(fn)
        keys = kcu.get_request_block_hasher(16, fn)(_Request(PROMPTS[0]))
        for tp_size, tp_rank, heads, mla, pp_rank, prefix in MOONCAKE_RANKS:
            rank = _vllm_mooncake_rank(worker, tp_size, tp_rank, heads, mla)
            meta = mdata.KeyMetadata(model_name="Qwen3-8B", tp_rank=rank, pcp_rank=0,
                                     dcp_rank=0, pp_rank=pp_rank, cache_prefix=prefix)
            ranks.append({
                "profile": "vllm:sha256_cbor", "block_size": 16, "prompt": PROMPTS[0]["id"],
                "model": "Qwen/Qwen3-8B", "tp_size": tp_size, "tp_rank": tp_rank,
                "num_kv_heads": heads, "mla": mla, "pp_rank": pp_rank, "cache_prefix": prefix,
                "key_tp_rank": rank,
                "keys": [mdata.PoolKey(meta, k.hex()).to_string() for k in keys]})
    return {"cases": cases, "mooncake_ranks": ranks}


#: vLLM releases recorded for the older profile families: first and last of each era.
ERA_RELEASES = {"vllm-0.10.2": ("0.10.2", "0.11.0"), "vllm-0.11.1": ("0.11.1", "0.12.0"),
                "vllm-0.13": ("0.13.0", "0.16.0"), "vllm-0.17": ("0.17.0", "0.18.1"),
                "vllm-0.19": ("0.19.0", "0.28.0"), "vllm-0.29": ("0.29.0", "0.30.0"),
                "vllm": ("0.31.0", "0.33.0")}
ERA_PROMPTS = ("short", "lora-int", "salted", "salt-empty", "mm", "mm-lora-salt", "embeds")


def _vllm_era_worker() -> dict[str, Any]:
    """One older vLLM release (its files installed as the vllm package)."""
    import vllm.v1.utils as v1_utils

    v1_utils.tensor_data = _tensor_data
    import vllm.v1.core.kv_cache_utils as kcu

    if "vllm.utils.hashing" in _REAL:
        from vllm.utils.hashing import get_hash_fn_by_name
    else:  # 0.10.2-0.11.0: the hash functions live in vllm/utils/__init__.py
        from vllm.utils import get_hash_fn_by_name
    cases = []
    for hash_name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        try:
            fn = get_hash_fn_by_name(hash_name)
        except ValueError:
            continue  # not offered by this release
        kcu.init_none_hash(fn)
        if os.getenv("PYTHONHASHSEED") is None and (
                not hasattr(kcu, "DEFAULT_NONE_HASH_SEED") or hash_name.startswith("xxhash")):
            continue  # a random NONE_HASH per process: nothing to pin
        hasher = kcu.get_request_block_hasher(16, fn)
        for prompt in PROMPTS:
            if prompt["id"] in ERA_PROMPTS:
                cases.append({"algo": hash_name, "block_size": 16, "prompt": prompt["id"],
                              "keys": [k.hex() for k in hasher(_Request(prompt))]})
    return {"cases": cases}


# ---------------------------------------------------------------------------- LMCache


def _lmcache_case(tdb: Any, algorithm: str, model: str, world_size: int, worker_id: int,
                  chunk_size: int, *, unfull: bool = False, mla: bool = False,
                  layer: int | None = None, host: str = "vllm") -> list[dict[str, Any]]:
    import torch  # the stub module: dtype sentinels only
    from lmcache.integration.vllm import utils as lm_vllm_utils

    config = types.SimpleNamespace(
        pre_caching_hash_algorithm=algorithm, chunk_size=chunk_size,
        save_unfull_chunk=unfull, remote_url=None, enable_pd=False,
        get_extra_config_value=lambda _key, default: default,
    )
    metadata = types.SimpleNamespace(
        model_name=model, world_size=world_size, worker_id=worker_id,
        kv_dtype=torch.bfloat16, use_mla=mla,
    )
    db = tdb.ChunkedTokenDatabase(config, metadata)
    cases = []
    for prompt in PROMPTS:
        params = prompt.get("kv_transfer_params")
        request_configs = (None if params is None else
                           lm_vllm_utils.extract_request_configs_from_sampling_params(
                               types.SimpleNamespace(extra_args={"kv_transfer_params": params})))
        keys = [key for _s, _e, key in db.process_tokens(tokens=prompt["tokens"],
                                                         request_configs=request_configs)]
        if layer is not None:
            keys = [key.split_layers(layer + 1)[layer] for key in keys]
        case = {
            "profile": "lmcache" if algorithm == "builtin" else f"lmcache:{algorithm}",
            "block_size": chunk_size,
            "model": model, "world_size": world_size, "worker_id": worker_id,
            "kv_dtype": "bfloat16",
            "prompt": prompt["id"],
            "none_hash": tdb.NONE_HASH,
            "keys": [key.to_string() for key in keys],
        }
        options = {name: value for name, value, default in (
            ("save_unfull_chunk", unfull, False), ("mla", mla, False),
            ("layer_id", layer, None), ("lmcache_host", host, "vllm")) if value != default}
        if options:
            case["options"] = options
        cases.append(case)
    return cases


def _lmcache_worker(host: str) -> dict[str, Any]:
    if host == "vllm":
        import vllm.v1.core.kv_cache_utils  # noqa: F401 - LMCache takes NONE_HASH from vLLM
    from lmcache.v1 import token_database as tdb

    cases = []
    settings = (("Qwen/Qwen3-8B", 1, 0, 256), ("meta-llama/Llama-3.1-8B", 2, 1, 256),
                ("Qwen/Qwen3-8B", 1, 0, 16))
    seed = os.getenv("PYTHONHASHSEED")
    algorithms = ("builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
    if host == "none":
        algorithms = ("builtin", "sha256_cbor")
    if seed not in (None, "0", "42"):  # the strtoul spellings: one setting, two hashes
        algorithms, settings = ("builtin", "sha256_cbor"), settings[:1]
    for algorithm in algorithms:
        if algorithm.startswith("xxhash") and seed is None:
            continue  # vLLM draws a random NONE_HASH for xxhash*: nothing to pin
        if algorithm == "builtin" and host == "vllm" and seed == "random":
            continue  # hash("random") under a random interpreter secret: nothing to pin
        for model, world_size, worker_id, chunk_size in settings:
            cases += _lmcache_case(tdb, algorithm, model, world_size, worker_id, chunk_size,
                                   host=host)
    if seed not in (None, "0", "42"):
        return {"cases": cases}
    first = algorithms[0] if host == "vllm" else "sha256_cbor"
    cases += _lmcache_case(tdb, first, "Qwen/Qwen3-8B", 1, 0, 16, unfull=True, host=host)
    cases += _lmcache_case(tdb, first, "deepseek-ai/DeepSeek-V3", 8, 3, 256, mla=True,
                           host=host)
    cases += _lmcache_case(tdb, first, "Qwen/Qwen3-8B", 2, 1, 256, layer=5, host=host)
    return {"cases": cases}


# ---------------------------------------------------------------------------- SGLang


def _build_sglang_ext(engines: Path, build: Path) -> Path:
    src = engines / "sglang/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp"
    build.mkdir(parents=True, exist_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = build / f"hicache_hash_cpp{suffix}"
    if not out.exists():
        import pybind11  # pip install --target DIR pybind11; put DIR on PYTHONPATH

        cmd = ["g++", "-O3", "-std=c++17", "-DNDEBUG", "-shared", "-fPIC",
               "-DTORCH_EXTENSION_NAME=hicache_hash_cpp", "-w",
               f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
               str(src), "-o", str(out), "-lcrypto"]
        subprocess.run(cmd, check=True)
    return out


class _HostPool:
    def __init__(self, buffers_per_page: int = 2) -> None:
        self.per_page = buffers_per_page

    def get_page_buffer_meta(self, indices: list[int]) -> tuple[list[int], list[int]]:
        return [0] * (self.per_page * len(indices)), [0] * (self.per_page * len(indices))


#: SGLang Mooncake store layouts recorded: (name, is_mla, tp_rank, pp_rank, pp_size).
#: mha_suffix/mla_suffix are set in MooncakeStore.__init__ (constructor logic, pinned by
#: hand from mooncake_store.py): MHA "tp" or "tp_pp" with PP; MLA "" or "pp" with PP.
#: Prompts recorded at SGLang's default page size of 1 (CUDA/HIP).
PAGE_ONE_PROMPTS = ("short", "wide-ids", "salt-empty", "lora-by-path", "salted")
SGLANG_LAYOUTS = [("mha-pp", False, 1, 1, 2), ("mla", True, 3, 0, 1), ("mla-pp", True, 3, 1, 2)]

#: SGLang storage namespaces (kvctl issue 26): every combination of an absent (None), empty
#: and non-empty extra_key and cache_salt, without and with a --lora-paths adapter, taken
#: through each way a value reaches the scheduler's Req: "single" and "batch" are
#: GenerateReqInput.normalize_batch_and_arguments (HTTP, OpenAI, Engine and gRPC-bridge
#: requests all pass it), "req" hands the value to Req unnormalized (what the hash does
#: with a value that skipped io_struct).
NAMESPACE_TOKENS = _lcg_tokens(40, 21)
NAMESPACE_EXTRA_KEYS = (None, "", "team-a")
NAMESPACE_SALTS = (None, "", "tenant-a")
NAMESPACE_LORAS: tuple[dict[str, str] | None, ...] = (
    None, {"name": "sql-lora", "path": "/adapters/sql-lora"})
NAMESPACE_INGRESS = ("single", "batch", "req")
NAMESPACE_PAGE_SIZE = 16


def _sglang_req(io_struct: Any, schedule_batch: Any, lora_registry: Any, tokens: list[int],
                extra_key: str | None, cache_salt: str | None, lora: dict[str, str] | None,
                ingress: str) -> Any:
    """A scheduler ``Req`` for one request, built by SGLang's own code.

    ``GenerateReqInput.normalize_batch_and_arguments`` (io_struct.py) is what
    ``TokenizerManager.generate_request`` runs first; the tokenizer manager then copies
    ``extra_key``/``cache_salt`` into ``TokenizedGenerateReqInput`` unchanged and sets
    ``lora_id`` from its registry (for a ``--lora-paths`` adapter,
    ``LoRARef.deterministic_id``; an explicit ``id`` stands for a runtime adapter's);
    the scheduler builds ``Req`` from those (schedule_batch.py ``Req.__init__``).
    """
    lora_id = None
    if lora:
        lora_id = lora.get("id") or lora_registry.LoRARef.deterministic_id(lora["name"],
                                                                        lora["path"])
    if ingress == "req":
        ek, salt = extra_key, cache_salt
    else:
        batch = ingress == "batch"

        def wrap(value: Any) -> Any:
            return [value] if batch and value is not None else value

        obj = io_struct.GenerateReqInput(
            input_ids=[tokens] if batch else tokens, extra_key=wrap(extra_key),
            cache_salt=wrap(cache_salt), lora_path=wrap(lora["name"]) if lora else None)
        obj.normalize_batch_and_arguments()
        sub = obj[0] if batch else obj
        ek, salt = sub.extra_key, sub.cache_salt
    sampling = types.SimpleNamespace(custom_params=None)
    return schedule_batch.Req("rid", "", array.array("q", tokens), sampling,
                              lora_id=lora_id, extra_key=ek, cache_salt=salt)


def _sglang_namespace_cases(io_struct: Any, schedule_batch: Any, lora_registry: Any,
                            radix_cache: Any, mcu: Any) -> list[dict[str, Any]]:
    cases = []
    size = NAMESPACE_PAGE_SIZE
    full = len(NAMESPACE_TOKENS) // size * size
    for ingress in NAMESPACE_INGRESS:
        for lora in NAMESPACE_LORAS:
            for extra_key in NAMESPACE_EXTRA_KEYS:
                for salt in NAMESPACE_SALTS:
                    req = _sglang_req(io_struct, schedule_batch, lora_registry,
                                      NAMESPACE_TOKENS, extra_key, salt, lora, ingress)
                    # RadixCache.cache_unfinished_req/_insert_key: the tree node's key.
                    key = radix_cache.RadixKey(array.array("q", NAMESPACE_TOKENS[:full]),
                                               req.extra_key, cache_salt=req.cache_salt)
                    cases.append({
                        "ingress": ingress, "block_size": size,
                        "extra_key": extra_key, "cache_salt": salt, "lora": lora,
                        "req_extra_key": req.extra_key, "req_cache_salt": req.cache_salt,
                        "namespace_seed": mcu.storage_namespace_seed(key.extra_key,
                                                                     key.cache_salt),
                        "keys": list(mcu.get_storage_hash_str(key, None, page_size=size)),
                    })
    return cases


def _sglang_worker(engines: Path, build: Path) -> dict[str, Any]:
    ext_path = _build_sglang_ext(engines, build)
    spec = importlib.util.spec_from_file_location("hicache_hash_cpp", ext_path)
    assert spec is not None
    assert spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    import sglang.srt.utils.cpp_extension_loader as loader  # a stub module

    loader.load_extension_with_recovery = lambda **_kw: ext
    from sglang.srt.lora import lora_registry
    from sglang.srt.managers import io_struct, schedule_batch
    from sglang.srt.mem_cache import radix_cache
    from sglang.srt.mem_cache import utils as mcu
    from sglang.srt.mem_cache.storage.mooncake_store import mooncake_store as ms

    cases = []
    layouts = []
    for page_size in (1, 16, 64):
        for prompt in PROMPTS:
            if page_size == 1 and prompt["id"] not in PAGE_ONE_PROMPTS:
                continue  # a key per token: a few prompts show it
            tokens = prompt["tokens"]
            full = len(tokens) // page_size * page_size
            # The request as SGLang's io_struct and Req.__init__ make it (a single
            # request; a LoRA without an id stands for a --lora-paths adapter).
            req = _sglang_req(io_struct, schedule_batch, lora_registry, tokens,
                              prompt.get("extra_key"), prompt.get("cache_salt"),
                              prompt.get("lora"), "single")
            extra_key = req.extra_key
            salt = prompt.get("cache_salt")
            key = radix_cache.RadixKey(array.array("q", tokens[:full]), extra_key=extra_key,
                                       cache_salt=req.cache_salt)
            hashes = mcu.get_storage_hash_str(key, None, page_size=page_size) if full else []
            plain = mcu.get_hash_str(tokens[:full], None, page_size=page_size) if full else []
            fake = types.SimpleNamespace(config_prefix="prod_Qwen-Qwen3-8B", mha_suffix="1",
                                         mem_pool_host=_HostPool())
            tagged = ms.MooncakeStore._tag_keys(fake, list(hashes))
            mooncake, _p, _s = ms.MooncakeStore._get_mha_buffer_meta(
                fake, tagged, list(range(len(tagged))))
            cases.append({
                "profile": "sglang",
                "block_size": page_size,
                "prompt": prompt["id"],
                "extra_key": extra_key,
                "cache_salt": salt,
                "keys": list(hashes),
                "unnamespaced_keys": list(plain),
                "mooncake": {"backend_tag": "prod", "model": "Qwen/Qwen3-8B", "tp_rank": 1,
                             "keys": mooncake},
            })
            if page_size == 16 and prompt["id"] == "short":
                for name, mla, tp_rank, pp_rank, pp_size in SGLANG_LAYOUTS:
                    pp = pp_size > 1
                    store = types.SimpleNamespace(
                        config_prefix="prod_Qwen-Qwen3-8B",
                        mha_suffix=f"{tp_rank}_{pp_rank}" if pp else f"{tp_rank}",
                        mla_suffix=f"{pp_rank}" if pp else "",
                        mem_pool_host=_HostPool(1 if mla else 2),
                        _pack_multi_buffer_meta=ms.MooncakeStore._pack_multi_buffer_meta)
                    meta = (ms.MooncakeStore._get_mla_buffer_meta if mla
                            else ms.MooncakeStore._get_mha_buffer_meta)
                    object_keys, _p, _s = meta(store, ms.MooncakeStore._tag_keys(
                        store, list(hashes)), list(range(len(hashes))))
                    layouts.append({"layout": name, "mla": mla, "tp_rank": tp_rank,
                                    "pp_rank": pp_rank, "pp_size": pp_size,
                                    "prompt": prompt["id"], "block_size": page_size,
                                    "backend_tag": "prod", "model": "Qwen/Qwen3-8B",
                                    "keys": object_keys})
    namespaces = _sglang_namespace_cases(io_struct, schedule_batch, lora_registry,
                                         radix_cache, mcu)
    return {"cases": cases, "mooncake_layouts": layouts, "namespace_cases": namespaces}


# ---------------------------------------------------------------------------- driver


def _run_worker(engine: str, engines: Path, build: Path, hashseed: str | None,
                *extra: str) -> Any:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    cmd = [sys.executable, __file__, "--engines", str(engines), "--build", str(build),
           "--worker", engine, *extra]
    done = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"worker {engine} {extra} failed")
    return json.loads(done.stdout)


def _doc(engine: str, version: str, runs: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {
        "engine": engine,
        "engine_version": version,
        "recorded_with": f"CPython {sys.version.split()[0]}",
        "recorded_by": "scripts/record_key_vectors/record.py (engine's own code)",
        **more,
        "prompts": PROMPTS,
        "runs": runs,
    }


def _write(name: str, doc: dict[str, Any]) -> None:
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    sys.stderr.write(f"wrote {path} ({sum(len(r['cases']) for r in doc['runs'])} cases)\n")


def _record_sglang(engines: Path, build: Path, versions: dict[str, str]) -> None:
    body = _run_worker("sglang", engines, build, None)
    _write("sglang", _doc("sglang", versions.get("sglang", "unknown"),
                          [{"pythonhashseed": None, "cases": body["cases"]}],
                          mooncake_layouts=body["mooncake_layouts"],
                          namespace_tokens=NAMESPACE_TOKENS,
                          namespace_cases=body["namespace_cases"]))
    sys.stderr.write(f"  + {len(body['namespace_cases'])} namespace cases\n")


#: PYTHONHASHSEED values: unset, plain, and texts CPython reads by strtoul rules ('+7' and
#: ' 007' are seed 7, '-0' is 0; '' and 'random' are a random secret, but vLLM hashes the
#: text itself).
LMCACHE_SEEDS = ("0", "42", "+7", " 007", "-0", "", "random")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--old-vllm", type=Path,
                        help="DIR/<release>/vllm/...: older vLLM releases' files (the eras)")
    parser.add_argument("--build", type=Path, default=Path("/tmp/kvkeys_build"))
    parser.add_argument("--worker", choices=("vllm", "vllm-era", "lmcache", "sglang"))
    parser.add_argument("--vllm-dir", type=Path)
    parser.add_argument("--lmcache-host", choices=("vllm", "none"), default="vllm")
    parser.add_argument("--only", choices=("vllm", "lmcache", "sglang"),
                        help="record this engine's file only (only its wheel is needed)")
    args = parser.parse_args()
    engines = args.engines.resolve()

    if args.worker:
        _install(engines, vllm_dir=args.vllm_dir,
                 vllm="absent" if args.lmcache_host == "none" else "present")
        import logging

        logging.disable(logging.CRITICAL)
        if args.worker == "vllm":
            result = _vllm_worker()
        elif args.worker == "vllm-era":
            result = _vllm_era_worker()
        elif args.worker == "lmcache":
            result = _lmcache_worker(args.lmcache_host)
        else:
            result = _sglang_worker(engines, args.build)
        sys.stdout.write(json.dumps(result))
        return

    versions = _engine_versions(engines)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.only == "sglang":
        _record_sglang(engines, args.build, versions)
        return
    runs = []
    ranks: list[Any] = []
    for seed in (None, "0", "12345"):
        body = _run_worker("vllm", engines, args.build, seed)
        runs.append({"pythonhashseed": seed, "cases": body["cases"]})
        ranks += body["mooncake_ranks"]
    _write("vllm", _doc("vllm", versions.get("vllm", "unknown"), runs, mooncake_ranks=ranks))
    if args.only == "vllm":
        return

    runs = []
    for seed in LMCACHE_SEEDS:
        body = _run_worker("lmcache", engines, args.build, seed)
        runs.append({"pythonhashseed": seed, "lmcache_host": "vllm", "cases": body["cases"]})
    for seed in (None, "42"):
        body = _run_worker("lmcache", engines, args.build, seed, "--lmcache-host", "none")
        runs.append({"pythonhashseed": seed, "lmcache_host": "none", "cases": body["cases"]})
    _write("lmcache", _doc("lmcache", versions.get("lmcache", "unknown"), runs,
                           vllm_version=versions.get("vllm", "unknown")))
    if args.only == "lmcache":
        return

    _record_sglang(engines, args.build, versions)

    if args.old_vllm is None:
        return
    runs = []
    for family, releases in ERA_RELEASES.items():
        for release in releases:
            vllm_dir = (engines / "vllm" if release == versions.get("vllm")
                        else args.old_vllm.resolve() / release)
            for seed in (None, "0"):
                body = _run_worker("vllm-era", engines, args.build, seed,
                                   "--vllm-dir", str(vllm_dir))
                runs.append({"family": family, "release": release, "pythonhashseed": seed,
                             "cases": body["cases"]})
    _write("vllm_eras", _doc("vllm", "several", runs,
                             releases={f: list(r) for f, r in ERA_RELEASES.items()}))


if __name__ == "__main__":
    main()
