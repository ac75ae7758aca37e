"""``kvctl cluster`` and ``kvctl agent`` at the command line, against simulated agents.

The agents run in this process with stand-in work (:mod:`tests.cluster.test_protocol`) and
share a ``file://`` metadata directory with the command, so these tests check parsing,
rendering, output formats and exit codes, not the fabric.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvctl.cluster.agent import Agent
from kvctl.cluster.protocol import BENCH, TARGET
from kvctl.metadata import open_metadata
from tests.cluster.test_protocol import fake_bench, fake_target, record
from tests.fixtures.cli import CliResult

Kvctl = Callable[..., CliResult]
SMALL = ["--block-size", "64KiB", "--batch-size", "4", "--duration", "0.1s", "--poll", "0.02s"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``cluster(names, speed={})`` starts simulated agents; returns the metadata URL."""
    started: list[Agent] = []
    url = f"file://{tmp_path / 'meta'}"
    client = open_metadata(url)

    def make(names: list[str], speed: dict[str, float] | None = None) -> str:
        handlers = {TARGET: fake_target, BENCH: fake_bench(speed or {})}
        for name in names:
            started.append(Agent(client, record(name, 2.0), handlers=handlers).start())
        return url

    yield make
    for agent in started:
        agent.close()
    client.close()


def test_ls_lists_the_hosts(kvctl: Kvctl, cluster: Callable[..., str]) -> None:
    url = cluster(["a", "b", "c"])
    doc = kvctl("cluster", "ls", "--metadata", url, "--json").json()
    assert doc["kind"] == "cluster.ls"
    assert [h["host"] for h in doc["hosts"]] == ["a", "b", "c"]
    assert all(h["state"] == "live" for h in doc["hosts"])
    table = kvctl("cluster", "ls", "--metadata", url)
    assert table.exit_code == 0, table.stderr
    assert "3 host(s) registered" in table.stdout


def test_bench_renders_the_matrix_csv_and_heatmap(kvctl: Kvctl, cluster: Callable[..., str],
                                                  tmp_path: Path) -> None:
    url = cluster(["a", "b", "c", "d"])
    r = kvctl("cluster", "bench", "--metadata", url, *SMALL)
    assert r.exit_code == 0, r.stderr
    assert "hosts: GB/s (10^9 B/s)" in r.stdout
    assert "diagnosis: median 1 GB/s" in r.stdout
    doc = kvctl("cluster", "bench", "--metadata", url, *SMALL, "--json").json()
    assert doc["kind"] == "cluster.bench"
    assert doc["ok"]
    assert len(doc["pairs"]) == 6
    assert doc["matrices"][0]["hosts"] == ["a", "b", "c", "d"]
    rows = list(csv.reader(io.StringIO(
        kvctl("cluster", "bench", "--metadata", url, *SMALL, "--csv").stdout)))
    assert rows[0] == ["matrix", "host", "a", "b", "c", "d"]
    assert rows[1][:3] == ["hosts", "a", ""]
    assert float(rows[1][3]) == 1.0
    png = tmp_path / "fabric.png"
    r = kvctl("cluster", "bench", "--metadata", url, *SMALL, "--plot", str(png))
    assert r.exit_code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_names_the_slow_host_and_exits_1(kvctl: Kvctl, cluster: Callable[..., str]
                                               ) -> None:
    url = cluster(["a", "b", "c", "d", "e"], speed={"c": 0.25})
    r = kvctl("cluster", "bench", "--metadata", url, *SMALL)
    assert r.exit_code == 1
    assert "likely culprit: c (4 of 4 pairs slow" in r.stdout
    assert "c: as initiator (its row)" in r.stdout
    assert "Error: cluster bench: likely culprit c" in r.stderr


def test_plan_prints_the_figures(kvctl: Kvctl) -> None:
    doc = kvctl("cluster", "plan", "1000", "10000", "--json").json()
    first, second = doc["plans"]
    assert (first["hosts"], first["rounds"], first["pairs"]) == (1000, 999, 499_500)
    assert second["rounds"] == 9_999
    table = kvctl("cluster", "plan", "1000")
    assert "499,500" in table.stdout


def test_commands_need_a_shared_metadata_service(kvctl: Kvctl) -> None:
    for args in (["cluster", "ls"], ["agent"], ["cluster", "bench"]):
        r = kvctl(*args)
        assert r.exit_code == 2, args
        assert "--metadata etcd://" in r.stderr


def test_bad_bench_options_are_usage_errors(kvctl: Kvctl, cluster: Callable[..., str]) -> None:
    url = cluster(["a", "b"])
    for extra, why in ((["-t", "shm"], "shm moves bytes within one host"),
                       (["--slow-fraction", "1.5"], "not between 0 and 1"),
                       (["--schedule", "mesh"], "unknown"),
                       (["--hosts", "a,zz"], "not registered")):
        r = kvctl("cluster", "bench", "--metadata", url, *SMALL, *extra)
        assert r.exit_code == 2, (extra, r.stderr)
        assert why in r.stderr, (extra, r.stderr)
