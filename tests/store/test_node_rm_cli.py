"""``kvctl store node rm``, node states in ``kvctl store status``, and ``--node-grace``."""

from __future__ import annotations

from collections.abc import Callable

from kvctl.store.client import StoreClient
from tests.fixtures.cli import CliResult
from tests.store.conftest import Cluster, wait_for
from tests.store.test_node_rm import two_nodes  # noqa: F401 - the fixture

Kvctl = Callable[..., CliResult]


def test_node_rm_drops_a_suspect_node_and_status_shows_each_state(
        kvctl: Kvctl, two_nodes: Cluster) -> None:  # noqa: F811 - the fixture
    """A stopped node shows as suspect (with when it was last seen, and how to drop it);
    ``node rm`` drops it: status then lists it as dropped, with why."""
    m = ["--master", two_nodes.address]
    with StoreClient(two_nodes.address, replicas=2, transport="tcp") as client:
        wait_for(lambda: len(client.status().nodes) == 2, what="two nodes")
        for i in range(10):
            client.put(f"k{i}", bytes([i]) * 5000)
        two_nodes.nodes.pop("a").close()
        wait_for(lambda: {n.node_id: n.state for n in client.status().nodes}
                 == {"a": "suspect", "b": "alive"}, what="node a suspect")
        # A wide terminal: this checks what status says, not how a narrow one squeezes it.
        r = kvctl("store", "status", *m, env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.stderr
        said = " ".join(r.stdout.split())  # lines for people wrap at the terminal's width
        assert "suspect" in said
        assert "node rm a" in said  # the way out is named
        assert "last seen" in said

        r = kvctl("store", "node", "rm", "a", *m, "--json")
        assert r.exit_code == 0, r.stderr
        assert r.json()["node_id"] == "a"
        assert r.json()["objects_with_a_copy"] == 10
        assert [n.node_id for n in client.status().nodes] == ["b"]
        said = " ".join(kvctl("store", "status", *m, env={"COLUMNS": "200"}).stdout.split())
        assert "dropped" in said
        assert "removed by an operator" in said
        doc = kvctl("store", "status", *m, "--json").json()
        assert [n["state"] for n in doc["dropped"]] == ["dropped"]


def test_node_rm_of_an_unknown_node_says_so(kvctl: Kvctl,
                                            two_nodes: Cluster) -> None:  # noqa: F811
    r = kvctl("store", "node", "rm", "nope", "--master", two_nodes.address)
    assert r.exit_code == 1
    assert "Error: no node 'nope' is registered" in r.stderr
    assert "Hint: see kvctl store status" in r.stderr


def test_node_rm_and_node_have_help_with_examples(kvctl: Kvctl) -> None:
    r = kvctl("store", "node", "rm", "--help")
    assert r.exit_code == 0
    assert "Example: kvctl store node rm" in r.stdout
    r = kvctl("store", "node", "--help")
    assert "rm" in r.stdout
    assert "Example: kvctl store node --master" in r.stdout


def test_node_grace_setting_reaches_the_master(kvctl: Kvctl) -> None:
    r = kvctl("store", "master", "--listen", "127.0.0.1:0", "--node-grace", "1s")
    assert r.exit_code == 2
    assert "node grace 1 s" in r.stderr
    assert "Hint:" in r.stderr
    r = kvctl("store", "master", "--help")
    assert "--node-grace" in r.stdout
