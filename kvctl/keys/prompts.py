"""Prompts files: one JSON object per line, ``{"id": ..., "tokens": [ints]}``.

Optional per-request fields that engines mix into keys:

- ``"lora": {"name": ..., "path": ..., "id": ...}`` (vLLM mixes name and path; SGLang
  appends ``id``, default the name, to its ``extra_key``);
- ``"cache_salt": "..."`` (vLLM: first block only; SGLang: the storage namespace);
- ``"extra_key": "..."`` (SGLang's caller-defined request class).

A line may give ``"text"`` instead of ``"tokens"`` when a tokenizer is named
(:func:`load_tokenizer`). Blank lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvctl.errors import UnavailableError, UsageError
from kvctl.keys.chain import MAX_TOKEN_ID

Tokenizer = Callable[[str], list[int]]


@dataclasses.dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter as a request names it."""

    name: str
    path: str = ""
    id: str = ""

    @property
    def lora_id(self) -> str:
        """The id SGLang appends to ``extra_key`` (the name when none is given)."""
        return self.id or self.name


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One request's prompt: token ids plus the per-request fields engines hash."""

    id: str
    tokens: tuple[int, ...]
    lora: LoraRef | None = None
    cache_salt: str | None = None
    extra_key: str | None = None


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
    unknown = set(obj) - {"id", "tokens", "text", "lora", "cache_salt", "extra_key"}
    if unknown:
        raise _bad(path, line, f"unknown field(s) {', '.join(sorted(unknown))}",
                   "known: id, tokens, text, lora, cache_salt, extra_key")
    pid = obj.get("id")
    if not isinstance(pid, str | int) or isinstance(pid, bool) or str(pid) == "":
        raise _bad(path, line, "missing or empty 'id'", hint)
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list):
            raise _bad(path, line, "'tokens' must be a list of integers", hint)
        for i, tok in enumerate(tokens):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok <= MAX_TOKEN_ID:
                raise _bad(path, line, f"token {i} ({tok!r}) is not an integer in "
                           f"0..{MAX_TOKEN_ID}", "token ids are vocabulary indices")
    elif "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise _bad(path, line, "'text' must be a string", hint)
        if tokenizer is None:
            raise _bad(path, line, "a text prompt needs a tokenizer",
                       "pass --tokenizer NAME_OR_PATH, or give token ids in 'tokens'")
        tokens = list(tokenizer(text))
    else:
        raise _bad(path, line, "neither 'tokens' nor 'text' is given", hint)
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
    )


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
