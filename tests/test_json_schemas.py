"""Every ``--json`` document validates against the JSON Schema of its kind (docs/schemas/).

Each command with ``--json`` runs here once or twice, on embedded defaults and the test
fixtures' servers, cheaply. Two kinds are validated where their setup already runs:
``cluster.runbook`` (tests/cluster/test_hosts_runbook.py, namespaced hosts) and Mooncake's
``store.status`` (tests/store/test_mooncake_production.py). The vocabulary is docs/json.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl import SCHEMA_VERSION
from kvctl.keys.manifest import MANIFEST_KIND
from kvctl.metadata import open_metadata
from kvctl.output import KIND_RE
from kvctl.store.embedded import EmbeddedStore
from kvctl.store.settings import StoreSettings
from kvctl.units import DEPRECATED_KEYS
from kvctl.verdict import CHECK_STATUSES
from tests.cluster.test_commands import SMALL, cluster  # noqa: F401 - the fixture
from tests.fixtures.cli import CliResult
from tests.fixtures.schemas import REPO, SCHEMAS, schema_kinds, schema_path, validate_document
from tests.fixtures.sysfs import build_sysfs, h100_host, vm_host

Kvctl = Callable[..., CliResult]
EXAMPLES = REPO / "examples" / "keys"

#: Kinds whose documents are validated by another module (see the module docstring).
ELSEWHERE = {"cluster.runbook": "tests/cluster/test_hosts_runbook.py",
             "store.top": "tests/store/test_top.py",  # kvctl's and Mooncake's, with traffic
             # JSON lines of a watch over recorded engine streams on real ZeroMQ sockets
             "keys.watch": "tests/keys/watch/test_cli.py",
             "keys.watch-finding": "tests/keys/watch/test_cli.py"}


def emitted_kinds() -> set[str]:
    """Every kind kvctl's code prints (``emit_json("kind", ...)``), plus the key manifest."""
    found = set()
    for path in (REPO / "kvctl").rglob("*.py"):
        found |= set(re.findall(r"emit_json\(\s*\"([^\"]+)\"", path.read_text()))
    return found | {MANIFEST_KIND}


#: Old names of renamed unit keys (schema 1), by their new name (docs/json.md).
OLD_NAMES = {old: new for new, old in DEPRECATED_KEYS.items()}
#: A key that says "gbps": read as gigabits by most network tools, so never a name of its own.
UNITLESS = ("gbps", "gbitps")


