"""Prompts files: one JSON object per line, ``{"id": ..., "tokens": [ints]}``.

Optional per-request fields that engines mix into keys:

- ``"lora": {"name": ..., "path": ..., "id": ...}`` (vLLM mixes name and path, vLLM
  0.10.2-0.11.0 its integer ``lora_int_id`` given as ``id``; SGLang appends its
  ``lora_id`` to ``extra_key``: ``id`` when given, else derived from name and path as for
  ``--lora-paths`` adapters);
- ``"cache_salt": "..."`` (vLLM: first block only; SGLang: the storage namespace);
- ``"extra_key": "..."`` (SGLang's caller-defined request class);
- ``"mm": [{"identifier": ..., "offset": N, "length": M}, ...]``: multimodal items (vLLM
  mixes ``("mm", identifier, offset in block)`` into every block an item overlaps). The
  identifier is vLLM's ``mm_hash`` of the item, or the request's ``multi_modal_uuids``
  entry, prefixed ``"<lora name>:"`` when ``enable_tower_connector_lora`` is on; offset and
  length are the item's placeholder range in ``tokens`` (which hold the expanded
  placeholder tokens), sorted by offset;
- ``"prompt_embeds": {"path": FILE, "dtype": "bfloat16", "hidden_size": N}``: the prompt's
  embeddings as raw row-major bytes in the model's dtype (vLLM casts them to it before
  hashing), one row per token, FILE relative to the prompts file. vLLM mixes
  ``("prompt_embeds", SHA-256 of the block's rows)`` into each block; ``tokens`` may be left
  out (vLLM then holds token id 0 at every position);
- ``"kv_transfer_params": {...}``: the request's ``kv_transfer_params`` as sent to vLLM;
  LMCache appends each ``"lmcache.tag.<k>": v`` entry, in order, to every key as ``@k%v``.

A line may give ``"text"`` instead of ``"tokens"`` when a tokenizer is named
(:func:`load_tokenizer`). Blank lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import UnavailableError, UsageError

Tokenizer = Callable[[str], list[int]]
#: Largest token id a prompts file may hold: engines hash int64 ids (SGLang); kvctl's own
#: scheme and every uint32 packing refuse ids above 2**32-1 when they key them.
MAX_PROMPT_TOKEN_ID = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter as a request names it."""

    name: str
    path: str = ""
    id: str = ""



@dataclasses.dataclass(frozen=True)
class MmItem:
    """One multimodal item of a prompt, as vLLM's ``MultiModalFeatureSpec`` places it.

    Attributes:
        identifier: vLLM's ``identifier`` of the item (its ``mm_hash`` or given uuid).
        offset: first placeholder token of the item in the prompt.
        length: placeholder tokens of the item.
    """

    identifier: str
    offset: int
    length: int


