"""GPU buffers on the bench's initiator side (``--local-location cuda:N``) through kvctl's
engine: the GPU segment the transports reach (dma-buf, peermem or staged), verified through
a host copy moved with the engine's ``write_local``/``read_local``.

Without a GPU, ``tests.fakes.cuda`` stands in for torch's CUDA memory in this process (the
embedded target is another process, so its buffer stays host memory); the ``gpu`` tests
run the real thing and skip here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvctl.bench.engines import EngineDriver, open_driver
from kvctl.bench.linerate import LineRates
from kvctl.bench.runner import SweepRunner, plan_for
from kvctl.bench.spec import BenchSettings, build_sweep
from kvctl.bench.verify import IntegrityError, Pattern
from kvctl.errors import UnavailableError
from tests.fakes import cuda as fake_cuda

SWEEP = ("-b", "64KiB", "-n", "4", "-i", "2", "--warmup", "0", "--verify", "--json")


needs_gpu = pytest.mark.skipif(not fake_cuda.real_gpu(), reason="needs torch with a CUDA device")


def test_no_gpu_is_unavailable_with_a_hint(kvctl: Callable[..., Any],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.install(monkeypatch, devices=0)
    r = kvctl("bench", "transfer", "--local-location", "cuda:0", "-t", "tcp", *SWEEP[:-1])
    assert r.exit_code == 3, r.stderr
    text = " ".join(r.stderr.split())
    assert "Error: nothing could run: kvctl: GPU segments unavailable: no CUDA device cuda:0" in (
        text)
    assert "Hint: run on a host with an NVIDIA GPU" in text


def test_a_gpu_index_past_the_visible_ones_is_refused_before_any_target_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.install(monkeypatch, devices=1)
    sweep = build_sweep(BenchSettings(transport="tcp", block_size="4KiB", batch_size="2",
                                      local_location="cuda:1"))
    with open_driver("kvctl") as driver, pytest.raises(UnavailableError, match="cuda:1"):
        driver.start(plan_for(sweep))
    assert driver._target is None  # type: ignore[attr-defined]


def test_gpu_initiator_rows_verified_over_shm_and_tcp(kvctl: Callable[..., Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch = fake_cuda.install(monkeypatch)
    r = kvctl("bench", "transfer", "--local-location", "cuda:0", "-t", "shm,tcp", *SWEEP)
    assert r.exit_code == 0, r.stderr
    rows = r.json()["rows"]
    assert [(row["transport"], row["op"]) for row in rows] == [
        ("shm", "read"), ("shm", "write"), ("tcp", "read"), ("tcp", "write")]
    for row in rows:
        assert (row["local_location"], row["verified"], row["errors"]) == ("cuda:0", True, 0)
    assert torch.allocations, "the local region was not GPU memory"


def test_corruption_is_caught_in_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads the GPU's bytes, not the host copy: a byte planted in the target
    after the pattern was written shows up after the READ back into GPU memory."""
    fake_cuda.install(monkeypatch)
    sweep = build_sweep(BenchSettings(op="write", transport="tcp", block_size="8KiB",
                                      batch_size="4", iterations=1, warmup=0, verify=True,
                                      local_location="cuda:0"))
    expected = Pattern.for_config(78, 0).expected(1, 8192)[100]

    def corrupt(driver: EngineDriver, used: str, stride: int) -> None:
        driver.poke_remote(used, 8192 + 100, bytes([expected ^ 0x0F]))

    with open_driver("kvctl") as driver:
        driver.start(plan_for(sweep))
        runner = SweepRunner(driver, sweep, line_rates=LineRates(), tamper=corrupt, run_id=78)
        with pytest.raises(IntegrityError, match="block 1 differs at byte offset 100"):
            list(runner.rows())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_real_gpu_to_gpu_bench(kvctl: Callable[..., Any], transport: str) -> None:
    fake_cuda.verified_rows(kvctl("bench", "transfer", "--local-location", "cuda:0",
                                  "--remote-location", "cuda:0", "-t", transport, *SWEEP))


@pytest.mark.gpu
@needs_gpu
def test_real_gpu_initiator_over_shm_to_host_memory(kvctl: Callable[..., Any]) -> None:
    fake_cuda.verified_rows(kvctl("bench", "transfer", "--local-location", "cuda:0", "-t",
                                  "shm", *SWEEP))
