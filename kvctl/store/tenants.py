"""Tenant namespaces: a connection that logs in with a tenant's token is confined to keys
under ``<tenant>/``.

The master is configured with tenants as ``NAME=TOKEN`` pairs (``kvctl store serve|master
--tenant NAME=TOKEN``, the ``store.tenants`` setting or ``KVCTL_STORE_TENANTS``). At login
the master tells which token the client proved (the shared token, or one tenant's) by
checking the HMAC answer against each in constant time; the tenant's namespace is sent back
in the login reply so the client can add and strip the prefix transparently. The master
checks every key of every request of a tenant connection (:func:`outside`) and answers
``forbidden`` when one falls outside; node-only requests (register, heartbeat) are
forbidden to tenants. The shared token stays the administrator's: it sees every key and is
the one nodes use.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvctl.errors import ConfigError
from kvctl.net import auth

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class Tenant:
    """One tenant: its name (the namespace is ``name + "/"``) and its token (never shown)."""

    name: str
    token: str = dataclasses.field(repr=False)

    @property
    def namespace(self) -> str:
        """The key prefix this tenant is confined to."""
        return f"{self.name}/"


def _token_file(path: str, name: str, source: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read the token file of tenant {name!r} ({path}): "
                          f"{getattr(exc, 'strerror', None) or exc}",
                          "write NAME=@FILE with a readable file holding the token") from None
    lines = text.splitlines()
    return lines[0].strip() if lines else ""


def inline_tenant_tokens(specs: Iterable[str]) -> list[str]:
    """Names of tenants whose token is written inline (``NAME=TOKEN``, not ``NAME=@FILE``)."""
    return [s.partition("=")[0].strip() for s in specs
            if "=" in s and not s.partition("=")[2].startswith("@")]


def parse_tenants(specs: Iterable[str], *, source: str = "--tenant") -> tuple[Tenant, ...]:
    """Tenants from ``NAME=TOKEN`` or ``NAME=@FILE`` strings (the token is the file's first
    line: a token on the command line is readable by every local user in /proc).

    Raises:
        ConfigError: a spec without ``=``, a bad name (letters, digits, ``._-``; up to 64),
            an empty token, or a name or token given twice (naming ``source``, never the
            token).
    """
    tenants: list[Tenant] = []
    names: set[str] = set()
    tokens: set[str] = set()
    for spec in specs:
        name, sep, token = spec.partition("=")
        name = name.strip()
        if token.startswith("@"):
            token = _token_file(token[1:], name, source)
        if not sep or not token:
            raise ConfigError(f"{source}: tenant {name or spec[:0]!r} has no token",
                              "write NAME=TOKEN, e.g. --tenant team-a=$(cat team-a.token)")
        if not _NAME.match(name):
            raise ConfigError(f"{source}: tenant name {name!r} is not valid",
                              "use 1-64 letters, digits, '.', '_' or '-' (no '/')")
        if name in names:
            raise ConfigError(f"{source}: tenant {name!r} is given twice",
                              "give each tenant once")
        if token in tokens:
            raise ConfigError(f"{source}: tenant {name!r} reuses another tenant's token",
                              "give every tenant its own token")
        names.add(name)
        tokens.add(token)
        tenants.append(Tenant(name, token))
    return tuple(tenants)


def check_admin_token(tenants: Sequence[Tenant], token: str | None) -> None:
    """Tenants need a shared token (nodes and administrators use it) distinct from theirs.

    Raises:
        ConfigError: tenants without a shared token, or a tenant using the shared token.
    """
    if not tenants:
        return
    if not token:
        raise ConfigError("tenants are configured but the store has no shared token",
                          "set KVCTL_TOKEN (nodes and administrators use it)")
    for t in tenants:
        if t.token == token:
            raise ConfigError(f"tenant {t.name!r} uses the shared token",
                              "give tenants tokens of their own")


def identify(token: str | None, tenants: Sequence[Tenant], nonce: bytes, context: bytes,
             answer: bytes) -> tuple[str, str] | None:
    """The namespace a login answer proves and the token it proved: ``""`` for the shared
    token, ``"<name>/"`` for a tenant's; ``None`` when it proves none (every token is
    checked, in constant time each)."""
    found: tuple[str, str] | None = None
    if token is not None and auth.check_response(token, nonce, context, answer):
        found = ("", token)
    for t in tenants:
        if auth.check_response(t.token, nonce, context, answer) and found is None:
            found = (t.namespace, t.token)
    return found


def outside(namespace: str, keys: Iterable[str]) -> str | None:
    """The first key not under ``namespace`` (``None`` when all are, or for the admin's
    empty namespace)."""
    if not namespace:
        return None
    for key in keys:
        if not key.startswith(namespace):
            return key
    return None
