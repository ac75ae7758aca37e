"""``kvctl cluster reset-policy``: the command a token-policy mismatch's hint can give (the
hint said "delete kvctl/cluster/policy from the metadata service", with no kvctl command
that deletes and no etcdctl installed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvctl.cluster.agent import agree_policy
from kvctl.cluster.protocol import ClusterKeys
from kvctl.metadata import open_metadata
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]


def test_a_policy_left_by_a_token_is_deleted_and_the_cluster_runs_without_one(
        kvctl: Kvctl, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'meta'}"
    with open_metadata(url) as client:
        agree_policy(client, ClusterKeys(), "old-token-0b1c", who="h1")
    refused = kvctl("cluster", "ls", "--metadata", url)
    assert refused.exit_code == 2, refused.stderr
    assert "requires the shared token" in refused.stderr
    assert f"kvctl cluster reset-policy --metadata {url} --yes" in refused.stderr
    asked = kvctl("cluster", "reset-policy", "--metadata", url)
    assert asked.exit_code == 2, asked.stderr
    assert "written by h1" in asked.stderr
    assert "--yes" in asked.stderr
    done = kvctl("cluster", "reset-policy", "--metadata", url, "--yes")
    assert done.exit_code == 0, done.stderr
    assert "deleted the token policy kvctl/cluster/policy (written by h1)" in done.stdout
    listed = kvctl("cluster", "ls", "--metadata", url)
    assert listed.exit_code == 0, listed.stderr
    again = kvctl("cluster", "reset-policy", "--metadata", url, "--yes")
    assert again.exit_code == 0
    assert "nothing to delete" in again.stdout


def test_a_tokenless_reset_is_refused_where_the_metadata_service_checks_writes(
        kvctl: Kvctl) -> None:
    """reset-policy needs no token (docs/cluster.md: it is for a cluster whose token is
    gone); what guards the policy is the metadata service's own write check: a
    ``kvctl metadata serve`` holding the token refuses the unsigned delete."""
    from kvctl.metadata.server import MetadataServer

    token = "live-token-7f3a"
    server = MetadataServer(port=0, token=token).start()
    try:
        with open_metadata(server.url, token=token) as client:
            agree_policy(client, ClusterKeys(), token, who="h1")
        refused = kvctl("cluster", "reset-policy", "--metadata", server.url, "--yes")
        assert refused.exit_code != 0, refused.stdout
        assert "deleted" not in refused.stdout
        assert "401" in refused.stderr or "token" in refused.stderr, refused.stderr
        with open_metadata(server.url, token=token) as client:
            assert client.get(ClusterKeys().policy) is not None
    finally:
        server.stop()
