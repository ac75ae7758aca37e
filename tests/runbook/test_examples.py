"""The example runbooks of examples/runbooks/ run as their README says, on loopback.

Also: ``${VAR}`` substitution in runbook files and ``required: true`` steps, which the
multi-host examples rely on.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvctl.errors import ConfigError
from kvctl.runbook.model import Verdict, load_runbook, parse_runbook
from kvctl.runbook.runner import run_runbook
from tests.fixtures.cli import CliResult
from tests.fixtures.hosts import read_json_doc

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "runbooks"
START_DEADLINE_S = 20.0

Kvctl = Callable[..., CliResult]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rows(result: CliResult) -> dict[str, dict[str, Any]]:
    doc = result.json()
    assert doc["kind"] == "runbook.report"
    return {r["check"]: r for r in doc["results"]}


# -- ${VAR} substitution ------------------------------------------------------------------


def sim_step(**params: Any) -> dict[str, Any]:
    return {"steps": [{"check": "sim-pool", **params}]}


def test_variables_fill_values_which_then_get_their_parameter_type() -> None:
    book = parse_runbook(
        sim_step(name="pool ${WHO}", sessions="${N}", local_blocks="${A:-100},${B:-200}"),
        "book.yaml", env={"N": "12", "WHO": "blue", "B": "300"})
    step = book.steps[0]
    assert step.name == "pool blue"
    assert step.params.sessions == 12
    assert step.params.local_blocks == [100, 300]


@pytest.mark.parametrize("env", [{}, {"N": ""}])
def test_unset_or_empty_variable_names_file_step_key_and_variable(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_runbook({"steps": [{"check": "verify-keys"}, {"check": "sim-pool",
                                                            "sessions": "${N}"}]},
                      "book.yaml", env=env)
    assert info.value.cause == "book.yaml: step 2, sessions: environment variable N is not set"
    assert "export N=" in (info.value.hint or "")
    assert "${N:-default}" in (info.value.hint or "")


def test_default_used_when_unset_or_empty_and_dollar_escapes() -> None:
    book = parse_runbook({"name": "$${X} ${X:-dflt} $HOME", "steps": [{"check": "verify-keys"}]},
                         "book.yaml", env={"X": ""})
    assert book.name == "${X} dflt $HOME"  # only the braced form is a reference


@pytest.mark.parametrize("value", ["${1X}", "${X", "${X:default}", "${}"])
def test_malformed_references_are_errors(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_runbook(sim_step(name=value), "book.yaml", env={"X": "1"})
    assert "malformed variable reference" in info.value.cause
    assert "step 1, name" in info.value.cause


def test_values_cannot_change_the_document_structure() -> None:
    injected = "x\nsteps: []\n  - check: nosuch"
    book = parse_runbook({"name": "${X}", "steps": [{"check": "verify-keys"}]}, "book.yaml",
                         env={"X": injected})
    assert book.name == injected
    assert [s.kind.name for s in book.steps] == ["verify-keys"]
    with pytest.raises(ConfigError) as info:  # keys are never substituted
        parse_runbook(sim_step(**{"${X}": 1}), "book.yaml", env={"X": "sessions"})
    assert "${X}" in info.value.cause


def test_load_runbook_reads_the_process_environment(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "book.yaml"
    path.write_text("steps:\n  - check: sim-pool\n    sessions: ${KVEX_SESSIONS}\n")
    monkeypatch.setenv("KVEX_SESSIONS", "7")
    assert load_runbook(path).steps[0].params.sessions == 7
    monkeypatch.delenv("KVEX_SESSIONS")
    with pytest.raises(ConfigError) as info:
        load_runbook(path)
    assert str(path) in info.value.cause


# -- required: true ---------------------------------------------------------------------------


def test_required_turns_an_unavailable_check_into_a_failure() -> None:
    # A Mooncake master nobody runs: unavailable whether or not the package is installed.
    step = {"check": "store-smoke", "backend": "mooncake", "master": f"127.0.0.1:{free_port()}"}
    lenient = run_runbook(parse_runbook({"steps": [step]}, "t"))
    strict = run_runbook(parse_runbook({"steps": [{**step, "required": True}]}, "t"))
    assert [r.verdict for r in lenient.results] == [Verdict.SKIP]
    assert lenient.passed
    assert [r.verdict for r in strict.results] == [Verdict.FAIL]
    assert not strict.passed
    assert strict.results[0].measured.startswith("unavailable: ")
    assert strict.results[0].threshold == "required"
    assert strict.results[0].hint


def test_required_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError) as info:
        parse_runbook({"steps": [{"check": "verify-keys", "required": "yes"}]}, "book.yaml")
    assert "step 1 (verify-keys): required must be true or false" in info.value.cause


# -- documentation ------------------------------------------------------------------------


def test_readme_explains_every_example_and_every_variable() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    files = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".yaml", ".sh"))
    assert {"single-host.yaml", "two-hosts.yaml", "two-hosts-target.sh",
            "mooncake-cluster.yaml", "key-consistency.yaml"} <= set(files)
    for name in files:
        assert f"`{name}`" in readme, f"README.md does not explain {name}"
        for var in re.findall(r"\$\{([A-Z_]+)", (EXAMPLES / name).read_text()):
            assert f"`{var}`" in readme, f"README.md does not document {var} ({name})"


def test_single_host_example_is_the_builtin_byte_for_byte() -> None:
    builtin = REPO / "kvctl" / "runbook" / "builtin" / "single-host.yaml"
    assert (EXAMPLES / "single-host.yaml").read_bytes() == builtin.read_bytes()


# -- key-consistency ----------------------------------------------------------------------


def test_key_consistency_passes_on_matching_instances(
        kvctl: Kvctl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the example's default KEYS_DIR is relative to the checkout
    r = kvctl("runbook", "examples/runbooks/key-consistency.yaml", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    found = rows(r)
    assert found["scheme: self-check vllm:sha256_cbor"]["verdict"] == "pass"
    agree = found["across instances: instances agree"]
    assert agree["verdict"] == "pass"
    assert agree["measured"] == "5/5 prompt pairs match"


def test_key_consistency_diagnoses_an_instance_that_differs(
        kvctl: Kvctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Collect the manifests the way an operator would (KEYS_DIR), then add host C, which
    # ran with PYTHONHASHSEED=0 while A and B left it unset.
    keys_dir = tmp_path / "manifests"
    keys_dir.mkdir()
    for host in "abc":
        shutil.copy(REPO / "examples" / "keys" / f"host-{host}.json", keys_dir)
    doc = yaml.safe_load((EXAMPLES / "key-consistency.yaml").read_text())
    doc["steps"][1]["manifests"].append("${KEYS_DIR}/host-c.json")
    book = tmp_path / "three.yaml"
    book.write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)

    r = kvctl("runbook", str(book), "--json", env={"KEYS_DIR": str(keys_dir)})
    assert r.exit_code == 1
    agree = rows(r)["across instances: instances agree"]
    assert agree["verdict"] == "fail"
    assert agree["measured"] == "5/15 prompt pairs match"  # a=b; a≠c and b≠c on 5 prompts
    assert "diverge at block 0" in agree["hint"]
    assert "PYTHONHASHSEED differs" in agree["hint"]
    assert "Error: 1 check failed: across instances: instances agree" in r.stderr


# -- two hosts, on loopback -------------------------------------------------------------------


@pytest.fixture
def start_target() -> Iterator[Callable[..., dict[str, Any]]]:
    """Run examples/runbooks/two-hosts-target.sh on loopback; returns its bench.target doc."""
    bindir = str(Path(sys.executable).parent)
    if shutil.which("kvctl", path=bindir) is None:
        pytest.skip(f"no kvctl console script next to {sys.executable} (pip install -e .)")
    procs: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> dict[str, Any]:
        env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
               "LISTEN": "127.0.0.1:0"}
        proc = subprocess.Popen(
            ["sh", str(EXAMPLES / "two-hosts-target.sh"), "--json", "--serve-for", "60s",
             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        procs.append(proc)
        return read_json_doc(proc, timeout_s=START_DEADLINE_S)

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=5)


def _assert_cross_host_rows(found: dict[str, dict[str, Any]], address: str) -> None:
    transfer = {name: row for name, row in found.items()
                if name.startswith("cross-host transfer: ")}
    assert sorted(transfer) == [f"cross-host transfer: kvctl {op} tcp {size} x32"
                                for op in ("read", "write") for size in ("1 MiB", "64 KiB")]
    for row in transfer.values():
        assert row["verdict"] == "pass", row
        assert row["measured"].endswith(", verified")
        assert row["details"]["errors"] == 0
        assert address in row["details"]["path"]  # the target's engine, not a local one


@pytest.mark.integration
def test_two_hosts_by_address(kvctl: Kvctl, start_target: Callable[..., dict[str, Any]]) -> None:
    target = start_target()
    assert target["kind"] == "bench.target"
    r = kvctl("runbook", str(EXAMPLES / "two-hosts.yaml"), "--json",
              env={"BENCH_TARGET": target["peer"]})
    assert r.exit_code == 0, r.stdout + r.stderr
    _assert_cross_host_rows(rows(r), target["address"])


@pytest.mark.integration
def test_two_hosts_by_segment_name_through_metadata(
        kvctl: Kvctl, start_target: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    metadata = f"file://{tmp_path / 'metadata'}"
    target = start_target("--metadata", metadata, "--segment", "bench-example")
    assert target["peer"] == "bench-example"
    r = kvctl("runbook", str(EXAMPLES / "two-hosts.yaml"), "--json",
              env={"BENCH_TARGET": "bench-example", "BENCH_METADATA": metadata})
    assert r.exit_code == 0, r.stdout + r.stderr
    _assert_cross_host_rows(rows(r), target["address"])


def test_two_hosts_without_a_target_fails_with_a_hint(kvctl: Kvctl) -> None:
    r = kvctl("runbook", str(EXAMPLES / "two-hosts.yaml"), "--json",
              env={"BENCH_TARGET": f"127.0.0.1:{free_port()}"})
    assert r.exit_code == 1
    row = rows(r)["cross-host transfer"]
    assert row["verdict"] == "fail"
    assert "connection refused" in row["measured"]
    assert row["hint"]


def test_two_hosts_needs_the_target_variable(kvctl: Kvctl) -> None:
    r = kvctl("runbook", str(EXAMPLES / "two-hosts.yaml"))
    assert r.exit_code == 2
    assert "environment variable BENCH_TARGET is not set" in r.stderr
    assert "Hint: export BENCH_TARGET=" in r.stderr


# -- two hosts for real: tests/multihost/ runs the operator guide's examples on namespaced
# hosts (own network, /dev/shm, /tmp and hostname).


# -- Mooncake cluster -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mooncake_cluster() -> Iterator[str]:
    """A real mooncake_master with one storage process, on loopback."""
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    from kvctl.store.mooncake import MooncakeMaster, MooncakeUnavailableError

    try:
        master = MooncakeMaster(storage_bytes=256 << 20)
    except MooncakeUnavailableError as exc:
        pytest.skip(f"mooncake_master cannot run here: {exc.cause}")
    yield master.address
    master.close()


@pytest.mark.integration
def test_mooncake_cluster(kvctl: Kvctl, mooncake_cluster: str) -> None:
    r = kvctl("runbook", str(EXAMPLES / "mooncake-cluster.yaml"), "--json",
              env={"MOONCAKE_MASTER": mooncake_cluster})
    assert r.exit_code == 0, r.stdout + r.stderr
    found = rows(r)
    for check in ("single", "batch", "concurrent", "exists-remove"):
        assert found[f"mooncake store: {check}"]["verdict"] == "pass", found
    transfer = [row for name, row in found.items() if name.startswith("mooncake transfer: ")]
    assert len(transfer) == 4
    assert all(row["verdict"] == "pass" and row["measured"].endswith(", verified")
               for row in transfer), transfer


@pytest.mark.integration
def test_mooncake_cluster_unreachable_master_fails(kvctl: Kvctl) -> None:
    pytest.importorskip("mooncake.store", reason="pip install mooncake-transfer-engine-non-cuda")
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    r = kvctl("runbook", str(EXAMPLES / "mooncake-cluster.yaml"), "--json",
              env={"MOONCAKE_MASTER": dead})
    assert r.exit_code == 1
    row = rows(r)["mooncake store"]
    assert row["verdict"] == "fail"
    assert f"cannot reach mooncake_master at {dead}" in row["measured"]
    assert time.monotonic() - started < 30  # fails fast, no minute of Mooncake retries