#: Bytes per element of the dtypes prompt embeddings may be given in.
EMBED_DTYPE_BYTES = {"float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4}


@dataclasses.dataclass(frozen=True)
class PromptEmbeds:
    """A prompt's embeddings as vLLM holds them: raw bytes, one row per token.

    Attributes:
        data: row-major bytes in the model's dtype.
        row_bytes: bytes of one token's row (``hidden_size x dtype bytes``).
        source: where they were read from.
    """

    data: bytes
    row_bytes: int
    source: str = ""

    @property
    def rows(self) -> int:
        """Tokens covered."""
        return len(self.data) // self.row_bytes

    def block(self, start: int, end: int) -> bytes:
        """The rows of tokens ``start..end-1`` (what vLLM's ``tensor_data`` of the slice is)."""
        return self.data[start * self.row_bytes : end * self.row_bytes]

    @property
    def sha256(self) -> str:
        """SHA-256 of all rows, hex (names the embeddings in manifests)."""
        return hashlib.sha256(self.data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One request's prompt: token ids plus the per-request fields engines hash."""

    id: str
    tokens: tuple[int, ...]
    lora: LoraRef | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    mm: tuple[MmItem, ...] = ()
    prompt_embeds: PromptEmbeds | None = None
    lmcache_tags: tuple[tuple[str, str], ...] = ()


def _bad(path: Path, line: int, what: str, hint: str) -> UsageError:
    return UsageError(f"prompts file {path}, line {line}: {what}", hint)


def _str_field(obj: dict[str, Any], key: str, path: Path, line: int) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(path, line, f"{key!r} must be a string, found {type(value).__name__}",
                   f'write e.g. "{key}": "tenant-a"')
    return value


def parse_prompt(obj: Any, *, path: Path, line: int, tokenizer: Tokenizer | None) -> Prompt:
    """Validate one decoded line of a prompts file."""
    hint = 'write one object per line: {"id": "p1", "tokens": [1, 2, 3]}'
    if not isinstance(obj, dict):
        raise _bad(path, line, f"expected a JSON object, found {type(obj).__name__}", hint)
    unknown = set(obj) - set(PROMPT_FIELDS)
    if unknown:
        raise _bad(path, line, f"unknown field(s) {', '.join(sorted(unknown))}",
                   f"known: {', '.join(PROMPT_FIELDS)}")
    pid = obj.get("id")
    if not isinstance(pid, str | int) or isinstance(pid, bool) or str(pid) == "":
        raise _bad(path, line, "missing or empty 'id'", hint)
    embeds = _prompt_embeds(obj.get("prompt_embeds"), path, line)
    tokens: list[int]
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list):
            raise _bad(path, line, "'tokens' must be a list of integers", hint)
        for i, tok in enumerate(tokens):
            if not _is_int(tok) or not 0 <= tok <= MAX_PROMPT_TOKEN_ID:
                raise _bad(path, line, f"token {i} ({tok!r}) is not an integer in "
                           f"0..{MAX_PROMPT_TOKEN_ID}", "token ids are vocabulary indices")
    elif "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise _bad(path, line, "'text' must be a string", hint)
        if tokenizer is None:
            raise _bad(path, line, "a text prompt needs a tokenizer",
                       "pass --tokenizer NAME_OR_PATH, or give token ids in 'tokens'")
        tokens = list(tokenizer(text))
    elif embeds is not None:
        tokens = [0] * embeds.rows  # vLLM's all_token_ids of an embeddings-only prompt
    else:
        raise _bad(path, line, "neither 'tokens' nor 'text' is given", hint)
    if embeds is not None and len(tokens) != embeds.rows:
        raise _bad(path, line, f"'prompt_embeds' has {embeds.rows} rows for "
                   f"{len(tokens)} tokens", "give one embedding row per token")
    lora = None
    if obj.get("lora") is not None:
        raw = obj["lora"]
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
            raise _bad(path, line, "'lora' must be an object with a non-empty 'name'",
                       'write "lora": {"name": "sql-lora", "path": "/adapters/sql-lora"}')
        extra = set(raw) - {"name", "path", "id"}
        if extra or not all(isinstance(raw.get(k, ""), str) for k in ("path", "id")):
            raise _bad(path, line, "'lora' takes string fields name, path and id only",
                       'write "lora": {"name": "sql-lora", "path": "/adapters/sql-lora"}')
        lora = LoraRef(raw["name"], raw.get("path", ""), raw.get("id", ""))
    return Prompt(
        id=str(pid),
        tokens=tuple(tokens),
        lora=lora,
        cache_salt=_str_field(obj, "cache_salt", path, line),
        extra_key=_str_field(obj, "extra_key", path, line),
        mm=_mm_items(obj.get("mm"), len(tokens), path, line),
        prompt_embeds=embeds,
        lmcache_tags=lmcache_tags(obj.get("kv_transfer_params"), where=f"{path}, line {line}"),
    )


PROMPT_FIELDS = ("id", "tokens", "text", "lora", "cache_salt", "extra_key", "mm",
                 "prompt_embeds", "kv_transfer_params")
LMCACHE_TAG_PREFIX = "lmcache.tag."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mm_items(raw: Any, num_tokens: int, path: Path, line: int) -> tuple[MmItem, ...]:
    if raw is None:
        return ()
    hint = 'write "mm": [{"identifier": "<mm_hash>", "offset": 5, "length": 64}]'
    if not isinstance(raw, list):
        raise _bad(path, line, "'mm' must be a list of items", hint)
    items: list[MmItem] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) - {"identifier", "offset", "length",
                                                      "modality"}:
            raise _bad(path, line, f"mm[{i}] must be an object with identifier, offset and "
                       "length (and optionally modality)", hint)
        ident, offset, length = item.get("identifier"), item.get("offset"), item.get("length")
        if not isinstance(ident, str) or not ident:
            raise _bad(path, line, f"mm[{i}].identifier must be a non-empty string", hint)
        if not isinstance(offset, int) or not isinstance(length, int) or not _is_int(offset) \
                or not _is_int(length) or offset < 0 or length <= 0:
            raise _bad(path, line, f"mm[{i}]: offset must be >= 0 and length > 0", hint)
        if offset + length > num_tokens:
            raise _bad(path, line, f"mm[{i}] covers tokens {offset}..{offset + length - 1} "
                       f"of a {num_tokens}-token prompt",
                       "the placeholder tokens of every item are part of 'tokens'")
        if items and offset < items[-1].offset + items[-1].length:
            raise _bad(path, line, f"mm[{i}] starts before mm[{i - 1}] ends",
                       "list items by offset, as vLLM orders them; placeholder ranges do "
                       "not overlap")
        items.append(MmItem(ident, offset, length))
    return tuple(items)


