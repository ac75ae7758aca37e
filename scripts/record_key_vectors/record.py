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


PROMPTS: list[dict[str, Any]] = [
    {"id": "short", "tokens": list(range(1, 41))},
    {"id": "long", "tokens": _lcg_tokens(600, 7)},
    {"id": "lora", "tokens": _lcg_tokens(70, 11),
     "lora": {"name": "sql-lora", "path": "/adapters/sql-lora", "id": "sql-lora"}},
    {"id": "salted", "tokens": _lcg_tokens(70, 11), "cache_salt": "tenant-a"},
    {"id": "partial", "tokens": _lcg_tokens(15, 3)},
    {"id": "big-ids", "tokens": [0, 1, 2**31, 2**32 - 1] * 8},
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
_REAL: set[str] = set()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or f"{self.__name__}.{name}" in _MISSING:
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
        if self.prefixes == ("*",) or any(
            fullname == p or fullname.startswith(p + ".") for p in self.prefixes
        ):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def _install(engines: Path) -> None:
    v = engines / "vllm"
    lm = engines / "lmcache"
    sg = engines / "sglang"
    real = {
        "vllm.utils.hashing": v / "vllm/utils/hashing.py",
        "vllm.v1.core.kv_cache_utils": v / "vllm/v1/core/kv_cache_utils.py",
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data":
            v / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/data.py",
        "lmcache.utils": lm / "lmcache/utils.py",
        "lmcache.v1.token_database": lm / "lmcache/v1/token_database.py",
        "sglang.srt.mem_cache.cpp_utils.native_hash":
            sg / "sglang/srt/mem_cache/cpp_utils/native_hash.py",
        "sglang.srt.mem_cache.utils": sg / "sglang/srt/mem_cache/utils.py",
        "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store":
            sg / "sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py",
    }
    prefixes = ("vllm", "lmcache", "sglang", "torch", "transformers", "numpy", "triton",
                "regex", "msgspec", "mooncake", "nvtx", "prometheus_client", "zmq",
                "sgl_kernel", "psutil", "requests", "aiohttp", "pydantic", "safetensors")
    _REAL.update(real)
    # nvtx.annotate(...) decorates LMCache's process_tokens: it must hand the function back.
    nvtx = types.ModuleType("nvtx")
    nvtx.annotate = lambda *_a, **_kw: (lambda func: func)  # type: ignore[attr-defined]
    sys.modules["nvtx"] = nvtx
    sys.meta_path.insert(0, _StubFinder(prefixes, real))
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
    def __init__(self, name: str, path: str) -> None:
        self.lora_name = name
        self.lora_path = path


class _Request:
    """The fields of vllm.v1.request.Request that the block hasher reads."""

    def __init__(self, prompt: dict[str, Any]) -> None:
        self.all_token_ids = list(prompt["tokens"])
        self.num_tokens = len(self.all_token_ids)
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        lora = prompt.get("lora")
        self.lora_request = _Lora(lora["name"], lora["path"]) if lora else None
        self.cache_salt = prompt.get("cache_salt")
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}


def _vllm_worker() -> dict[str, Any]:
    import vllm.utils.hashing as hashing
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as mdata

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
    return {"cases": cases}


# ---------------------------------------------------------------------------- LMCache