def unitless_keys(value: Any, path: str = "") -> list[str]:
    """Where a JSON value has a key ending in ``gbps`` that is not a deprecated alias written
    next to its new name with the same value."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key.endswith(UNITLESS):
                new = OLD_NAMES.get(key)
                if new is None or new not in value or value[new] != item:
                    found.append(f"{path}/{key}")
            found += unitless_keys(item, f"{path}/{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += unitless_keys(item, f"{path}/{i}")
    return found


def _checked(result: CliResult, kind: str, codes: tuple[int, ...] = (0,)) -> dict[str, Any]:
    assert result.exit_code in codes, (result.exit_code, result.stderr[-2000:])
    doc = json.loads(result.stdout)
    assert validate_document(doc) == kind
    assert unitless_keys(doc) == [], f"{kind}: a *gbps key without its *_gbytes_per_s twin"
    if "checks" in doc and "ok" in doc:  # a verdict: ok is false exactly when a check failed
        assert doc["ok"] is not any(c["status"] == "fail" for c in doc["checks"]), doc["checks"]
    return doc


# ---------------------------------------------------------------- the vocabulary itself


def test_every_kind_has_a_schema_and_every_schema_a_kind() -> None:
    emitted = emitted_kinds()
    assert emitted - schema_kinds() == set(), "add docs/schemas/<kind>.schema.json"
    assert schema_kinds() - emitted == set(), "a schema no command prints: remove it"


def test_kinds_are_dotted_and_every_schema_pins_its_kind_and_version() -> None:
    for kind in emitted_kinds():
        assert KIND_RE.fullmatch(kind), kind
    for kind in schema_kinds():
        schema = json.loads(schema_path(kind).read_text())
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["properties"]["kind"] == {"const": kind}, kind
        if kind != MANIFEST_KIND:  # the manifest is a file format with its own version
            assert {"$ref": "common.schema.json#/$defs/envelope"} in schema["allOf"], kind


def test_the_common_schema_has_this_version_and_the_statuses() -> None:
    common = json.loads((SCHEMAS / "common.schema.json").read_text())
    defs = common["$defs"]
    assert defs["envelope"]["properties"]["schema_version"] == {"const": SCHEMA_VERSION}
    assert defs["check"]["properties"]["status"]["enum"] == list(CHECK_STATUSES)


def test_every_kind_is_run_by_a_test() -> None:
    text = Path(__file__).read_text().split("# ---------------------------------------------------"
                                            "------------- commands without servers")[1]
    ran = {kind for kind in emitted_kinds() if f'"{kind}"' in text} | {MANIFEST_KIND}
    assert emitted_kinds() - ran - set(ELSEWHERE) == set()
    for kind, where in ELSEWHERE.items():
        assert "validate_document" in (REPO / where).read_text(), (kind, where)


def test_docs_list_every_kind_with_its_schema() -> None:
    text = (REPO / "docs" / "json.md").read_text()
    for kind in schema_kinds():
        assert f"| `{kind}` |" in text, kind
        assert f"(schemas/{kind}.schema.json)" in text, kind
    assert "(json.md)" in (REPO / "docs" / "index.md").read_text()


def _schema_objects(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object schema (one with ``properties``) in ``node``, with its path."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            yield path, node
        for key, item in node.items():
            yield from _schema_objects(item, f"{path}/{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _schema_objects(item, f"{path}/{i}")


@pytest.mark.parametrize("kind", sorted(schema_kinds()))
def test_no_schema_requires_a_gbps_key_and_every_alias_is_deprecated(kind: str) -> None:
    """Scripts must not be told to read ``gbps``: docs/json.md renamed every such key to
    name its unit; the old name may stay, as a deprecated alias of the new one, never
    required (a document of the next schema version will not have it)."""
    schema = json.loads(schema_path(kind).read_text())
    for path, obj in _schema_objects(schema):
        required = obj.get("required", [])
        assert not [k for k in required if k.endswith(UNITLESS)], (kind, path, required)
        for key, prop in obj["properties"].items():
            if not key.endswith(UNITLESS):
                continue
            assert key in OLD_NAMES, f"{kind} {path}: {key} is not a documented old name"
            assert prop.get("deprecated") is True, (kind, path, key)
            assert OLD_NAMES[key] in obj["properties"], (kind, path, key)
            assert OLD_NAMES[key] in required or not required, (kind, path, OLD_NAMES[key])
        for example in obj.get("examples", []):
            assert unitless_keys(example) == [], (kind, path)


def test_the_gbps_walk_catches_a_key_without_its_twin() -> None:
    assert unitless_keys({"a": [{"gbps": 1.0, "gbytes_per_s": 1.0}]}) == []
    assert unitless_keys({"a": [{"gbps": 1.0}]}) == ["/a/0/gbps"]
    assert unitless_keys({"rate_gbps": 8.0, "rate_gbits_per_s": 1.0}) == ["/rate_gbps"]
    assert unitless_keys({"link_gbps": 1.0}) == ["/link_gbps"]


def test_a_document_that_breaks_its_schema_is_caught() -> None:
    good = {"schema_version": SCHEMA_VERSION, "kind": "doctor.env", "ok": True, "checks": [],
            "components": []}
    validate_document(good)
    for bad in ({**good, "schema_version": 1}, {**good, "ok": "yes"},
                {**good, "checks": [{"name": "x", "status": "passed"}]},
                {k: v for k, v in good.items() if k != "components"}):
        with pytest.raises(AssertionError):
            validate_document(bad)


# ---------------------------------------------------------------- commands without servers


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Inputs shared by the cases (built once: fake sysfs trees take a second each)."""
    tmp_path = tmp_path_factory.mktemp("schema-inputs")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": list(range(i, i + 40))})
                               + "\n" for i in range(3)))
    book = tmp_path / "book.yaml"
    book.write_text("name: schema\nsteps:\n  - check: doctor-env\n  - check: verify-keys\n"
                    "  - check: doctor-env\n    name: needs cuda\n    require: [cuda]\n")
    return {"tmp": str(tmp_path), "prompts": str(prompts), "book": str(book),
            "h100": str(build_sysfs(tmp_path / "h100", h100_host())),
            "vm": str(build_sysfs(tmp_path / "vm", vm_host()))}


