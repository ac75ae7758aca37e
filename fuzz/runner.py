"""Run a harness under atheris in a child process (libFuzzer exits its process when done).

    python -m fuzz.runner transfer --runs 50000 --max-time 300

New interesting inputs go to a scratch directory, never into the committed corpus; a crash
leaves ``crash-*`` files under ``--artifacts`` (the scratch directory by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "corpus"
HARNESSES = ("transfer", "store", "metadata")


@dataclasses.dataclass(frozen=True)
class FuzzRun:
    """Outcome of one atheris run: exit status, runs executed, coverage edges, log tail."""

    returncode: int
    runs: int
    coverage: int
    output: str
    artifacts: tuple[Path, ...]


def run_harness(name: str, *, runs: int, max_time_s: int, scratch: Path,
                timeout_s: float | None = None) -> FuzzRun:
    """Fuzz harness ``name`` for ``runs`` executions (or ``max_time_s``), seeded with its
    committed corpus; returns what libFuzzer reported."""
    if name not in HARNESSES:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(HARNESSES)}")
    new_inputs = scratch / f"{name}-new"
    new_inputs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", f"fuzz.fuzz_{name}", f"-runs={runs}",
            f"-max_total_time={max_time_s}", "-max_len=4096", "-print_final_stats=1",
            f"-artifact_prefix={scratch}/{name}-", str(new_inputs), str(CORPUS / name)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout_s or max_time_s + 120, check=False)
    output = proc.stdout + proc.stderr
    done = re.findall(r"Done (\d+) runs", output)
    cov = re.findall(r"cov: (\d+)", output)
    artifacts = tuple(sorted(scratch.glob(f"{name}-crash-*")) + sorted(
        scratch.glob(f"{name}-timeout-*")) + sorted(scratch.glob(f"{name}-oom-*")))
    return FuzzRun(proc.returncode, int(done[-1]) if done else 0, int(cov[-1]) if cov else 0,
                   output[-6000:], artifacts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("harness", choices=HARNESSES)
    parser.add_argument("--runs", type=int, default=50000)
    parser.add_argument("--max-time", type=int, default=300)
    parser.add_argument("--artifacts", type=Path, default=None)
    args = parser.parse_args()
    scratch = args.artifacts or Path(tempfile.mkdtemp(prefix="kvctl-fuzz-"))
    result = run_harness(args.harness, runs=args.runs, max_time_s=args.max_time,
                         scratch=scratch)
    sys.stdout.write(result.output + "\n")
    sys.stdout.write(f"{args.harness}: {result.runs} runs, cov {result.coverage}, "
                     f"rc {result.returncode}, artifacts in {scratch}\n")
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
