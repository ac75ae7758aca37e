"""The MetadataClient contract, run against every backend (memory, file, http, etcd, redis)."""

from __future__ import annotations

import time

import pytest

from kvctl.errors import UsageError
from kvctl.metadata import (
    LeaseExpiredError,
    LeaseId,
    MetadataClient,
    key_prefix,
    open_metadata,
)
from tests.metadata._util import wait_until

TTL_S = 1.0
#: etcd checks lease expiry every 500 ms and rounds TTLs up to whole seconds.
MARGIN_S = 3.0


def test_put_get_overwrite_and_binary_values(client: MetadataClient, prefix: str) -> None:
    every_byte = bytes(range(256))
    client.put(prefix + "a", b"first")
    client.put(prefix + "a", b"second")
    client.put(prefix + "bin", every_byte)
    client.put(prefix + "empty", b"")
    client.put(prefix + "odd key/with spaces & %2F", b"x")
    assert client.get(prefix + "a") == b"second"
    assert client.get(prefix + "bin") == every_byte
    assert client.get(prefix + "empty") == b""
    assert client.get(prefix + "odd key/with spaces & %2F") == b"x"


def test_absent_is_none_not_error(client: MetadataClient, prefix: str) -> None:
    assert client.get(prefix + "missing") is None
    assert client.list(prefix) == {}
    assert client.delete(prefix + "missing") is False


def test_delete_reports_whether_it_existed(client: MetadataClient, prefix: str) -> None:
    client.put(prefix + "k", b"v")
    assert client.delete(prefix + "k") is True
    assert client.get(prefix + "k") is None
    assert client.delete(prefix + "k") is False


def test_list_is_a_prefix_scan_isolated_by_cluster(client: MetadataClient, prefix: str) -> None:
    other = key_prefix(prefix.split("/")[1] + "-other")  # kvctl/<id>-other/: shares the text
    client.put(prefix + "seg/a", b"1")
    client.put(prefix + "seg/b", b"2")
    client.put(prefix + "store/x", b"3")
    client.put(other + "seg/a", b"not mine")
    assert client.list(prefix + "seg/") == {prefix + "seg/a": b"1", prefix + "seg/b": b"2"}
    assert client.list(prefix) == {prefix + "seg/a": b"1", prefix + "seg/b": b"2",
                                   prefix + "store/x": b"3"}
    assert client.list(other) == {other + "seg/a": b"not mine"}
    assert client.list(prefix + "seg/*") == {}  # glob characters are literal
    client.delete(other + "seg/a")


def test_a_second_client_sees_the_same_entries(metadata_url: str, client: MetadataClient,
                                               prefix: str) -> None:
    client.put(prefix + "shared", b"v")
    with open_metadata(metadata_url) as second:
        assert second.get(prefix + "shared") == b"v"
        second.delete(prefix + "shared")
    assert client.get(prefix + "shared") is None


def test_lease_keepalive_extends_then_expiry_removes(client: MetadataClient, prefix: str) -> None:
    lease = client.grant_lease(TTL_S)
    client.put(prefix + "leased", b"v", lease=lease)
    client.put(prefix + "plain", b"p")
    # Renew for longer than the TTL: the entry must survive.
    end = time.monotonic() + TTL_S * 1.8
    while time.monotonic() < end:
        client.keepalive(lease)
        assert client.get(prefix + "leased") == b"v"
        time.sleep(TTL_S / 4)
    # Stop renewing: the entry disappears on its own, the unleased one stays.
    took = wait_until(lambda: client.get(prefix + "leased") is None, TTL_S + MARGIN_S)
    assert took > 0.2  # it was alive when renewals stopped
    assert prefix + "leased" not in client.list(prefix)
    assert client.get(prefix + "plain") == b"p"
    with pytest.raises(LeaseExpiredError):
        client.keepalive(lease)
    with pytest.raises(LeaseExpiredError):
        client.put(prefix + "late", b"v", lease=lease)
    assert client.get(prefix + "late") is None


def test_revoke_deletes_only_the_leases_entries(client: MetadataClient, prefix: str) -> None:
    lease = client.grant_lease(30)
    other = client.grant_lease(30)
    client.put(prefix + "a", b"1", lease=lease)
    client.put(prefix + "b", b"2", lease=lease)
    client.put(prefix + "c", b"3", lease=other)
    client.put(prefix + "d", b"4")
    client.revoke(lease)
    assert client.list(prefix) == {prefix + "c": b"3", prefix + "d": b"4"}
    client.revoke(lease)  # idempotent
    client.revoke(other)
    assert client.list(prefix) == {prefix + "d": b"4"}


def test_put_without_lease_detaches_entry_from_its_lease(client: MetadataClient,
                                                         prefix: str) -> None:
    lease = client.grant_lease(30)
    client.put(prefix + "k", b"leased", lease=lease)
    client.put(prefix + "k", b"now permanent")
    client.keepalive(lease)
    client.revoke(lease)
    assert client.get(prefix + "k") == b"now permanent"


def test_unknown_lease_is_refused(client: MetadataClient, prefix: str) -> None:
    with pytest.raises(LeaseExpiredError):
        client.put(prefix + "k", b"v", lease=LeaseId(987654321))
    with pytest.raises(LeaseExpiredError):
        client.keepalive(LeaseId(987654321))
    assert client.get(prefix + "k") is None


def test_bad_ttl_is_usage_error(client: MetadataClient) -> None:
    with pytest.raises(UsageError):
        client.grant_lease(0)


def test_close_is_idempotent(metadata_url: str) -> None:
    c = open_metadata(metadata_url)
    c.close()
    c.close()
