"""Key manifests: what one instance says its keys are, written to compare with others.

A manifest holds the instance's key settings (and a short fingerprint of them), where the
chain's first link came from, and for every prompt its key strings in block order plus a
digest of each block's token ids (so a comparison can tell "the tokens differ" from "the
hashing differs"). ``schema_version`` guards the format; reading checks every field and
names the file and the place of the first problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvctl import __version__
from kvctl.errors import UsageError
from kvctl.keys.chain import MAX_TOKEN_ID, SeedFields, pack_tokens, parse_extra_fields
from kvctl.keys.profiles import KeyConfig, KeyFormat, SeedInfo, get_profile, known_profiles
from kvctl.keys.profiles.base import EngineOptions, LmcacheHost
from kvctl.keys.prompts import LoraRef, MmItem, Prompt, lmcache_tags
from kvctl.keys.settings import KeysSettings

MANIFEST_KIND = "kvctl.keys.manifest"
MANIFEST_SCHEMA_VERSION = 1
#: Hex characters kept of each block's token digest (64 bits: enough to tell blocks apart).
TOKEN_DIGEST_HEX = 16


@dataclasses.dataclass(frozen=True)
class PromptKeys:
    """One prompt's keys in a manifest.

    Attributes:
        id: the prompt's id.
        num_tokens: its length in tokens.
        token_blocks: per full block, a digest of the block's token ids (hex).
        keys: per full block, the key string.
        lora: the request's LoRA adapter, if any.
        cache_salt: the request's salt, if any.
        extra_key: the request's SGLang extra key, if any.
        mm: the request's multimodal items (vLLM), if any.
        prompt_embeds: SHA-256 (hex) of the request's prompt embeddings, if any.
        lmcache_tags: the request's LMCache tags ``(k, v)``, if any.
    """

    id: str
    num_tokens: int
    token_blocks: tuple[str, ...]
    keys: tuple[str, ...]
    lora: LoraRef | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    mm: tuple[MmItem, ...] = ()
    prompt_embeds: str | None = None
    lmcache_tags: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One instance's key manifest.

    Attributes:
        config: the settings the keys were computed under.
        engine: engine the profile reproduces (``kvctl`` for kvctl's own scheme).
        engine_version: engine release the profile matches.
        seed: where the chain's first link came from.
        fingerprint: 16 hex characters naming ``config`` (equal settings, equal fingerprint).
        prompts: every prompt's keys.
        created_by: ``kvctl <version>``.
        source: file it was read from ('' when built in memory).
    """

    config: KeyConfig
    engine: str
    engine_version: str
    seed: SeedInfo
    fingerprint: str
    prompts: tuple[PromptKeys, ...]
    created_by: str = f"kvctl {__version__}"
    source: str = ""