CASES: list[tuple[str, list[str], tuple[int, ...]]] = [
    ("topo.matrix", ["topo", "--json"], (0,)),
    ("topo.matrix", ["topo", "--sysfs-root", "{h100}", "--format", "json"], (0,)),
    ("topo.doctor", ["topo", "doctor", "--sysfs-root", "{h100}", "--json"], (0, 1)),
    ("topo.doctor", ["topo", "doctor", "--sysfs-root", "{vm}", "--json"], (1,)),
    ("topo.snapshot", ["topo", "snapshot", "{tmp}/s.tar.gz", "--sysfs-root", "{vm}", "--json"],
     (0,)),
    ("doctor.env", ["doctor", "env", "--metadata", "memory://", "--json"], (0,)),
    ("doctor.env", ["doctor", "env", "--require", "memory", "--require", "cuda", "--json"],
     (3,)),
    ("doctor.env", ["doctor", "env", "--metadata", "http://127.0.0.1:1", "--require", "http",
                    "--json"], (3,)),
    ("sim.pool", ["sim", "pool", "--sessions", "12", "--local-blocks", "100,400", "--json"],
     (0,)),
    ("sim.pool", ["sim", "pool", "--sessions", "8", "--local-blocks", "200", "--model",
                  "llama-3-8b", "--prefill-tps", "5000", "--pool-gbytes-per-s", "10",
                  "--json"], (0,)),
    ("sim.trace", ["sim", "trace", str(REPO / "tests/sim/fixtures/mooncake_conversation_300.jsonl"),
                   "--instances", "2", "--pool-tokens", "1M", "--model", "llama-3-8b",
                   "--prefill-tps", "5000", "--nic-gbytes-per-s", "10", "--json"], (0,)),
    ("plan.readback", ["plan", "readback", "--model", "llama-3-70b", "--prefill-tps", "5000",
                       "--read-gbytes-per-s", "20", "--sessions", "100", "--context-tokens",
                       "4096", "--no-nvml", "--json"], (0,)),
    ("plan.readback", ["plan", "readback", "--model", "llama-3-8b", "--no-nvml", "--json"],
     (0,)),
    ("help.topics", ["help", "--json"], (0,)),
    ("help.topic", ["help", "store", "--json"], (0,)),
    ("runbook.check-kinds", ["runbook", "--list-checks", "--json"], (0,)),
    ("runbook.report", ["runbook", "{book}", "--json"], (1,)),
    ("keys.selfcheck", ["verify-keys", "--tenant-isolation", "--json"], (0,)),
    ("keys.profiles", ["verify-keys", "profiles", "--json"], (0,)),
    (MANIFEST_KIND, ["verify-keys", "emit", "--prompts", "{prompts}"], (0,)),
    ("keys.emit", ["verify-keys", "emit", "--prompts", "{prompts}", "-o", "{tmp}/m.json",
                   "--json"], (0,)),
    ("keys.compare", ["verify-keys", "compare", str(EXAMPLES / "host-a.json"),
                      str(EXAMPLES / "host-b.json"), str(EXAMPLES / "host-c.json"), "--json"],
     (1,)),
    ("bench.transfer", ["bench", "transfer", "-t", "tcp", "-b", "4KiB", "-n", "1", "-i", "2",
                        "--warmup", "1", "--expect-gbytes-per-s", "1000", "--json"], (1,)),
    ("cluster.plan", ["cluster", "plan", "1000", "--json"], (0,)),
]


@pytest.mark.parametrize(("kind", "argv", "codes"), CASES,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(CASES)])
def test_command_output_matches_its_schema(kvctl: Kvctl, files: dict[str, str], kind: str,
                                           argv: list[str], codes: tuple[int, ...]) -> None:
    _checked(kvctl(*(a.format(**files) for a in argv)), kind, codes)


# ---------------------------------------------------------------- a store in this process


@pytest.fixture
def store() -> Iterator[EmbeddedStore]:
    with EmbeddedStore(StoreSettings(listen="127.0.0.1:0", capacity=64 << 20)) as running:
        yield running


