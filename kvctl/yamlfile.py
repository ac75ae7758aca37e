"""YAML from files people hand kvctl (configs, runbooks), with bounds.

``yaml.safe_load`` refuses arbitrary objects but not size: a few lines of nested aliases (a
"billion laughs") expand into gigabytes once anything walks the result. :func:`load_yaml`
caps the text's size, the number of aliases and the depth of nesting, and reports a bad
document as a :class:`~kvctl.errors.ConfigError` naming the source and the line.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvctl.errors import ConfigError

MAX_BYTES = 1 << 20
MAX_ALIASES = 64
MAX_DEPTH = 32


class _BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that counts aliases and nesting while it composes the document."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} aliases (*name)")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str, source: str, *, what: str = "file") -> Any:
    """Parse ``text`` (from ``source``) as one YAML document, bounded.

    Raises:
        ConfigError: too large, too many aliases, too deep, or not valid YAML.
    """
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{what} {source} is {len(text):,} bytes; the limit is {MAX_BYTES:,}",
                          "a kvctl config or runbook is a few kilobytes: check the path")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{what} {source} is not valid YAML{where}: {problem}",
                          "fix the YAML syntax (aliases and nesting are limited)") from None
    finally:
        loader.dispose()