def config_from_settings(
    settings: KeysSettings,
    *,
    extra_fields: Sequence[str] | Mapping[str, str] = (),
    env: Mapping[str, str] | None = None,
) -> KeyConfig:
    """The :class:`KeyConfig` of resolved settings, ``--seed-field`` pairs and the
    environment (``PYTHONHASHSEED`` is taken exactly as the engine process would see it).

    Raises:
        UsageError: unknown profile or key format, bad extra field, bad block size.
    """
    env = os.environ if env is None else env
    profile = get_profile(settings.profile)
    try:
        key_format = KeyFormat(settings.key_format)
    except ValueError:
        raise UsageError(f"unknown key format {settings.key_format!r}",
                         f"use one of {', '.join(f.value for f in KeyFormat)}") from None
    fields = SeedFields(
        model=settings.model, revision=settings.revision, tenant=settings.tenant,
        lora_name=settings.lora_name, lora_path=settings.lora_path,
        kv_dtype=settings.kv_dtype, kv_layout=settings.kv_layout,
        extra=parse_extra_fields(extra_fields),
    )
    fields.items()  # rejects duplicate extra names now, not at hashing time
    try:
        host = LmcacheHost(settings.lmcache_host)
    except ValueError:
        raise UsageError(f"unknown LMCache host {settings.lmcache_host!r}",
                         f"use one of {', '.join(h.value for h in LmcacheHost)}") from None
    options = EngineOptions(
        tp_size=settings.tp_size, num_kv_heads=settings.num_kv_heads, mla=settings.mla,
        pp_rank=settings.pp_rank, pp_size=settings.pp_size,
        save_unfull_chunk=settings.save_unfull_chunk, layer_id=settings.layer_id,
        lmcache_host=host, lora_paths=parse_lora_paths(settings.lora_paths),
    )
    # 0 is a bad size (refused by the profile), not "the default": only None is.
    block_size = (profile.default_block_size if settings.block_size is None
                  else settings.block_size)
    config = KeyConfig(
        profile=profile.name, block_size=block_size, fields=fields,
        pythonhashseed=env.get("PYTHONHASHSEED"), world_size=settings.world_size,
        worker_id=settings.worker_id, tp_rank=settings.tp_rank, key_format=key_format,
        store_prefix=settings.store_prefix, options=options,
    )
    profile.validate(config)
    return config


def parse_lora_paths(entries: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """SGLang's ``--lora-paths`` entries as ``(name, path)``: ``NAME=PATH``, or a bare
    ``PATH`` that is its own name (as SGLang reads them)."""
    pairs = []
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        name, sep, path = text.partition("=")
        pairs.append((name, path) if sep else (text, text))
    return tuple(pairs)


def apply_default_lora(prompt: Prompt, config: KeyConfig) -> Prompt:
    """``prompt`` with the configured LoRA adapter when it names none itself."""
    if prompt.lora is None and config.fields.lora_name:
        lora = LoraRef(config.fields.lora_name, config.fields.lora_path)
        return dataclasses.replace(prompt, lora=lora)
    return prompt


def _token_digest(block: Sequence[int]) -> str:
    if any(t > MAX_TOKEN_ID for t in block):  # ids past uint32: 0xff, then int64 LE each
        data = b"\xff" + b"".join(t.to_bytes(8, "little") for t in block)
    else:
        data = pack_tokens(block)
    return hashlib.sha256(data).hexdigest()[:TOKEN_DIGEST_HEX]


def token_block_digests(tokens: Sequence[int], block_size: int,
                        blocks: int | None = None) -> tuple[str, ...]:
    """A short digest of each keyed block's token ids (independent of any chaining).

    ``blocks`` is the number of keyed blocks (default: the full ones); the last may be a
    partial one (LMCache ``save_unfull_chunk``).
    """
    count = len(tokens) // block_size if blocks is None else blocks
    return tuple(_token_digest(tokens[i * block_size : (i + 1) * block_size])
                 for i in range(count))


def config_to_json(config: KeyConfig) -> dict[str, Any]:
    """``config`` as the manifest's ``config`` object."""
    fields = config.fields
    return {
        "profile": config.profile,
        "block_size": config.block_size,
        "model": fields.model,
        "revision": fields.revision,
        "tenant": fields.tenant,
        "lora_name": fields.lora_name,
        "lora_path": fields.lora_path,
        "kv_dtype": fields.kv_dtype,
        "kv_layout": fields.kv_layout,
        "extra": dict(fields.extra),
        "pythonhashseed": config.pythonhashseed,
        "world_size": config.world_size,
        "worker_id": config.worker_id,
        "tp_rank": config.tp_rank,
        "key_format": config.key_format.value,
        "store_prefix": config.store_prefix,
        # Only what differs from the engines' defaults: setups without these options keep
        # the manifests and fingerprints they had before the options existed.
        **({"options": changed} if (changed := config.options.changed()) else {}),
    }


def fingerprint(config: KeyConfig, engine_version: str) -> str:
    """16 hex characters naming the settings and the engine version they apply to."""
    doc = {"config": config_to_json(config), "engine_version": engine_version}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def emit(config: KeyConfig, prompts: Sequence[Prompt]) -> Manifest:
    """Compute every prompt's keys under ``config``."""
    profile = get_profile(config.profile)
    keyer = profile.keyer(config)
    entries = []
    for raw in prompts:
        prompt = apply_default_lora(raw, config)
        blocks = profile.keyed_blocks(len(prompt.tokens), config)
        entries.append(PromptKeys(
            id=prompt.id, num_tokens=len(prompt.tokens),
            token_blocks=token_block_digests(prompt.tokens, config.block_size, blocks),
            keys=tuple(keyer.keys(prompt)), lora=prompt.lora, cache_salt=prompt.cache_salt,
            extra_key=prompt.extra_key, mm=prompt.mm,
            prompt_embeds=prompt.prompt_embeds.sha256 if prompt.prompt_embeds else None,
            lmcache_tags=prompt.lmcache_tags,
        ))
    return Manifest(config=config, engine=profile.engine,
                    engine_version=profile.engine_version, seed=keyer.seed,
                    fingerprint=fingerprint(config, profile.engine_version),
                    prompts=tuple(entries))


def manifest_to_json(manifest: Manifest) -> dict[str, Any]:
    """The JSON document of ``manifest``."""
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "kind": MANIFEST_KIND,
        "created_by": manifest.created_by,
        "engine": manifest.engine,
        "engine_version": manifest.engine_version,
        "fingerprint": manifest.fingerprint,
        "config": config_to_json(manifest.config),
        "seed": {"source": manifest.seed.source, "value": manifest.seed.value},
        "prompts": [
            {
                "id": p.id,
                "num_tokens": p.num_tokens,
                "lora": dataclasses.asdict(p.lora) if p.lora else None,
                "cache_salt": p.cache_salt,
                "extra_key": p.extra_key,
                **_request_extras(p),
                "token_blocks": list(p.token_blocks),
                "keys": list(p.keys),
            }
            for p in manifest.prompts
        ],
    }


