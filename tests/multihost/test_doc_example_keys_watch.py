"""docs/traffic.md's two-host ``kvctl verify-keys watch`` example, run as written on
namespaced hosts: the engines on hosts A and B are stood in for by publishers of the streams
vLLM 0.33.0's own ``ZmqEventPublisher`` recorded (tests/keys/events/), bound where vLLM binds
(``tcp://*:5557``, replay ``tcp://*:5558``); host C runs the documented command, only the
addresses substituted (:mod:`tests.fixtures.docexamples`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.docexamples import load_example, run_example
from tests.fixtures.hosts import MakeHosts
from tests.fixtures.nshosts import REPO, Host

DOC = REPO / "docs" / "traffic.md"

pytestmark = pytest.mark.integration


def _engine(host: Host, fixture: str) -> subprocess.Popen[bytes]:
    """A recorded vLLM stream published from ``host``, once it is bound (it prints ready)."""
    proc = host.popen(
        [sys.executable, "-m", "tests.keys.watch.publisher", fixture, "--serve-s", "120"],
        cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until bound, or EOF if it died
    assert line == b"ready\n", (line, proc.stderr.read() if proc.stderr else b"")
    return proc


def test_two_engines_with_different_seeds_diverge(nshosts: MakeHosts) -> None:
    steps = load_example(DOC, "keys-watch-two-hosts")
    assert [s.host for s in steps] == [2]  # hosts A and B: the engines, stood in for here
    assert steps[0].command.startswith("kvctl verify-keys watch a=tcp://10.0.0.1:5557,")
    net = nshosts(3)
    _engine(net[0], "vllm_sha256_cbor")  # PYTHONHASHSEED unset
    _engine(net[1], "vllm_sha256_cbor_seed1")  # PYTHONHASHSEED=1
    run = run_example(steps, net, check=False, timeout_s=90)
    done = run.last()
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    # the divergence, named with its first block, as it happened
    assert "hash the same blocks differently: first block" in done.stderr, done.stderr
    # the final report: the pair fails, b's fidelity fails with the seed as the likely cause
    assert "agreement: a / b" in done.stdout, done.stdout
    assert "fidelity: b" in done.stdout
    assert "pythonhashseed" in done.stdout
    for name in ("a", "b"):
        assert f"reachable: {name}" not in done.stdout  # both came over the namespaced net