def _prompt_embeds(raw: Any, path: Path, line: int) -> PromptEmbeds | None:
    if raw is None:
        return None
    hint = ('write "prompt_embeds": {"path": "p1.bin", "dtype": "bfloat16", '
            '"hidden_size": 4096} (raw row-major bytes in the model\'s dtype)')
    if not isinstance(raw, dict) or set(raw) != {"path", "dtype", "hidden_size"}:
        raise _bad(path, line, "'prompt_embeds' must have exactly path, dtype and hidden_size",
                   hint)
    file, dtype, hidden = raw["path"], raw["dtype"], raw["hidden_size"]
    if not isinstance(file, str) or not file or dtype not in EMBED_DTYPE_BYTES \
            or not _is_int(hidden) or hidden <= 0:
        raise _bad(path, line, "'prompt_embeds': path must be a string, dtype one of "
                   f"{', '.join(EMBED_DTYPE_BYTES)}, hidden_size a positive integer", hint)
    where = path.parent / file
    try:
        data = where.read_bytes()
    except OSError as exc:
        raise _bad(path, line, f"cannot read prompt_embeds file {where}: "
                   f"{exc.strerror or exc}", "the path is relative to the prompts file") from exc
    row = hidden * EMBED_DTYPE_BYTES[dtype]
    if not data or len(data) % row:
        raise _bad(path, line, f"prompt_embeds file {where} has {len(data)} bytes, not a "
                   f"multiple of one row ({hidden} x {dtype} = {row} bytes)", hint)
    return PromptEmbeds(data, row, str(where))


def lmcache_tags(raw: Any, *, where: str) -> tuple[tuple[str, str], ...]:
    """The ``lmcache.tag.<k>`` entries of a request's ``kv_transfer_params``, in order, as
    ``(k, str(v))``: what LMCache's ``CacheEngineKey`` appends as ``@k%v``.

    Raises:
        UsageError: not an object, or a tag whose value is not a string, number or bool.
    """
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: 'kv_transfer_params' must be an object",
                         'write e.g. "kv_transfer_params": {"lmcache.tag.user": "alice"}')
    tags = []
    for key, value in raw.items():
        if not key.startswith(LMCACHE_TAG_PREFIX):
            continue  # LMCache forwards other lmcache.* entries, but only tags enter keys
        if not isinstance(value, str | int | float):  # bool is an int
            raise UsageError(f"{where}: tag {key!r} has a {type(value).__name__} value",
                             "give tag values as strings or numbers")
        tags.append((key[len(LMCACHE_TAG_PREFIX):], str(value)))
    return tuple(tags)


def read_prompts(path: Path, *, tokenizer: Tokenizer | None = None) -> list[Prompt]:
    """Read and validate a prompts file.

    Raises:
        UsageError: unreadable file, a line that is not JSON or not a valid prompt, duplicate
            ids, or no prompts at all; the cause names the file and line.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read prompts file {path}: {exc}",
                         "check the --prompts path") from exc
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise _bad(path, number, f"not valid JSON ({exc.msg} at column {exc.colno})",
                       "each line must be one complete JSON object") from None
        prompt = parse_prompt(obj, path=path, line=number, tokenizer=tokenizer)
        if prompt.id in seen:
            raise _bad(path, number, f"id {prompt.id!r} already used on line {seen[prompt.id]}",
                       "give every prompt a unique id")
        seen[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise UsageError(f"prompts file {path} holds no prompts",
                         'add lines like {"id": "p1", "tokens": [1, 2, 3]}')
    return prompts


def load_tokenizer(name: str) -> Tokenizer:
    """A text → token ids function for ``name`` (a local path or a hub id).

    Tries the ``tokenizers`` package, then ``transformers``; neither is a kvctl dependency.

    Raises:
        UnavailableError: neither package is installed, or the tokenizer cannot be loaded.
    """
    try:
        from tokenizers import Tokenizer as HfTokenizer  # type: ignore[import-not-found]
    except ImportError:
        HfTokenizer = None  # noqa: N806
    if HfTokenizer is not None:
        try:
            if Path(name).is_file():
                tok = HfTokenizer.from_file(name)
            elif (Path(name) / "tokenizer.json").is_file():
                tok = HfTokenizer.from_file(str(Path(name) / "tokenizer.json"))
            else:
                tok = HfTokenizer.from_pretrained(name)
        except Exception as exc:
            raise UnavailableError(f"unavailable: cannot load tokenizer {name!r}: {exc}",
                                   "give a local tokenizer.json or a reachable model id") from exc

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False).ids)

        return encode
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found]
    except ImportError as exc:
        raise UnavailableError(
            "unavailable: text prompts need the 'tokenizers' or 'transformers' package",
            "pip install tokenizers (or give token ids in 'tokens')",
        ) from exc
    try:
        auto = AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise UnavailableError(f"unavailable: cannot load tokenizer {name!r}: {exc}",
                               "give a local tokenizer directory or a reachable model id") from exc

    def encode_auto(text: str) -> list[int]:
        ids: Sequence[int] = auto.encode(text, add_special_tokens=False)
        return list(ids)

    return encode_auto
