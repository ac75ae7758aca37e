"""What listeners tell peers: never 0.0.0.0, loopback only for loopback binds."""

from __future__ import annotations

import socket

import pytest

from kvctl.errors import UsageError
from kvctl.net.advertise import (
    advertised_addresses,
    advertised_hosts,
    host_of,
    interface_addresses,
    join_host_port,
    route_source,
)
from kvctl.store.node import node_listen_for

V4, V6 = int(socket.AF_INET), int(socket.AF_INET6)


def fake_interfaces() -> dict[str, list[tuple[int, str]]]:
    return {"lo": [(V4, "127.0.0.1"), (V6, "::1")],
            "eth0": [(V4, "192.0.2.10"), (V6, "fe80::1"), (V6, "2001:db8::10")],
            "ib0": [(V4, "198.51.100.7")]}


def test_wildcard_bind_advertises_interface_addresses_not_loopback_or_link_local() -> None:
    assert interface_addresses(interfaces=fake_interfaces) == ["192.0.2.10", "198.51.100.7"]
    assert interface_addresses(ipv6=True, interfaces=fake_interfaces) == [
        "192.0.2.10", "198.51.100.7", "2001:db8::10"]
    assert advertised_hosts("0.0.0.0", interfaces=fake_interfaces) == ("192.0.2.10",
                                                                       "198.51.100.7")
    assert advertised_hosts("0.0.0.0", prefer="198.51.100.7", interfaces=fake_interfaces) == (
        "198.51.100.7", "192.0.2.10")


def test_specific_binds_advertise_themselves_and_override_wins() -> None:
    assert advertised_hosts("127.0.0.1", interfaces=fake_interfaces) == ("127.0.0.1",)
    assert advertised_hosts("192.0.2.10", interfaces=fake_interfaces) == ("192.0.2.10",)
    assert advertised_hosts("0.0.0.0", ["kv-a.example"]) == ("kv-a.example",)
    assert advertised_addresses("0.0.0.0", 7400, ["kv-a", "kv-b:9000", "[2001:db8::1]"]) == (
        "kv-a:7400", "kv-b:9000", "[2001:db8::1]:7400")
    with pytest.raises(UsageError):
        advertised_addresses("0.0.0.0", 7400, ["kv-a:port"])


def test_a_host_with_only_loopback_advertises_loopback() -> None:
    assert advertised_hosts("0.0.0.0", interfaces=lambda: {"lo": [(V4, "127.0.0.1")]}) == (
        "127.0.0.1",)


def test_host_port_helpers() -> None:
    assert host_of("10.0.0.1:7400") == "10.0.0.1"
    assert host_of("[::1]:7400") == "::1"
    assert host_of("::1") == "::1"
    assert join_host_port("::1", 1) == "[::1]:1"
    assert join_host_port("h", 1) == "h:1"


def test_route_source_finds_the_local_address_for_a_peer() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("no-such-host.invalid") is None


def test_node_listen_follows_the_master() -> None:
    assert node_listen_for("127.0.0.1:50051", None) == "127.0.0.1:0"
    assert node_listen_for("0.0.0.0:50051", None) == "0.0.0.0:0"
    assert node_listen_for("127.0.0.1:50051", "127.0.0.1:9") == "127.0.0.1:9"
    with pytest.raises(UsageError) as info:
        node_listen_for("192.0.2.1:50051", "127.0.0.1:0")
    assert "--node-listen" in (info.value.hint or "")
    assert node_listen_for("192.0.2.1:50051", "127.0.0.1:0", ["kv-b"]) == "127.0.0.1:0"