def test_store_client_commands(kvctl: Kvctl, store: EmbeddedStore, files: dict[str, str],
                               tmp_path: Path) -> None:
    m = ["--master", store.address]
    value = tmp_path / "v.bin"
    value.write_bytes(b"x" * 5000)
    _checked(kvctl("store", "put", "schema/k", str(value), *m, "--json"), "store.put")
    _checked(kvctl("store", "get", "schema/k", "-o", str(tmp_path / "out"), *m, "--json"),
             "store.get")
    assert _checked(kvctl("store", "ls", "schema/", *m, "--json"), "store.ls")["objects"]
    _checked(kvctl("store", "stat", "schema/k", *m, "--json"), "store.stat")
    status = _checked(kvctl("store", "status", *m, "--json"), "store.status")
    _checked(kvctl("store", "top", "--once", *m, "--json"), "store.top")
    _checked(kvctl("store", "rm", "schema/k", *m, "--json"), "store.rm")
    _checked(kvctl("store", "smoke", *m, "--json"), "store.smoke")
    _checked(kvctl("verify-keys", "--store", store.address, "--prompts", files["prompts"],
                   "--expect-hit", "0.5", "--json"), "keys.store-check", (1,))
    node = status["nodes"][0]["node_id"]
    _checked(kvctl("store", "node", "rm", node, *m, "--json"), "store.node.rm")


def test_metadata_client_commands(kvctl: Kvctl, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'meta'}"
    with open_metadata(url) as client:
        client.put("kvctl/schema/a", b"text")
        client.put("kvctl/schema/b", b"\xff\x00")
    _checked(kvctl("metadata", "ls", "-m", url, "--json"), "metadata.ls")
    _checked(kvctl("metadata", "get", "kvctl/schema/b", "-m", url, "--json"), "metadata.get")


# ---------------------------------------------------------------- servers: their first document


class Server:
    """``python -m kvctl ARGS --json``: its first document (the address card), then SIGTERM."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", *args, "--json"], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**clean, "PYTHONPATH": str(REPO), **(env or {})})
        self.card = self._card(" ".join(args))

    def _card(self, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                pytest.fail(f"kvctl {what} exited {self.proc.returncode} without a document: "
                            f"{self.proc.stderr.read()[-2000:] if self.proc.stderr else ''}")
            text += line
            with contextlib.suppress(ValueError):
                card: dict[str, Any] = json.loads(text)
                return card
        pytest.fail(f"kvctl {what}: no document within 30 s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.communicate(timeout=20)


@pytest.fixture
def servers() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Server:
        started.append(Server(*args, env=env))
        return started[-1]

    yield start
    for server in reversed(started):
        with contextlib.suppress(Exception):
            server.stop(signal.SIGKILL)


def _served(server: Server, kind: str) -> dict[str, Any]:
    assert validate_document(server.card) == kind
    return server.card


def test_store_servers(servers: Callable[..., Server], tmp_path: Path) -> None:
    runtime = {"XDG_RUNTIME_DIR": str(tmp_path)}
    _served(servers("store", "serve", "--listen", "127.0.0.1:0", "--capacity", "8MiB",
                    env=runtime), kind="store.serve")
    master = _served(servers("store", "master", "--listen", "127.0.0.1:0", env=runtime),
                     kind="store.master")
    _served(servers("store", "node", "--master", master["master"], "--capacity", "8MiB",
                    env=runtime), kind="store.node")


def test_metadata_and_segment_servers(servers: Callable[..., Server], kvctl: Kvctl,
                                      tmp_path: Path) -> None:
    _served(servers("metadata", "serve", "--listen", "127.0.0.1:0"), kind="metadata.serve")
    url = f"file://{tmp_path / 'meta'}"
    seg = servers("segment", "register", "schema-seg", "--size", "1MiB", "--listen",
                  "127.0.0.1:0", "--metadata", url)
    _served(seg, kind="segment.register")
    _checked(kvctl("segment", "list", "-m", url, "--json"), "segment.list")
    _checked(kvctl("segment", "show", "schema-seg", "-m", url, "--json"), "segment.show")
    seg.stop(signal.SIGKILL)  # leaves its entry behind for rm
    _checked(kvctl("segment", "rm", "schema-seg", "-m", url, "--json"), "segment.rm")


def test_bench_target_and_agent(servers: Callable[..., Server], tmp_path: Path) -> None:
    _served(servers("bench", "transfer", "--role", "target", "--listen", "127.0.0.1:0",
                    "--serve-for", "20s"), kind="bench.target")
    _served(servers("agent", "--metadata", f"file://{tmp_path / 'meta'}", "--hostname",
                    "schema-host", "--ttl", "5s"), kind="agent.record")


def test_cluster_commands(kvctl: Kvctl, cluster: Callable[..., str]) -> None:  # noqa: F811
    url = cluster(["a", "b"])
    _checked(kvctl("cluster", "ls", "--metadata", url, "--json"), "cluster.ls")
    _checked(kvctl("cluster", "bench", "--metadata", url, *SMALL, "--json"), "cluster.bench")