def _lmcache_worker() -> dict[str, Any]:
    import torch  # the stub module: dtype sentinels only
    import vllm.v1.core.kv_cache_utils  # noqa: F401 - LMCache takes NONE_HASH from vLLM
    from lmcache.v1 import token_database as tdb

    cases = []
    settings = (("Qwen/Qwen3-8B", 1, 0, 256), ("meta-llama/Llama-3.1-8B", 2, 1, 256),
                ("Qwen/Qwen3-8B", 1, 0, 16))
    for algorithm in ("builtin", "sha256_cbor"):
        for model, world_size, worker_id, chunk_size in settings:
            config = types.SimpleNamespace(
                pre_caching_hash_algorithm=algorithm, chunk_size=chunk_size,
                save_unfull_chunk=False, remote_url=None, enable_pd=False,
                get_extra_config_value=lambda _key, default: default,
            )
            metadata = types.SimpleNamespace(
                model_name=model, world_size=world_size, worker_id=worker_id,
                kv_dtype=torch.bfloat16, use_mla=False,
            )
            db = tdb.ChunkedTokenDatabase(config, metadata)
            for prompt in PROMPTS:
                keys = [key.to_string() for _s, _e, key in db.process_tokens(tokens=prompt["tokens"])]
                cases.append({
                    "profile": "lmcache" if algorithm == "builtin" else f"lmcache:{algorithm}",
                    "block_size": chunk_size,
                    "model": model, "world_size": world_size, "worker_id": worker_id,
                    "kv_dtype": "bfloat16",
                    "prompt": prompt["id"],
                    "none_hash": tdb.NONE_HASH,
                    "keys": keys,
                })
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


class _RadixKey:
    def __init__(self, tokens: list[int], extra_key: str | None, cache_salt: str | None) -> None:
        self.token_ids = tokens
        self.extra_key = extra_key
        self.cache_salt = cache_salt

    def __len__(self) -> int:
        return len(self.token_ids)


class _HostPool:
    def get_page_buffer_meta(self, indices: list[int]) -> tuple[list[int], list[int]]:
        return [0] * (2 * len(indices)), [0] * (2 * len(indices))


def _sglang_worker(engines: Path, build: Path) -> dict[str, Any]:
    ext_path = _build_sglang_ext(engines, build)
    spec = importlib.util.spec_from_file_location("hicache_hash_cpp", ext_path)
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    import sglang.srt.utils.cpp_extension_loader as loader  # a stub module

    loader.load_extension_with_recovery = lambda **_kw: ext
    from sglang.srt.mem_cache import utils as mcu
    from sglang.srt.mem_cache.storage.mooncake_store import mooncake_store as ms

    cases = []
    for page_size in (16, 64):
        for prompt in PROMPTS:
            tokens = prompt["tokens"]
            full = len(tokens) // page_size * page_size
            lora = prompt.get("lora")
            extra_key = lora["id"] if lora else None
            salt = prompt.get("cache_salt")
            key = _RadixKey(tokens[:full], extra_key, salt)
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
    return {"cases": cases}


# ---------------------------------------------------------------------------- driver


def _run_worker(engine: str, engines: Path, build: Path, hashseed: str | None) -> Any:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    cmd = [sys.executable, __file__, "--engines", str(engines), "--build", str(build),
           "--worker", engine]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--build", type=Path, default=Path("/tmp/kvkeys_build"))
    parser.add_argument("--worker", choices=("vllm", "lmcache", "sglang"))
    args = parser.parse_args()
    engines = args.engines.resolve()

    if args.worker:
        _install(engines)
        import logging

        logging.disable(logging.CRITICAL)
        if args.worker == "vllm":
            result = _vllm_worker()
        elif args.worker == "lmcache":
            result = _lmcache_worker()
        else:
            result = _sglang_worker(engines, args.build)
        sys.stdout.write(json.dumps(result))
        return

    versions = _engine_versions(engines)
    prompts = PROMPTS
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    python = f"CPython {sys.version.split()[0]}"
    plan = {
        "vllm": (None, "0", "12345"),
        "lmcache": ("0", "42"),
        "sglang": (None,),
    }
    for engine, seeds in plan.items():
        runs = []
        for seed in seeds:
            body = _run_worker(engine, engines, args.build, seed)
            runs.append({"pythonhashseed": seed, "cases": body["cases"]})
        doc = {
            "engine": engine,
            "engine_version": versions.get(engine, "unknown"),
            "recorded_with": python,
            "recorded_by": "scripts/record_key_vectors/record.py (engine's own code)",
            "prompts": prompts,
            "runs": runs,
        }
        if engine == "lmcache":
            doc["vllm_version"] = versions.get("vllm", "unknown")
        path = OUT_DIR / f"{engine}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        sys.stderr.write(f"wrote {path} ({sum(len(r['cases']) for r in runs)} cases)\n")


if __name__ == "__main__":
    main()
