"""The Grafana dashboard and docs/metrics.md against the metrics kvctl's servers export,
read from their registries (no hand-kept list): a renamed metric fails here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "grafana" / "kvctl-dashboard.json"
NAMESPACES = ("kvctl_store", "kvctl_node", "kvctl_metadata", "kvctl_target", "kvctl_agent")

#: PromQL words that are not metric names: functions and aggregations are followed by
#: "(" and stripped that way; these are the keywords and modifiers.
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                       "offset", "bool", "and", "or", "unless", "inf", "nan"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([5m], [$__rate_interval])
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        after = text[m.end():].lstrip()
        if after.startswith("(") or m.group() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if m.start() and text[m.start() - 1] in "$0123456789.":
            continue  # a dashboard variable, or the exponent of a number
        names.add(m.group())
    return names


def test_the_extractor_finds_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.99, sum by (op, le) (rate(kvctl_a_bucket{op=~"get|put"}'
            '[$__rate_interval]))) / on (op) group_left sum(kvctl_b) + 1e3 * kvctl_c offset 5m')
    assert metric_names(expr) == {"kvctl_a_bucket", "kvctl_b", "kvctl_c"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    """Every sample name kvctl's servers export, from their own registries (the store's
    with a shared tier, whose metrics a master without one does not export)."""
    from kvctl.cluster.agent import Agent
    from kvctl.cluster.protocol import HostRecord
    from kvctl.metadata import open_metadata
    from kvctl.metadata.server import MetadataServer
    from kvctl.store.embedded import EmbeddedStore
    from kvctl.store.metrics import node_metrics, watch_node
    from kvctl.store.settings import StoreSettings

    names: set[str] = set()
    settings = StoreSettings(listen="127.0.0.1:0", capacity=4 << 20, metrics_port=0,
                             shared_tier=tmp_path_factory.mktemp("dashboard") / "tier")
    with EmbeddedStore(settings) as store:
        assert store.server.metrics is not None
        names |= store.server.metrics.names()
        node = node_metrics()  # what 'kvctl store node --metrics-port' serves
        watch_node(node, store.node)
        names |= node.names()
    metadata = ServerMetrics("kvctl_metadata")
    with MetadataServer(metrics=metadata):
        names |= metadata.names()
    names |= ServerMetrics("kvctl_target").names()  # what a bench target serves
    agent_metrics = ServerMetrics("kvctl_agent")
    record = HostRecord(hostname="h", agent_id="a", version="0", pid=1, started_at=0.0,
                        address="127.0.0.1")
    with open_metadata("memory://dashboard-test") as client:
        Agent(client, record, handlers={}, metrics=agent_metrics)
    names |= agent_metrics.names()
    return frozenset(names)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def test_every_dashboard_query_names_only_exported_metrics(exported: frozenset[str]) -> None:
    doc = json.loads(DASHBOARD.read_text())
    queried: set[str] = set()
    charts = [p for p in _panels(doc["panels"]) if p["type"] != "row"]
    assert len(charts) >= 20
    for panel in charts:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"panel {panel['title']!r}: no metric in {target['expr']!r}"
            unknown = names - exported
            assert not unknown, (f"panel {panel['title']!r} queries {sorted(unknown)}, "
                                 "which kvctl does not export")
            queried |= names
    # Every server has a place on the dashboard.
    for ns in NAMESPACES:
        assert any(n.startswith(ns + "_") for n in queried), f"nothing from {ns}"


def test_every_exported_metric_is_documented_with_its_unit(exported: frozenset[str]) -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = []
    for name in exported:
        base = re.sub(r"_(bucket|count|sum)$", "", name) if name.endswith(
            ("_bucket", "_count", "_sum")) and not name.endswith("_total") else name
        ns = next((n for n in NAMESPACES if base.startswith(n + "_")), None)
        generic = f"<ns>_{base.removeprefix(ns + '_')}" if ns else base
        if f"`{base}`" not in text and f"`{generic}`" not in text and f"`{base}{{" not in text:
            missing.append(base)
    assert not missing, f"docs/metrics.md does not list {sorted(set(missing))}"


def test_the_dashboard_lays_out_and_picks_its_data_source() -> None:
    doc = json.loads(DASHBOARD.read_text())
    taken: set[tuple[int, int]] = set()
    for panel in _panels(doc["panels"]):
        pos = panel["gridPos"]
        assert pos["x"] >= 0, panel["title"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
    names = [v["name"] for v in doc["templating"]["list"]]
    assert "datasource" in names
    assert len({p["id"] for p in _panels(doc["panels"])}) == len(list(_panels(doc["panels"])))
