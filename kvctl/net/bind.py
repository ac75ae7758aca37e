"""Bind policy: listeners use loopback unless told otherwise, and say so when not."""

from __future__ import annotations

import ipaddress
import logging
import socket

from kvctl.errors import UsageError

LOOPBACK = "127.0.0.1"
_log = logging.getLogger("kvctl.net")


def parse_listen(text: str, *, default_port: int = 0) -> tuple[str, int]:
    """Parse ``HOST:PORT``, ``HOST`` or ``:PORT`` (host defaults to 127.0.0.1)."""
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not sep:
        host, port_text = text, ""
    host = host.strip("[]") or LOOPBACK
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise UsageError(f"listen address {text!r} has a bad port", "write HOST:PORT") from None
    if not 0 <= port <= 65535:
        raise UsageError(f"port {port} in {text!r} is out of range", "use 0 (any) to 65535")
    return host, port


def is_loopback(host: str) -> bool:
    """A loopback address (``127.0.0.0/8``, ``::1``) or ``localhost``."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_unspecified(host: str) -> bool:
    """``0.0.0.0``, ``::`` or empty: bound to every interface."""
    return host.strip("[]") in ("", "0.0.0.0", "::")


def address_family(host: str) -> socket.AddressFamily:
    """``AF_INET6`` for an IPv6 literal (``::``, ``::1``), else ``AF_INET``."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def announce_bind(kind: str, host: str, port: int) -> None:
    """Log where a listener is bound; binding beyond loopback is logged as a warning."""
    if is_loopback(host):
        _log.info("%s listening on %s:%d (loopback)", kind, host, port)
    else:
        _log.warning("%s listening on %s:%d: reachable from other hosts by explicit choice",
                     kind, host, port)
