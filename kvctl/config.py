"""Layered configuration: defaults < YAML file < ``KVCTL_*`` environment < command-line flags.

Each command family declares its settings as a frozen dataclass registered under a section
name::

    @register_section("topo")
    @dataclass(frozen=True)
    class TopoSettings:
        sysfs_root: Path = Path("/")

The YAML file holds one mapping per section (``topo: {sysfs_root: /snap}``); the environment
spells the same key ``KVCTL_TOPO_SYSFS_ROOT``; keys of the ``common`` section have no section
part (``KVCTL_TOKEN``). Unknown sections, unknown keys and values of the wrong type are
:class:`~kvctl.errors.ConfigError` naming their source (file and key, or variable name).

Field metadata ``{"unit": "size"}`` parses ``64KiB``-style sizes, ``{"unit": "duration"}``
parses ``250ms``-style durations, ``{"secret": True}`` keeps a value out of every
rendering (:func:`redacted`), and ``{"old_name": "expect_gbps"}`` still accepts a renamed
key under its old name (file, environment, runbook step) with a deprecation warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvctl.errors import ConfigError, UsageError
from kvctl.units import parse_duration, parse_size
from kvctl.yamlfile import load_yaml

T = TypeVar("T")

_log = logging.getLogger("kvctl.config")

ENV_PREFIX = "KVCTL_"
#: Environment variables that are not settings of any section.
RESERVED_ENV = frozenset({"KVCTL_CONFIG", "KVCTL_DEBUG"})

_SECTIONS: dict[str, type[Any]] = {}


def register_section(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a frozen settings dataclass loadable as section ``name``."""

    def decorate(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to be a config section")
        _SECTIONS[name] = cls
        cls.__kvctl_section__ = name  # type: ignore[attr-defined]
        return cls

    return decorate


def known_sections() -> dict[str, type[Any]]:
    """Registered section names and their settings classes."""
    return dict(_SECTIONS)


@register_section("common")
@dataclasses.dataclass(frozen=True)
class CommonSettings:
    """Settings shared by every command family.

    Attributes:
        token: shared secret for listeners and clients (``KVCTL_TOKEN``); never printed.
        metadata: metadata service URL (``memory://``, ``file:///dir``, ``http://h:p``,
            ``etcd://h:2379``, ``redis://h:6379``).
        cluster_id: optional namespace under the ``kvctl/`` key prefix.
    """

    token: str | None = dataclasses.field(default=None, metadata={"secret": True})
    metadata: str = "memory://"
    cluster_id: str = ""


#: What a config "file" that can be read only once (``-c <(...)``, a FIFO) held, by path:
#: the file is read again for each section a command loads.
_READ_ONCE: dict[str, str] = {}


def _config_text(path: Path) -> str:
    key = str(path)
    if key in _READ_ONCE:
        return _READ_ONCE[key]
    text = path.read_text(encoding="utf-8")
    if not path.is_file():  # a pipe: a second read would find it empty
        _READ_ONCE[key] = text
    return text


def read_config_file(path: Path) -> dict[str, dict[str, Any]]:
    """Read and shape-check a YAML config file: a mapping of section → mapping.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML, or names an unknown section.
    """
    try:
        text = _config_text(path)
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror or exc}",
            "check the --config path (or KVCTL_CONFIG)",
        ) from exc
    data = load_yaml(text, str(path), what="config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of sections, found {type(data).__name__}",
            f"write sections like 'topo:' at the top level; known: {', '.join(sorted(_SECTIONS))}",
        )
    result: dict[str, dict[str, Any]] = {}
    for section, body in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"config file {path}: unknown section {section!r}",
                f"known sections: {', '.join(sorted(_SECTIONS))}",
            )
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(
                f"config file {path}: section {section!r} must be a mapping",
                "write 'key: value' lines under the section",
            )
        result[str(section)] = body
    return result


def env_name(section: str, key: str) -> str:
    """The environment variable that sets ``key`` of ``section``."""
    if section == "common":
        return f"{ENV_PREFIX}{key.upper()}"
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def load_section(
    cls: type[T],
    *,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> T:
    """Resolve a settings dataclass from its four layers.

    Args:
        cls: a class registered with :func:`register_section`.
        config_file: YAML file, or ``None`` for none (``KVCTL_CONFIG`` is read by the CLI).
        env: environment mapping (``os.environ`` when ``None``).
        flags: values given on the command line; ``None`` values mean "not given".

    Raises:
        ConfigError: an unknown key or a bad value, naming the file/variable/flag it came from.
    """
    section = getattr(cls, "__kvctl_section__", None)
    if section is None:
        raise TypeError(f"{cls.__name__} is not a registered config section")
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}

    if config_file is not None:
        body = read_config_file(config_file).get(section, {})
        for key, raw in body.items():
            name = _current_name(fields, str(key).replace("-", "_"),
                                 f"config file {config_file}: {section}.{key}")
            if name not in fields:
                raise ConfigError(
                    f"config file {config_file}: unknown key {section}.{key}",
                    f"known keys of {section!r}: {', '.join(sorted(fields))}",
                )
            source = f"{config_file}: {section}.{key}"
            values[name] = _coerce(raw, hints[name], fields[name], source)

    env_fields = {env_name(section, name): name for name in fields}
    env_old = {env_name(section, f.metadata["old_name"]): name
               for name, f in fields.items() if "old_name" in f.metadata}
    section_prefix = f"{ENV_PREFIX}{section.upper()}_"
    for var, raw in env.items():
        if var in env_fields:
            name = env_fields[var]
            values[name] = _coerce(raw, hints[name], fields[name], f"environment {var}")
        elif var in env_old:
            name = env_old[var]
            _deprecated(f"environment {var}", env_name(section, name))
            values.setdefault(name, _coerce(raw, hints[name], fields[name],
                                            f"environment {var}"))
        elif section != "common" and var.startswith(section_prefix) and var not in RESERVED_ENV:
            raise ConfigError(
                f"environment variable {var} is not a setting of {section!r}",
                f"known: {', '.join(sorted(env_fields))}; unset {var}",
            )

    for name, raw in (flags or {}).items():
        if raw is None:
            continue
        if name not in fields:
            raise TypeError(f"flag {name!r} is not a field of {cls.__name__}")
        flag = "--" + name.replace("_", "-")
        values[name] = _coerce(raw, hints[name], fields[name], f"option {flag}")

    return cls(**values)