def _request_extras(p: PromptKeys) -> dict[str, Any]:
    """The per-request fields newer than schema 1's first form, written only when set."""
    out: dict[str, Any] = {}
    if p.mm:
        out["mm"] = [dataclasses.asdict(item) for item in p.mm]
    if p.prompt_embeds is not None:
        out["prompt_embeds_sha256"] = p.prompt_embeds
    if p.lmcache_tags:
        out["kv_transfer_params"] = {f"lmcache.tag.{k}": v for k, v in p.lmcache_tags}
    return out


def write_manifest(manifest: Manifest, path: Path) -> None:
    """Write ``manifest`` as JSON to ``path`` (atomically: a temporary file, then rename).

    Raises:
        UsageError: the file cannot be written.
    """
    text = json.dumps(manifest_to_json(manifest), indent=1) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise UsageError(f"cannot write manifest {path}: {exc.strerror or exc}",
                         "check the -o path and its directory's permissions") from exc


class _Reader:
    """Typed access to a decoded manifest that names the file and place of a problem."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> UsageError:
        return UsageError(f"manifest {self.path}: {where}: {what}",
                          "re-create it with 'kvctl verify-keys emit' (do not edit by hand)")

    def get(self, obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str,
            *, optional: bool = False) -> Any:
        if key not in obj or (optional and obj[key] is None):
            if optional:
                return None
            raise self.fail(where, f"missing field {key!r}")
        value = obj[key]
        if isinstance(value, bool) and kind is not bool:
            raise self.fail(f"{where}.{key}", "has the wrong type bool")
        if not isinstance(value, kind):
            raise self.fail(f"{where}.{key}", f"has the wrong type {type(value).__name__}")
        return value

    def str_list(self, obj: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
        values = self.get(obj, key, list, where)
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise self.fail(f"{where}.{key}[{i}]", "is not a string")
        return tuple(values)


def read_manifest(path: Path) -> Manifest:
    """Read and check a manifest.

    Raises:
        UsageError: unreadable, not JSON (names line and column), wrong kind or
            schema_version, or a missing/mistyped field (names its place).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read manifest {path}: {exc}",
                         "check the path; create manifests with 'kvctl verify-keys emit'") from exc
    r = _Reader(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"manifest {path}: not valid JSON at line {exc.lineno}, column "
                         f"{exc.colno} ({exc.msg})",
                         "the file is truncated or corrupted: emit it again") from None
    if not isinstance(doc, dict):
        raise r.fail("top level", "is not a JSON object")
    if doc.get("kind") != MANIFEST_KIND:
        raise r.fail("kind", f"is {doc.get('kind')!r}, not {MANIFEST_KIND!r}")
    version = doc.get("schema_version")
    if version != MANIFEST_SCHEMA_VERSION:
        raise UsageError(f"manifest {path}: schema_version {version!r} is not supported "
                         f"(this kvctl reads {MANIFEST_SCHEMA_VERSION})",
                         "emit the manifest again with this kvctl version")
    c = r.get(doc, "config", dict, "top level")
    extra = r.get(c, "extra", dict, "config")
    if not all(isinstance(v, str) for v in extra.values()):
        raise r.fail("config.extra", "values must be strings")
    key_format_text = r.get(c, "key_format", str, "config")
    try:
        key_format = KeyFormat(key_format_text)
    except ValueError:
        raise r.fail("config.key_format", f"unknown value {key_format_text!r}") from None
    config = KeyConfig(
        profile=r.get(c, "profile", str, "config"),
        block_size=r.get(c, "block_size", int, "config"),
        fields=SeedFields(
            model=r.get(c, "model", str, "config"),
            revision=r.get(c, "revision", str, "config"),
            tenant=r.get(c, "tenant", str, "config"),
            lora_name=r.get(c, "lora_name", str, "config"),
            lora_path=r.get(c, "lora_path", str, "config"),
            kv_dtype=r.get(c, "kv_dtype", str, "config"),
            kv_layout=r.get(c, "kv_layout", str, "config"),
            extra=tuple(sorted(extra.items())),
        ),
        pythonhashseed=r.get(c, "pythonhashseed", str, "config", optional=True),
        world_size=r.get(c, "world_size", int, "config"),
        worker_id=r.get(c, "worker_id", int, "config"),
        tp_rank=r.get(c, "tp_rank", int, "config"),
        key_format=key_format,
        store_prefix=r.get(c, "store_prefix", str, "config"),
        options=_read_options(r, c),
    )
    if config.block_size <= 0:
        raise r.fail("config.block_size", f"{config.block_size} is not positive")
    known = known_profiles().get(config.profile)
    s = r.get(doc, "seed", dict, "top level")
    seed = SeedInfo(r.get(s, "source", str, "seed"), r.get(s, "value", str, "seed"))
    prompts = []
    seen: set[str] = set()
    for i, p in enumerate(r.get(doc, "prompts", list, "top level")):
        where = f"prompts[{i}]"
        if not isinstance(p, dict):
            raise r.fail(where, "is not an object")
        pid = r.get(p, "id", str, where)
        if pid in seen:
            raise r.fail(where, f"duplicate prompt id {pid!r}")
        seen.add(pid)
        lora_obj = r.get(p, "lora", dict, where, optional=True)
        lora = None
        if lora_obj is not None:
            lora = LoraRef(r.get(lora_obj, "name", str, f"{where}.lora"),
                           r.get(lora_obj, "path", str, f"{where}.lora"),
                           r.get(lora_obj, "id", str, f"{where}.lora"))
        entry = PromptKeys(
            id=pid,
            num_tokens=r.get(p, "num_tokens", int, where),
            token_blocks=r.str_list(p, "token_blocks", where),
            keys=r.str_list(p, "keys", where),
            lora=lora,
            cache_salt=r.get(p, "cache_salt", str, where, optional=True),
            extra_key=r.get(p, "extra_key", str, where, optional=True),
            mm=_read_mm(r, p, where),
            prompt_embeds=r.get(p, "prompt_embeds_sha256", str, where, optional=True),
            lmcache_tags=_read_tags(r, p, where),
        )
        if len(entry.keys) != len(entry.token_blocks):
            raise r.fail(where, f"{len(entry.keys)} keys but {len(entry.token_blocks)} "
                         "token blocks")
        expected = (known.keyed_blocks(entry.num_tokens, config) if known is not None
                    else entry.num_tokens // config.block_size)
        if len(entry.keys) != expected:
            raise r.fail(where, f"{len(entry.keys)} keys do not fit {entry.num_tokens} tokens "
                         f"in blocks of {config.block_size}")
        prompts.append(entry)
    return Manifest(
        config=config,
        engine=r.get(doc, "engine", str, "top level"),
        engine_version=r.get(doc, "engine_version", str, "top level"),
        seed=seed,
        fingerprint=r.get(doc, "fingerprint", str, "top level"),
        prompts=tuple(prompts),
        created_by=r.get(doc, "created_by", str, "top level"),
        source=str(path),
    )


def _read_options(r: _Reader, c: Mapping[str, Any]) -> EngineOptions:
    o = r.get(c, "options", dict, "config", optional=True)
    if o is None:
        return EngineOptions()
    where = "config.options"
    known = {f.name for f in dataclasses.fields(EngineOptions)}
    unknown = set(o) - known
    if unknown:
        raise r.fail(where, f"unknown option(s) {', '.join(sorted(unknown))}")
    defaults = EngineOptions()
    pairs = r.get(o, "lora_paths", list, where, optional=True) or []
    if not all(isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
               for pair in pairs):
        raise r.fail(f"{where}.lora_paths", "must be a list of [name, path] pairs")
    host = r.get(o, "lmcache_host", str, where, optional=True)
    try:
        lmcache_host = defaults.lmcache_host if host is None else LmcacheHost(host)
    except ValueError:
        raise r.fail(f"{where}.lmcache_host", f"unknown value {host!r}") from None

    def value(name: str, kind: type) -> Any:
        got = r.get(o, name, kind, where, optional=True)
        return getattr(defaults, name) if got is None else got

    options = EngineOptions(
        tp_size=value("tp_size", int), num_kv_heads=value("num_kv_heads", int),
        mla=value("mla", bool), pp_rank=value("pp_rank", int), pp_size=value("pp_size", int),
        save_unfull_chunk=value("save_unfull_chunk", bool), layer_id=value("layer_id", int),
        lmcache_host=lmcache_host, lora_paths=tuple((a, b) for a, b in pairs),
    )
    try:
        options.validate()
    except UsageError as exc:
        raise r.fail(where, exc.cause) from None
    return options


def _read_mm(r: _Reader, p: Mapping[str, Any], where: str) -> tuple[MmItem, ...]:
    items = r.get(p, "mm", list, where, optional=True) or []
    out = []
    for i, item in enumerate(items):
        at = f"{where}.mm[{i}]"
        if not isinstance(item, dict):
            raise r.fail(at, "is not an object")
        out.append(MmItem(r.get(item, "identifier", str, at), r.get(item, "offset", int, at),
                          r.get(item, "length", int, at)))
    return tuple(out)


def _read_tags(r: _Reader, p: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    params = r.get(p, "kv_transfer_params", dict, where, optional=True)
    try:
        return lmcache_tags(params, where=f"manifest {r.path}: {where}")
    except UsageError:
        raise r.fail(f"{where}.kv_transfer_params", "tag values must be strings") from None