def from_mapping(cls: type[T], data: Mapping[str, Any], source: str) -> T:
    """Build dataclass ``cls`` from a mapping (a YAML block), validating every key and value.

    Keys may use ``-`` or ``_``. Fields missing from ``data`` keep their defaults.

    Raises:
        ConfigError: an unknown key or a bad value, naming ``source`` and the key.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = _current_name(fields, str(key).replace("-", "_"), f"{source}: {key}")
        if name not in fields or not fields[name].init:
            raise ConfigError(
                f"{source}: unknown key {key!r}",
                f"known keys: {', '.join(sorted(n for n, f in fields.items() if f.init))}",
            )
        values[name] = _coerce(raw, hints[name], fields[name], f"{source}: {key}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}", "check the required keys and their values") from None


def _current_name(fields: Mapping[str, dataclasses.Field[Any]], name: str, source: str) -> str:
    """``name``, or the field it was renamed to (warned about as deprecated)."""
    if name in fields:
        return name
    for current, f in fields.items():
        if f.metadata.get("old_name") == name:
            _deprecated(source, current)
            return current
    return name


def _deprecated(source: str, new: str) -> None:
    _log.warning("%s is deprecated and will be removed in the next release; use %s instead",
                 source, new)


def redacted(settings: object) -> dict[str, Any]:
    """A settings dataclass as a dict with secret fields replaced by ``"***"``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        value = getattr(settings, f.name)
        if f.metadata.get("secret") and value is not None:
            value = "***"
        elif isinstance(value, Path):
            value = str(value)
        out[f.name] = value
    return out


def _coerce(raw: Any, hint: Any, field: dataclasses.Field[Any], source: str) -> Any:
    unit = field.metadata.get("unit")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    shown = "***" if field.metadata.get("secret") else repr(raw)
    try:
        if unit == "size":
            return parse_size(raw if isinstance(raw, int) else str(raw), what=source)
        if unit == "duration":
            return parse_duration(raw if isinstance(raw, int | float) else str(raw), what=source)
        if origin is list:
            items = raw.split(",") if isinstance(raw, str) else raw
            if not isinstance(items, list):
                raise ValueError("expected a list")
            return [_coerce(i, args[0], field, source) for i in items]
        if origin is tuple:
            items = raw.split(",") if isinstance(raw, str) else raw
            return tuple(_coerce(i, args[0], field, source) for i in items)
        return _scalar(raw, hint)
    except ConfigError:
        raise
    except UsageError as exc:  # a size or duration: its message names the source and value
        raise ConfigError(exc.cause, exc.hint) from None
    except Exception as exc:  # noqa: BLE001 - every parse failure becomes one typed error
        cause = getattr(exc, "cause", None) or str(exc)
        raise ConfigError(
            f"{source}: bad value {shown} ({cause})",
            f"expected {_describe(hint, unit)}",
        ) from None


def _scalar(raw: Any, hint: Any) -> Any:
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError("not a boolean")
    if hint is int:
        if isinstance(raw, bool):
            raise ValueError("not an integer")
        return int(str(raw).strip())
    if hint is float:
        if isinstance(raw, bool):
            raise ValueError("not a number")
        return float(raw)
    if hint is str:
        if isinstance(raw, dict | list):
            raise ValueError("not a string")
        return str(raw)
    if hint is Path:
        return Path(str(raw)).expanduser()
    if isinstance(hint, type) and issubclass(hint, str):  # str enums
        try:
            return hint(str(raw))
        except ValueError:
            raise ValueError(f"one of {', '.join(str(m.value) for m in hint)}") from None  # type: ignore[attr-defined]
    raise TypeError(f"unsupported settings type {hint!r}")


def _describe(hint: Any, unit: str | None) -> str:
    if unit == "size":
        return "a size such as 4096, 64KiB or 1MiB"
    if unit == "duration":
        return "a duration such as 10s or 250ms"
    if typing.get_origin(hint) is list:
        return "a list (YAML list or comma-separated)"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             Path: "a path"}
    if isinstance(hint, type) and issubclass(hint, str) and hint is not str:
        return "one of " + ", ".join(str(m.value) for m in hint)  # type: ignore[attr-defined]
    return names.get(hint, str(hint))
